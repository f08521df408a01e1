"""Prompts through a chat template, and rewards that see the row: the token ids the servers get
are the ones transformers' apply_chat_template gives, verl's and TRL's reward signatures are
called as written, and named scores and data sources become step metrics."""

from __future__ import annotations

import json

import pytest

from rlctl.data import DataError, Prompt
from rlctl.data.chat import PromptRenderer
from rlctl.metrics.step import step_metrics
from rlctl.recipe import DataConfig, RewardConfig
from rlctl.rewards.verifiers import make_verifier

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
          "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
"""A ChatML template as Qwen's tokenizers carry it (reduced), with Qwen3's enable_thinking switch."""


@pytest.fixture(scope="module")
def chat_tokenizer(chat_tokenizer_factory):
    """A byte-level BPE tokenizer with ChatML special tokens and a chat template, built here."""
    return chat_tokenizer_factory(CHATML)


def reference_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_the_servers_get_the_ids_apply_chat_template_gives(chat_tokenizer):
    renderer = PromptRenderer(chat_tokenizer, DataConfig(system_prompt="Be brief."))
    ids = renderer.ids(Prompt(0, "What is 2+3?", "5"))
    want = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    assert ids == reference_ids(chat_tokenizer, want)
    assert chat_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    # A row's own system message is kept; the recipe's is not added to it.
    own = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+3?"}]
    assert renderer.ids(Prompt(0, own, "5")) == reference_ids(chat_tokenizer, own)


def test_template_kwargs_a_template_file_and_none(chat_tokenizer, tmp_path):
    messages = [{"role": "user", "content": "What is 2+3?"}]
    quiet = PromptRenderer(chat_tokenizer, DataConfig(chat_template_kwargs={"enable_thinking": False}))
    assert quiet.ids(Prompt(0, messages, "5")) == reference_ids(chat_tokenizer, messages, enable_thinking=False)
    assert "<think>" in quiet.text(Prompt(0, messages, "5"))
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    filed = PromptRenderer(chat_tokenizer, DataConfig(chat_template=str(tmp_path / "plain.jinja")))
    assert filed.text(Prompt(0, "What is 2+3?", "5")) == "Q: What is 2+3?\nA:"
    raw = PromptRenderer(chat_tokenizer, DataConfig(chat_template="none"))
    assert raw.ids(Prompt(0, "What is 2+3?", "5")) == chat_tokenizer("What is 2+3?")["input_ids"]
    with pytest.raises(DataError, match="the prompts are chat messages and the model's tokenizer has no chat template"):
        raw.ids(Prompt(0, messages, "5"))


def test_a_tokenizer_without_a_template_sends_the_text_and_refuses_a_system_prompt(tiny_tokenizer):
    assert PromptRenderer(tiny_tokenizer, DataConfig()).ids(Prompt(0, "max(1,2)=", "2")) == \
        tiny_tokenizer("max(1,2)=")["input_ids"]
    with pytest.raises(DataError, match="data.system_prompt: the model's tokenizer has no chat template"):
        PromptRenderer(tiny_tokenizer, DataConfig(system_prompt="Be brief."))


@pytest.fixture
def tiny_tokenizer():
    from rlctl.models.tiny import build_tokenizer

    return build_tokenizer()


def reward(tmp_path, monkeypatch, source: str, name: str, **keys) -> RewardConfig:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return RewardConfig(verifier="function", function=f"{name}:score", **keys)


ROW = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "2+3?"}],
       "reward_model": {"ground_truth": "5"}, "extra_info": {"index": 7}}


def test_verls_compute_score_is_called_as_verl_calls_it(tmp_path, monkeypatch):
    verify = make_verifier(reward(tmp_path, monkeypatch,
                                  "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                  "    assert data_source == 'openai/gsm8k' and extra_info == {'index': 7}\n"
                                  "    return {'score': float(solution_str.endswith(ground_truth)), 'acc': 1.0}\n",
                                  "verl_reward", score_key="score"))
    assert verify("so 5", "5", ROW["prompt"], ROW).reward == 1.0
    assert verify("so 4", "5", ROW["prompt"], ROW).scores == {"score": 0.0, "acc": 1.0}


