"""samples.jsonl and `rlctl samples`: the samples a researcher reads to see what the model wrote
and what the reward made of it."""

from __future__ import annotations

import json

from conftest import rlctl_here
from rlctl.run.dir import create_run_dir
from rlctl.run.samples import choose, read_samples, render


def sample(step: int, group: int, index: int, reward: float, response: str, **extra) -> dict:
    return {"step": step, "group": group, "sample": index, "source": "", "prompt": "max(3,7)=", "answer": "7",
            "response": response, "reward": reward, "scores": {}, "version": step, "finish_reason": "stop",
            "prompt_tokens": 9, "response_tokens": len(response)} | extra


def run_with_samples(tmp_path, lines: list) -> str:
    rd = create_run_dir(tmp_path / "runs", "s", "run: {}\n", {})
    rd.samples_path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return rd.id


def test_choose_by_step_reward_and_text():
    samples = [sample(0, 0, 0, 0.0, "3"), sample(0, 0, 1, 1.0, "7"), sample(1, 4, 0, 0.5, "seven"),
               sample(1, 4, 1, 1.0, "7!")]
    assert [x["response"] for x in choose(samples, step=-1)] == ["seven", "7!"]
    assert [x["response"] for x in choose(samples, order="worst")] == ["3", "seven", "7", "7!"]
    assert [x["response"] for x in choose(samples, order="best", limit=2)] == ["7", "7!"]
    assert [x["response"] for x in choose(samples, grep="SEVEN")] == ["seven"]


def test_render_shows_the_header_the_messages_and_cuts_long_text():
    x = sample(2, 5, 1, 0.25, "\n".join(f"line {i}" for i in range(40)), source="gsm8k",
               prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
               scores={"format": 0.25, "correct": 0.0}, response_tokens=40)
    text = render(x)
    assert text.splitlines()[0] == ("step 2 · group 5 · sample 1 · gsm8k · reward 0.25 (format 0.25, correct 0) · "
                                    "40 tokens · stop · weights v2")
    assert "    system: Be brief." in text and "    user: 2+3?" in text
    assert "    ... (29 lines cut) ..." in text and "    line 0" in text and "    line 39" in text


def test_the_command_prints_chosen_samples_and_skips_garbled_lines(tmp_path):
    run = run_with_samples(tmp_path, [sample(0, 0, 0, 0.0, "3"), "not json", {"step": "x"},
                                      sample(1, 4, 0, 1.0, "7"), sample(1, 4, 1, 0.0, "4")])
    res = rlctl_here("samples", run, "--worst", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    headers = [line for line in res.stdout.splitlines() if line.startswith("step ")]
    assert [h.split(" · ")[3] for h in headers] == ["reward 0", "reward 1"]
    assert all(h.startswith("step 1 ") for h in headers)
    everything = rlctl_here("samples", run, "--all-steps", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert len([line for line in everything.stdout.splitlines() if line.startswith("step ")]) == 3
    none = rlctl_here("samples", run, "--grep", "zebra", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert none.returncode == 2 and none.stderr.strip().splitlines() == [
        f"error: {run}: no sample matches (steps written: 0..1)"]


def test_a_run_without_samples_says_so_in_one_line(tmp_path):
    rd = create_run_dir(tmp_path / "runs", "s", "run: {}\n", {})
    assert read_samples(rd) == []
    res = rlctl_here("samples", rd.id, "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "no samples yet" in res.stderr


def test_a_tracker_gets_each_sample_line_once_and_only_whole_lines(tmp_path):
    from rlctl.run.tracking import SamplesTail

    rd = create_run_dir(tmp_path / "runs", "s", "run: {}\n", {})
    rd.samples_path.write_text(json.dumps(sample(0, 0, 0, 1.0, "7")) + "\n")
    tail = SamplesTail(rd)  # a resumed run: what is there was logged by the attempt before
    assert tail.new() == []
    with rd.samples_path.open("a") as f:
        f.write(json.dumps(sample(1, 2, 0, 0.0, "3")) + "\nnot json\n" + '{"step": 1, "gro')
    assert [x["response"] for x in tail.new()] == ["3"]
    with rd.samples_path.open("a") as f:
        f.write('up": 2}\n')
    assert tail.new() == [{"step": 1, "group": 2}] and tail.new() == []
