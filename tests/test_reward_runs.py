"""Rewards that fail loudly, with real processes: a reward function that raises ends a launched
run within seconds, its traceback's last line in `rlctl status`; a verifier that never returns
is stopped in its spawned scoring process, which is replaced."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from conftest import FAST, QUICKSTART, descendants, processes_mentioning, rlctl, wait_for
from rlctl.data import Prompt
from rlctl.pipelines.scoring import PooledScorer
from rlctl.recipe import RewardConfig
from rlctl.rewards.failures import VerifierFailed
from rlctl.rewards.verifiers import Scored
from rlctl.run.dir import RunDir

RAISES = "def score(response, answer):\n    return 1 / 0\n"
SLEEPS = ("import pathlib, time\n\ndef score(response, answer):\n"
          "    pathlib.Path(__file__).with_suffix('.called').touch()\n    time.sleep(3600)\n    return 1.0\n")
LOOPS = "def score(response, answer):\n    while answer == 'loop':\n        pass\n    return 1.0\n"


def process_group(pgid: int) -> list[int]:
    """Live (non-zombie) pids of a process group: a role's own, and the scoring processes it spawned."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            stat = (p / "stat").read_text().rsplit(")", 1)[-1].split() if p.name.isdigit() else None
        except OSError:
            continue
        if stat and int(stat[2]) == pgid and stat[0] != "Z":
            pids.append(int(p.name))
    return pids


@pytest.mark.e2e
def test_a_reward_that_raises_fails_the_run_within_seconds_saying_why(tmp_path):
    experiment = tmp_path / "experiment"  # the recipe and its reward module, launched from elsewhere
    experiment.mkdir()
    recipe = experiment / "quickstart.yaml"
    recipe.write_text(QUICKSTART.read_text())
    (experiment / "raising_reward.py").write_text(RAISES)
    runs = tmp_path / "runs"
    res = rlctl("launch", str(recipe), *FAST, "reward.verifier=function", "reward.function=raising_reward:score",
                f"run.output_dir={runs}", cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    (path,) = runs.iterdir()
    rd = RunDir(path)
    info = rd.read()
    assert info["state"] == "failed"
    assert "reward.function raising_reward:score failed on a response of step 0: ZeroDivisionError: division by zero" \
        in info["exit_reason"]

    events = rd.events()
    start = next(e["t"] for e in events if e["event"] == "run_start")
    end = next(e["t"] for e in events if e["event"] == "run_end")
    assert end - start <= 30, f"the run failed {end - start:.1f} s after its start"
    assert sum(e["event"] == "group_admitted" for e in events) <= 8  # one rollout batch at most, not thousands
    error = next(e for e in events if e["event"] == "reward_error")
    assert error["error"] == "ZeroDivisionError: division by zero" and error["prompt"].startswith("max(")
    assert "raising_reward.py" in error["traceback"] and error["answer"].isdigit()
    log = rd.log_path("controller").read_text()
    assert "Traceback (most recent call last):" in log and 'raising_reward.py", line 2, in score' in log

    status = rlctl("status", rd.id, "--runs-dir", str(runs), cwd=tmp_path, env={"COLUMNS": "1000"})
    assert status.returncode == 0 and "ZeroDivisionError: division by zero" in status.stdout, status.stdout
    assert processes_mentioning(rd.id) == []
    assert process_group(info["processes"]["controller"]["pid"]) == []  # its scoring processes too
    print(f"launch -> failed: run_start -> run_end {end - start:.1f} s")


@pytest.mark.process
def test_a_verifier_that_loops_is_stopped_in_its_process_and_replaced(tiny_model_dir, tmp_path):
    (tmp_path / "looping_reward.py").write_text(LOOPS)
    reward = RewardConfig(verifier="function", function="looping_reward:score", module_dir=str(tmp_path),
                          timeout_s=1.0)
    scorer = PooledScorer(lambda ids: "".join(map(str, ids)), reward, workers=1)
    first = [w.process.pid for w in scorer._workers]

    async def main() -> tuple[VerifierFailed, tuple[str, Scored]]:
        await scorer.ready()
        with pytest.raises(VerifierFailed) as e:
            await scorer([], Prompt(0, "max(1,9)=", "loop"))
        return e.value, await scorer([], Prompt(1, "max(1,9)=", "9"))

    try:
        failure, after = asyncio.run(main())
        replaced = [w.process.pid for w in scorer._workers]
    finally:
        scorer.close()
    assert failure.error.startswith("did not return within 1 s (reward.timeout_s)")
    assert replaced != first and not Path(f"/proc/{first[0]}").exists()
    assert after == ("", Scored(1.0))  # the new process scores


@pytest.mark.e2e
def test_a_supervisor_killed_outright_takes_scoring_workers_busy_in_a_verifier_with_it(tmp_path):
    (tmp_path / "sleeping_reward.py").write_text(SLEEPS)
    runs = tmp_path / "runs"
    res = rlctl("launch", "--detach", str(QUICKSTART), *FAST, "reward.verifier=function",
                "reward.function=sleeping_reward:score", f"reward.module_dir={tmp_path}", "reward.timeout_s=3000",
                f"run.output_dir={runs}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rd = RunDir(runs / res.stdout.strip().splitlines()[-1])
    tree: set[int] = set()
    try:
        # A worker in the verifier reads nothing from its pipe: only the kernel can end it with the controller.
        wait_for((tmp_path / "sleeping_reward.called").exists, 300, "a scoring worker to be in the verifier")
        controller = rd.read()["processes"]["controller"]["pid"]
        assert len(descendants({controller})) >= 3  # the controller, its scoring workers, their resource tracker
        tree = descendants({rd.read()["processes"]["supervisor"]["pid"]})
        os.kill(rd.read()["processes"]["supervisor"]["pid"], signal.SIGKILL)
        wait_for(lambda: not [p for p in tree if Path(f"/proc/{p}").exists()], 30, "every process of the run to exit")
    finally:
        for pid in tree | descendants({rd.read()["processes"]["supervisor"]["pid"]}):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