def test_trl_style_kwargs_get_every_field_and_a_dict_sums(tmp_path, monkeypatch):
    verify = make_verifier(reward(tmp_path, monkeypatch,
                                  "def score(completion, answer, prompt, **kwargs):\n"
                                  "    fmt = 0.25 if completion.startswith('so') else 0.0\n"
                                  "    return {'format': fmt, 'correct': 0.5 * (completion[-1] == answer),\n"
                                  "            'index': kwargs['extra_info']['index'] / 100}\n", "trl_reward"))
    got = verify("so 5", "5", ROW["prompt"], ROW)
    assert got.scores == {"format": 0.25, "correct": 0.5, "index": 0.07}
    assert got.reward == pytest.approx(0.82)


def test_a_dict_without_the_score_key_is_a_reward_error(tmp_path, monkeypatch):
    verify = make_verifier(reward(tmp_path, monkeypatch, "def score(response, answer):\n    return {'acc': 1}\n",
                                  "keyless_reward", score_key="score"))
    with pytest.raises(KeyError, match="returned a dict without 'score'"):
        verify("5", "5", "2+3?", {})


def test_named_scores_and_sources_become_step_metrics():
    events = [{"event": "step_start", "t": 0.0, "step": 0},
              {"event": "group_completed", "t": 1.0, "step": 0, "group": 0, "prompt_tokens": 4, "rewards": [1.0, 0.0],
               "lengths": [3, 3], "versions": [0, 0], "source": "gsm8k", "scores": {"format": [1.0, None]}},
              {"event": "group_completed", "t": 2.0, "step": 0, "group": 1, "prompt_tokens": 4, "rewards": [1.0, 1.0],
               "lengths": [3, 3], "versions": [0, 0], "source": "math", "scores": {"format": [0.0, 0.5]}},
              {"event": "step_end", "t": 3.0, "step": 0}]
    m = step_metrics(events, 0)
    assert (m["reward_mean"], m["reward_mean/gsm8k"], m["reward_mean/math"]) == (0.75, 0.5, 1.0)
    assert m["score_format"] == pytest.approx(0.5)


# -- a real run: what only the controller and its scoring processes show ------------------------


