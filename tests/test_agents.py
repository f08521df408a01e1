"""Multi-turn pieces in process: reading tool calls out of a turn (as SGLang's hermes/qwen25
detectors read them), the calculator, environments, how tool results become the model's next
tokens (a chat template's own tool turn, or the plain format the tiny model is warmed up on),
and the calc task's warm-up trajectories."""

from __future__ import annotations

import random

import pytest

from rlctl.agents.calculator import calculate
from rlctl.agents.calls import parse_hermes
from rlctl.agents.calculator import CalculatorEnv
from rlctl.agents.environments import Environment, ToolError
from rlctl.agents.turns import PlainTurns, TemplateTurns
from rlctl.errors import RecipeError
from rlctl.recipe import load_recipe
from conftest import QUICKSTART


def test_a_hermes_call_is_read_with_its_arguments_whatever_the_whitespace():
    text = 'Let me compute.<tool_call>\n{"name": "calc", "arguments": {"expr": "2*3"}}\n</tool_call>'
    (call,) = parse_hermes(text)
    assert (call.name, call.arguments, call.error) == ("calc", {"expr": "2*3"}, None)
    assert parse_hermes('<tool_call>{"name":"calc","arguments":{"expr":"1"}}</tool_call>')[0].arguments == {"expr": "1"}


def test_several_calls_in_order_as_blocks_or_a_list_and_parameters_for_arguments():
    text = ('<tool_call>{"name":"a","arguments":{}}</tool_call> <tool_call>[{"name":"b","parameters":{"x":1}},'
            '{"name":"c","arguments":"{\\"y\\": 2}"}]</tool_call>')
    assert [(c.name, c.arguments) for c in parse_hermes(text)] == [("a", {}), ("b", {"x": 1}), ("c", {"y": 2})]


def test_no_call_is_an_answer():
    assert parse_hermes("The answer is 42.") == []


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name":"calc","arguments":{"expr":"1"}</tool_call>', "not JSON"),
    ('<tool_call>{"arguments":{}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name":"calc","arguments":[1]}</tool_call>', "not a JSON object"),
    ('<tool_call>{"name":"calc","arguments":{}}', "without its </tool_call>"),
])
def test_a_block_that_is_no_call_is_a_failed_call_not_skipped(text, error):
    (call,) = parse_hermes(text)
    assert call.error is not None and error in call.error


