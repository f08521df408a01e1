"""Built-in verifiable tasks: generators of (prompt, answer) pairs with a known right answer.

They are small enough for a character-level model on a CPU to learn in minutes, and each has a
`random_answer` of the right form, which the tiny model's warm-up uses to learn the answer format
without learning the task itself. A multi-turn task (rollout.multi_turn) also has `demonstrate`:
whole trajectories, right and wrong, that teach the warm-up its tool-call format.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from collections.abc import Callable

from rlctl.recipe.choices import TaskName

Pair = tuple[str, str]


@dataclass(frozen=True)
class Task:
    name: TaskName
    description: str
    sample: Callable[[random.Random], Pair]
    random_answer: Callable[[random.Random], str]
    alphabet: str
    """Every character a prompt or answer of this task can contain."""
    demonstrate: Callable[[random.Random, bool], tuple[str, list[tuple[str, bool]]]] | None = None
    """A multi-turn task: (prompt, its trajectory as (text, written by the model) turns), a right
    one or a wrong one; the warm-up trains on the model's turns, each ended by end-of-sequence."""


def _max_digit(rng: random.Random) -> Pair:
    digits = [rng.randint(0, 9) for _ in range(3)]
    return "max(" + ",".join(map(str, digits)) + ")=", str(max(digits))


def _add(rng: random.Random) -> Pair:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a}+{b}=", str(a + b)


def _calc(rng: random.Random) -> Pair:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}*{b}=", str(a * b)


def _calc_demo(rng: random.Random, right: bool) -> tuple[str, list[tuple[str, bool]]]:
    """A trajectory of the calc task: call calc with the prompt's product, read its result, answer
    it. Wrong ones (equally often): a call that is not JSON, a call with a wrong operand (its
    result then answered), or an answer without a call. The tool results are what the rollout's
    own parser, calculator and turn format make of the call (rlctl/agents/)."""
    from rlctl.agents.calls import parse_hermes
    from rlctl.agents.calculator import CalculatorEnv
    from rlctl.agents.environments import ToolError
    from rlctl.agents.turns import RESPONSE_CLOSE, RESPONSE_OPEN

    prompt, answer = _calc(rng)
    expr = prompt[:-1]
    mode = "right" if right else rng.choice(("not json", "operand", "no call"))
    if mode == "no call":
        return prompt, [(str(rng.randint(100, 9801)), True)]
    if mode == "operand":
        i = rng.choice([0, 1, 3, 4])
        expr = expr[:i] + str((int(expr[i]) + rng.randint(1, 9)) % 10 or 1) + expr[i + 1:]
    call = '<tool_call>{"name":"calc","arguments":{"expr":"' + expr + '"}}</tool_call>'
    if mode == "not json":
        call = call.replace('"}}', '"}', 1)
    found = parse_hermes(call)[0]
    try:
        result = f"error: {found.error}" if found.error else CalculatorEnv().step("calc", found.arguments)
    except ToolError as e:
        result = f"error: {e}"
    said = str(rng.randint(100, 9801)) if mode == "not json" else result
    return prompt, [(call, True), (RESPONSE_OPEN + result + RESPONSE_CLOSE, False), (said, True)]


TASKS: dict[TaskName, Task] = {
    t.name: t
    for t in (
        Task(TaskName.MAX_DIGIT, "the largest of three digits: max(3,9,2)= -> 9", _max_digit,
             lambda rng: str(rng.randint(0, 9)), "0123456789max(),="),
        Task(TaskName.ADD, "the sum of two digits: 3+4= -> 7", _add,
             lambda rng: str(rng.randint(0, 18)), "0123456789+="),
        Task(TaskName.CALC, "the product of two 2-digit numbers, with the calculator tool: 23*47= -> "
             "calc(23*47) -> 1081", _calc, lambda rng: str(rng.randint(100, 9801)), "0123456789*=",
             demonstrate=_calc_demo),
    )
}