@pytest.mark.e2e
def test_a_run_on_verl_parquet_with_a_dict_reward_logs_scores_per_source(tmp_path):
    """A verl-layout Parquet of chat prompts (a template file renders them for the tiny model),
    a reward function with verl's signature returning named scores: the run completes, and its
    metrics hold each named score and the reward per data source. Two held-out sets are
    evaluated before training and at the end: the Parquet's first rows with the run's reward, and
    a save_to_disk dataset with a verifier of its own (its own scoring process)."""
    from conftest import FAST, QUICKSTART, rlctl
    from rlctl.run.dir import RunDir

    write_verl_task(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(QUICKSTART.read_text())
    res = rlctl("launch", str(recipe), *FAST, "run.steps=2", "model.init.warmup_steps=0", "data.source=file",
                "data.path=train.parquet", "data.chat_template=last.jinja", "reward.verifier=function",
                "reward.function=verl_reward:score", "reward.score_key=score", f"run.output_dir={tmp_path / 'runs'}",
                "eval.sets=[{path: train.parquet, name: train8, limit: 8, samples: 2}, "
                "{path: heldout, samples: 3, temperature: 0.5, reward: {verifier: exact}}]",
                cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "eval heldout (6 prompts x 3): mean@3 " in res.stderr and "(0 -> 2 steps)" in res.stderr
    (path,) = (tmp_path / "runs").iterdir()
    records = RunDir(path).metrics()
    assert len(records) == 2
    for m in records:
        assert {"score_score", "score_short", "score_index", "reward_mean/easy", "reward_mean/hard"} <= set(m)
        assert 0.0 < m["score_index"] < 0.32
    loaded = [e for e in RunDir(path).events() if e["event"] == "data_loaded"]
    assert [(e["rows"], e["left_out"]) for e in loaded] == [(32, 0)]
    # samples.jsonl: the first 2 groups of each step (run.sample_groups), 4 samples each, readable
    written = [json.loads(line) for line in RunDir(path).samples_path.read_text().splitlines()]
    groups = {(x["step"], x["group"]) for x in written}
    assert [sum(step == s for step, _ in groups) for s in (0, 1)] == [2, 2]
    assert [sum(x["step"] == s for x in written) for s in (0, 1)] == [8, 8]
    for x in written:
        assert x["prompt"][0]["role"] == "user" and x["source"] in ("easy", "hard")
        assert set(x["scores"]) == {"score", "short", "index"} and x["reward"] == x["scores"]["score"]
    shown = rlctl("samples", path.name, "--best", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("step 1 · group ") and "  response:" in shown.stdout
    check_evals(RunDir(path), final_version=records[-1]["optimizer_steps"])
    check_final_policy(tmp_path, RunDir(path), final_version=records[-1]["optimizer_steps"])
    status = rlctl("status", path.name, "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert "eval train8 (8 prompts x 2): mean@2 " in status.stdout


def write_verl_task(tmp_path) -> None:
    """train.parquet (verl's layout, 32 rows, sources easy and hard), a save_to_disk held-out set
    of 6 chat prompts, a template file and a reward function of verl's signature."""
    import random

    import datasets

    from rlctl.rewards.tasks import TASKS
    from test_data_files import write_parquet

    rng = random.Random(0)
    rows = []
    for i in range(32):
        prompt, answer = TASKS["max-digit"].sample(rng)
        rows.append({"data_source": "easy" if i % 2 else "hard", "prompt": [{"role": "user", "content": prompt}],
                     "reward_model": {"ground_truth": answer}, "extra_info": {"index": i}})
    write_parquet(tmp_path / "train.parquet", rows)
    heldout = [TASKS["max-digit"].sample(rng) for _ in range(6)]
    datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p}], "answer": a}
                                for p, a in heldout]).save_to_disk(str(tmp_path / "heldout"))
    (tmp_path / "last.jinja").write_text("{{ messages[-1]['content'] }}")
    (tmp_path / "verl_reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    correct = float(solution_str.strip() == ground_truth)\n"
        "    return {'score': correct, 'short': float(len(solution_str) <= 4), 'index': extra_info['index'] / 100}\n")


def check_final_policy(tmp_path, rd, final_version: int) -> None:
    """The run completed without a checkpoint (run.save_every 0): its final policy is RUN/final/,
    which `rlctl export` writes out and transformers loads with its tokenizer (test_launch.py
    checks that the weights are the trained ones)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import rlctl

    assert json.loads((rd.path / "final" / "final.json").read_text()) == {"steps": 2, "version": final_version}
    out = tmp_path / "exported"
    res = rlctl("export", rd.id, str(out), "--runs-dir", str(rd.path.parent), cwd=tmp_path)
    assert res.returncode == 0 and "exported the final policy after 2 steps" in res.stderr, res.stderr
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen3"
    assert AutoTokenizer.from_pretrained(out)("max(1,2,3)=")["input_ids"]


def check_evals(rd, final_version: int) -> None:
    """eval.jsonl: each set before training and after the last step, each at one weight version."""
    evals = rd.evals()
    assert [(e["set"], e["steps"]) for e in evals] == [("train8", 0), ("heldout", 0), ("train8", 2), ("heldout", 2)]
    for e in evals:
        assert e["versions"] == [e["version"]] == [0 if e["steps"] == 0 else final_version]
        assert e["prompts"] == (8 if e["set"] == "train8" else 6) and e["errors"] == 0
        assert 0.0 <= e["pass@1"] <= e[f"pass@{e['k']}"] <= 1.0
    assert set(evals[0]["by_source"]) == {"easy", "hard"} and "by_source" not in evals[1]