@pytest.mark.parametrize("expr, value", [("23*47", "1081"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("7/2", "3.5"),
                                         ("-2**2", "-4"), ("10//3", "3"), ("2**10", "1024"), (" 6 / 3 ", "2")])
def test_the_calculator_computes_arithmetic(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr, error", [
    ("__import__('os').system('id')", "only numbers"), ("x+1", "only numbers"), ("'a'*3", "only numbers"),
    ("(1).__class__", "only numbers"), ("9**9**9", "beyond"), ("10**100", "beyond"), ("1/0", "division by zero"),
    ("1+" * 200 + "1", "over 200"), ("2*", "not an arithmetic"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expr, error):
    with pytest.raises(ToolError, match=error):
        calculate(expr)


def test_an_environment_answers_unknown_tools_and_wrong_arguments_with_a_tool_error():
    env = CalculatorEnv()
    assert env.step("calc", {"expr": "6*7"}) == "42"
    with pytest.raises(ToolError, match="no tool named 'search'; the tools are calc"):
        env.step("search", {})
    with pytest.raises(ToolError, match="calc: .*unexpected keyword argument 'x'"):
        env.step("calc", {"x": "1"})
    assert issubclass(CalculatorEnv, Environment)


def test_plain_turns_are_the_format_the_tiny_model_is_warmed_up_on():
    from rlctl.models.tiny import build_tokenizer
    from rlctl.rewards.tasks import TASKS

    tok = build_tokenizer()
    turns = PlainTurns(tok)
    assert turns.text(["1081"]) == "<tool_response>1081</tool_response>"
    assert tok.decode(turns.ids(["1081", "error: x"])) == "<tool_response>1081</tool_response><tool_response>error: x</tool_response>"
    rng = random.Random(0)
    for right in [True] * 5 + [False] * 20:
        prompt, demo = TASKS["calc"].demonstrate(rng, right)
        assert [by_model for _, by_model in demo] in ([True], [True, False, True])
        if len(demo) == 3:  # the tool's turn is what a rollout appends after that call
            (call,) = parse_hermes(demo[0][0])
            result = f"error: {call.error}" if call.error else CalculatorEnv().step(call.name, call.arguments)
            assert demo[1][0] == turns.text([result])
        if right:
            a, b = prompt[:-1].split("*")
            assert demo[2][0] == str(int(a) * int(b))  # the right trajectory answers the product


QWEN3_TOOLS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- m.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""Qwen3's template, reduced to its tool turns: consecutive tool messages share one user turn."""


def test_a_chat_templates_tool_turn_is_what_it_renders_between_the_models_turns(chat_tokenizer_factory):
    tok = chat_tokenizer_factory(QWEN3_TOOLS)
    turns = TemplateTurns(tok, QWEN3_TOOLS, {})
    assert turns.model_wrote == "<|im_end|>"
    expected = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert turns.text(["42", "ok"]) == expected
    # The whole conversation, rendered at once, is the prompt + the model's turn (ending in its
    # stop token) + the environment's turn + the model's next turn: token for token.
    messages = [{"role": "user", "content": "What is 6*7?"}]
    prompt = tok.apply_chat_template(messages, chat_template=QWEN3_TOOLS, tokenize=False, add_generation_prompt=True)
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>'
    whole = tok.apply_chat_template([*messages, {"role": "assistant", "content": call}, {"role": "tool", "content": "42"},
                                     {"role": "assistant", "content": "42"}], chat_template=QWEN3_TOOLS, tokenize=False)
    assert prompt + call + "<|im_end|>" + turns.text(["42"]) + "42<|im_end|>\n" == whole


def test_a_multi_turn_task_needs_its_environment_and_a_bad_environment_is_one_line():
    with pytest.raises(RecipeError, match="data.task=calc is answered with tools: set rollout.multi_turn.enabled=true"):
        load_recipe(QUICKSTART, ["data.task=calc"])
    with pytest.raises(RecipeError, match="environment: data.task=calc is answered with the calculator's tools"):
        load_recipe(QUICKSTART, ["data.task=calc", "rollout.multi_turn.enabled=true", "rollout.multi_turn.environment=python"])
    with pytest.raises(RecipeError, match=r"rollout.multi_turn.environment: 'nope' is not of the form module:Class"):
        load_recipe(QUICKSTART, ["rollout.multi_turn.enabled=true", "rollout.multi_turn.environment=nope"])
    with pytest.raises(RecipeError, match=r"rollout.multi_turn.environment: no module 'no_such_env'"):
        load_recipe(QUICKSTART, ["rollout.multi_turn.enabled=true", "rollout.multi_turn.environment=no_such_env:Env"])
    with pytest.raises(RecipeError, match="rollout.multi_turn.tool_parser: 'json' is not one of hermes, qwen3"):
        load_recipe(QUICKSTART, ["rollout.multi_turn.tool_parser=json"])


def test_an_environment_of_your_own_is_found_beside_the_recipe(tmp_path):
    (tmp_path / "my_env.py").write_text("class Lookup:\n    tools = []\n    def step(self, name, arguments):\n        return 'x'\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(QUICKSTART.read_text() + "\n")
    r = load_recipe(recipe, ["rollout.multi_turn.enabled=true", "rollout.multi_turn.environment=my_env:Lookup"])
    assert r.rollout.multi_turn.module_dir == str(tmp_path)
    assert r.rollout.multi_turn.load_environment()().step("any", {}) == "x"


def test_an_environment_that_cannot_be_made_or_reset_ends_the_run_saying_so():
    from rlctl.data import Prompt
    from rlctl.errors import RunError
    from rlctl.pipelines.episode import MultiTurn
    from rlctl.pipelines.groups import Group

    class Broken:
        tools: list = []

        def reset(self, row):
            raise KeyError("extra_info")

    multi = MultiTurn(Broken, lambda g: [], None, None, lambda ids: "", max_turns=2, max_tokens=10)
    with pytest.raises(RunError, match=r"rollout.multi_turn.environment: making or resetting one for prompt 7 raised "
                                       r"KeyError: 'extra_info'; fix the environment"):
        multi.environment(Group(0, 0, Prompt(7, "q", "a"), [1]))


def test_the_recipes_choices_are_the_agents_own():
    """The recipe layer names parsers and built-ins without importing them: the names agree."""
    from rlctl.agents.builtin import BUILTIN, environment_factory
    from rlctl.agents.calls import PARSERS
    from rlctl.recipe import MultiTurnConfig
    from rlctl.recipe.multi_turn import BUILTIN_ENVIRONMENTS, TOOL_PARSERS

    assert set(TOOL_PARSERS) == set(PARSERS) and set(BUILTIN_ENVIRONMENTS) == set(BUILTIN)
    assert environment_factory(MultiTurnConfig(enabled=True))().step("calc", {"expr": "2*21"}) == "42"
