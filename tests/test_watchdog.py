"""The watchdogs of the trainer and the controller (rlctl/process/watchdog.py): a frozen one fails the
run within run.stall_timeout_s (and 10x the slowest call of its kind), saying which; the deadline
rules themselves in-process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import FAST, QUICKSTART, descendants, rlctl, wait_for
from rlctl.run.dir import RunDir
from rlctl.process.watchdog import CallTimer, heartbeat_age

STALL_S = 15


def test_a_calls_deadline_is_the_floor_until_ten_times_the_slowest_call_is_longer():
    timer = CallTimer(floor_s=15.0)
    assert timer.timeout("/train") == 15.0 and timer.explain("/train") == "run.stall_timeout_s"
    timer.observe("/train", 0.5)
    timer.observe("/train", 2.0)
    timer.observe("/train", 1.0)  # the slowest stays
    timer.observe("/sync_weights", 0.1)
    assert timer.timeout("/train") == 20.0 and timer.explain("/train") == "10x the slowest /train so far (2.0 s)"
    assert timer.timeout("/sync_weights") == 15.0  # each kind by its own


def test_a_heartbeat_is_as_old_as_its_last_touch(tmp_path):
    beat = tmp_path / "heartbeat"
    assert heartbeat_age(beat) is None  # not started: no verdict
    beat.touch()
    os.utime(beat, (1000.0, 1000.0))
    assert heartbeat_age(beat, now=1042.5) == 42.5


def launch(tmp_path):
    res = rlctl("launch", "--detach", str(QUICKSTART), *FAST, "run.steps=5000", f"run.stall_timeout_s={STALL_S}",
                f"rollout.stall_timeout_s={STALL_S}", f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rd = RunDir(tmp_path / "runs" / res.stdout.strip().splitlines()[-1])
    wait_for(lambda: any(e["event"] == "step_end" for e in rd.events()), 300, "the first step")
    return rd


def ended(rd: RunDir):
    info = rd.read()
    return info if info["state"] in ("completed", "failed", "cancelled") else None


@pytest.mark.e2e
@pytest.mark.parametrize("role", ["trainer-0", "controller", "every rollout server"])
def test_a_frozen_role_fails_the_run_within_the_stall_timeout_saying_which(tmp_path, role):
    rd = launch(tmp_path)
    tree = descendants({rd.read()["processes"]["supervisor"]["pid"]})
    try:
        for name in ("rollout-0", "rollout-1") if role == "every rollout server" else (role,):
            os.kill(rd.read()["processes"][name]["pid"], signal.SIGSTOP)
        frozen = time.monotonic()
        info = wait_for(lambda: ended(rd), STALL_S * 10 + 60, "the run to end")
        waited = time.monotonic() - frozen
        assert info["state"] == "failed"
        reason = info["exit_reason"]
        said = {"trainer-0": "error: trainer /", "controller": "heartbeat stopped; run.stall_timeout_s",
                "every rollout server": "every rollout server is lost"}[role]
        assert said in reason, reason
        assert waited >= STALL_S - 1  # not before its time
        print(f"{role} frozen -> run failed after {waited:.1f} s: {reason}")
    finally:
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
