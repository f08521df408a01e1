"""Verifiers and prompt sources."""

from __future__ import annotations

import random
import sys
import textwrap

import pytest

from rlctl.data import DataError, prompt_stream
from rlctl.errors import RunError
from rlctl.recipe import DataConfig, RewardConfig
from rlctl.rewards.tasks import TASKS
from rlctl.rewards.verifiers import make_verifier


def test_exact_and_numeric():
    exact = make_verifier(RewardConfig(verifier="exact"))
    assert exact(" 9 ", "9").reward == 1.0 and exact("9.0", "9").reward == 0.0
    numeric = make_verifier(RewardConfig(verifier="numeric"))
    assert numeric("so the answer is 1,234.0", "1234").reward == 1.0
    assert numeric("12 then 13", "12").reward == 0.0  # the last number counts
    assert numeric("no number", "1").reward == 0.0


def test_math_verify_equivalence():
    math = make_verifier(RewardConfig(verifier="math"))
    assert math("The answer is $\\frac{1}{2}$", "0.5").reward == 1.0
    assert math("The answer is $\\frac{1}{3}$", "0.5").reward == 0.0


def test_user_function_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(textwrap.dedent("""
        def length_bonus(response, answer):
            return 2.0 if response == answer else -1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = make_verifier(RewardConfig(verifier="function", function="my_reward:length_bonus"))
    assert fn("7", "7").reward == 1.0  # clamped into [0, 1]
    assert fn("8", "7").reward == 0.0
    sys.modules.pop("my_reward", None)
    with pytest.raises(RunError, match="reward.function"):
        make_verifier(RewardConfig(verifier="function", function="my_reward:missing"))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_are_verifiable_by_their_own_answers(name):
    rng = random.Random(0)
    exact = make_verifier(RewardConfig(verifier="exact"))
    task = TASKS[name]
    for _ in range(50):
        prompt, answer = task.sample(rng)
        assert exact(answer, answer).reward == 1.0
        assert set(prompt + answer) <= set(task.alphabet)


def test_task_stream_is_seeded():
    a = [next(s) for s in [prompt_stream(DataConfig(), 3)] for _ in range(5)]
    b = [next(s) for s in [prompt_stream(DataConfig(), 3)] for _ in range(5)]
    assert a == b and [p.index for p in a] == list(range(5))


def test_jsonl_stream_cycles_through_every_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"q": "{i}+0=", "a": "{i}"}}\n' for i in range(4)) + "\n")
    stream = prompt_stream(DataConfig(source="jsonl", path=str(path), prompt_key="q", answer_key="a"), 0)
    first_epoch = [next(stream) for _ in range(4)]
    assert sorted(p.answer for p in first_epoch) == ["0", "1", "2", "3"]
    assert next(stream).index == 4


def test_jsonl_bad_row_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: no field 'answer' \(data.answer_key\)"):
        next(prompt_stream(DataConfig(source="jsonl", path=str(path)), 0))
