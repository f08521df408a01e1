"""The one reading of a run's liveness and end (rlctl/launchers/liveness.py), and that `rlctl
status`, `launch`'s follow, `cancel` and `resume` give the same answer for the same run directory.

Fast tier: the run directories are written here, and a "live supervisor" is this test process
itself: a run named after a word of this process's command line reads as alive (every process
of a run names the run's directory on its command line), any other name makes this process a pid
the kernel gave to someone else."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
from pathlib import Path

import pytest

from conftest import rlctl_here
from rlctl.commands import follow as following
from rlctl.errors import RunError, UsageError
from rlctl.launchers import liveness
from rlctl.launchers.liveness import holding, let_go, read_run
from rlctl.run.dir import RunDir, RunState
from rlctl.launchers.status import summary

OTHER = os.getpid()
"""A pid that is alive and is no process of any run written here (pid reuse)."""


def _word_of_this_command_line() -> str:
    """A directory name this process's command line holds: the name of the program it runs."""
    return Path(Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode()).name


def _ago(seconds: float) -> str:
    return (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=seconds)).isoformat(timespec="seconds")


def run_dir(root: Path, name: str, state: str, supervisor: int | None = None, *, age_s: float = 3600,
            reason: str | None = None, **extra) -> RunDir:
    """A local run's directory as its supervisor leaves it: run.json, empty events and metrics."""
    d = root / name
    (d / "logs").mkdir(parents=True)
    processes = {"supervisor": {"pid": supervisor, "host": "here"}} if supervisor else {}
    (d / "run.json").write_text(json.dumps({
        "schema": 1, "id": name, "name": name, "state": state, "created": _ago(age_s),
        "ended": _ago(1) if reason else None, "exit_reason": reason, "processes": processes,
        "launcher": "local", "mode": "sync", "steps_total": 3, **extra}))
    (d / "events.jsonl").touch()
    (d / "metrics.jsonl").touch()
    return RunDir(d)


def test_a_supervisor_pid_given_to_another_process_reads_as_gone_and_is_written_failed(tmp_path):
    rd = run_dir(tmp_path, "reused-20261201-000000-aaaa", "running", OTHER)
    now = read_run(rd)
    reason = f"supervisor (pid {OTHER}) is gone; see {rd.logs / 'supervisor.log'}"
    assert (now.state, now.reason) == (RunState.FAILED, reason)
    info = rd.read()  # written, since nothing else ever will
    assert (info["state"], info["exit_reason"], now.info) == ("failed", reason, info)
    assert [(e["event"], e["state"], e["reason"]) for e in rd.events()] == [("run_end", "failed", reason)]
    assert holding(rd, info) is None
    assert read_run(rd).reason == reason and len(rd.events()) == 1  # read again: as written, no second end


def test_a_live_supervisor_of_the_run_reads_as_running(tmp_path):
    rd = run_dir(tmp_path, _word_of_this_command_line(), "running", OTHER)
    now = read_run(rd)
    assert (now.state, now.reason) == (RunState.RUNNING, None) and rd.read()["state"] == "running"
    assert holding(rd, now.info) == f"supervisor (pid {OTHER})"
    assert summary(rd)["state"] == "running"


def test_a_completed_run_reads_completed_whatever_its_pid(tmp_path):
    """run.json's own end is the run's, even while its supervisor is still exiting after writing it
    (then `let_go` says so, at once when given no time to wait)."""
    rd = run_dir(tmp_path, _word_of_this_command_line(), "completed", OTHER, reason="all steps done")
    now = read_run(rd)
    assert (now.state, now.reason) == (RunState.COMPLETED, "all steps done")
    assert let_go(rd, 0) == f"supervisor (pid {OTHER})"
    gone = run_dir(tmp_path, "done-20261201-000000-aaaa", "completed", OTHER, reason="all steps done")
    assert read_run(gone).state is RunState.COMPLETED and let_go(gone, 60) is None  # nothing waited for


def test_an_end_the_supervisor_wrote_just_before_it_exited_is_read_as_written(tmp_path):
    """run.json read while the run went on, then the supervisor wrote its end and exited: the
    reading finds its pid gone, and reads run.json again under the lock instead of failing it."""
    rd = run_dir(tmp_path, "racy-20261201-000000-aaaa", "running", OTHER)
    seen = rd.read()
    rd.set_state(RunState.COMPLETED, "all steps done")
    now = read_run(rd, seen)
    assert (now.state, now.reason) == (RunState.COMPLETED, "all steps done")
    assert rd.read()["state"] == "completed" and rd.events() == []


def test_no_supervisor_is_starting_for_a_grace_then_failed_but_not_written(tmp_path):
    fresh = run_dir(tmp_path, "fresh-20261201-000000-aaaa", "starting", age_s=1)
    assert (read_run(fresh).state, read_run(fresh).reason) == (RunState.STARTING, None)
    old = run_dir(tmp_path, "old-20261201-000000-aaaa", "starting", age_s=liveness.STARTING_GRACE_S + 5)
    now = read_run(old)
    assert (now.state, now.reason) == (RunState.FAILED, f"no supervisor ever started; see {old.logs / 'supervisor.log'}")
    assert old.read()["state"] == "starting"  # a supervisor merely late must not find its run ended
    # A resumed run was created long ago; its new attempt's supervisor has its grace from the attempt's start.
    resumed = run_dir(tmp_path, "resumed-20261201-000000-aaaa", "starting", attempts=[
        {"attempt": 1, "started": _ago(3600)}, {"attempt": 2, "started": _ago(1)}])
    assert read_run(resumed).state is RunState.STARTING
    garbled = run_dir(tmp_path, "garbled-20261201-000000-aaaa", "starting", attempts=[{"started": "soon"}])
    assert read_run(garbled).state is RunState.FAILED  # an attempt's start that is no time: run.json's created


def test_a_read_only_run_directory_gets_the_verdict_unwritten(tmp_path, monkeypatch):
    rd = run_dir(tmp_path, "theirs-20261201-000000-aaaa", "running", OTHER)

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(RunDir, "set_state", refused)
    now = read_run(rd)
    assert now.state is RunState.FAILED and now.reason.startswith(f"supervisor (pid {OTHER}) is gone")
    assert rd.read()["state"] == "running" and rd.events() == []


def test_holding_a_slurm_job_is_its_last_seen_state():
    info = {"launcher": "slurm", "state": "running", "slurm": {"job_id": "7", "last": None}}
    assert holding(RunDir(Path("x")), info) == "Slurm job 7"  # submitted, not yet seen by squeue
    info.update(state="completed")
    assert holding(RunDir(Path("x")), info) is None
    info["slurm"]["last"] = {"job_id": "7", "state": "COMPLETING"}
    assert holding(RunDir(Path("x")), info) == "Slurm job 7 (COMPLETING)"
    info["slurm"]["last"]["state"] = "COMPLETED"
    assert holding(RunDir(Path("x")), info) is None


# The states a run directory can be found in: (name, state, supervisor pid, age, reason).
STATES = {
    "completed": ("completed", OTHER, 3600, "all steps done"),
    "failed": ("failed", OTHER, 3600, "controller (pid 9) exited with code 1"),
    "cancelled": ("cancelled", OTHER, 3600, "cancelled (SIGTERM)"),
    "supervisor-gone": ("running", OTHER, 3600, None),
    "never-started": ("starting", None, 3600, None),
    "starting": ("starting", None, 1, None),
}


def _in(rd: RunDir, reason: str | None) -> str | None:
    """A reason as it reads whichever copy of the run directory it names."""
    return reason and reason.replace(str(rd.path), "RUN")


@pytest.mark.parametrize("kind", list(STATES))
def test_status_follow_cancel_and_resume_agree(tmp_path, kind, monkeypatch, capsys):
    """Each reader on its own copy of the same run directory: status's row, follow's reading and
    how follow ends, cancel's word, and whether resume takes the run."""
    state, pid, age, reason = STATES[kind]
    copies = [run_dir(tmp_path / reader, f"{kind}-20261201-000000-aaaa", state, pid, age_s=age, reason=reason)
              for reader in ("status", "follow", "cancel", "resume")]
    row = summary(copies[0])
    now = following._Watch(copies[1], copies[1].read()).read()
    assert (row["state"], _in(copies[0], row["exit_reason"])) == (now.state.value, _in(copies[1], now.reason))
    if not now.state.finished:
        return
    expected = {"completed": 0, "failed": RunError, "cancelled": 1}[now.state.value]
    if expected is RunError:
        with pytest.raises(RunError, match=re.escape(f"run {copies[1].id} failed: {now.reason}")):
            following.follow(copies[1])
    else:
        assert following.follow(copies[1]) == expected
    signals = []
    monkeypatch.setattr(os, "kill", lambda *a: signals.append(a))
    monkeypatch.setattr(os, "killpg", lambda *a: signals.append(a))
    capsys.readouterr()
    res = rlctl_here("cancel", copies[2].id, "--runs-dir", str(tmp_path / "cancel"), cwd=tmp_path)
    assert (res.returncode, res.stdout, signals) == (0, f"{copies[2].id} already {now.state.value}\n", [])
    from rlctl.commands.resume import resumable

    state, why, _ = resumable(copies[3])
    assert (state, _in(copies[3], why)) == (now.state, _in(copies[1], now.reason))


def test_resume_refuses_a_run_whose_supervisor_runs(tmp_path):
    from rlctl.commands.resume import resumable

    rd = run_dir(tmp_path, _word_of_this_command_line(), "running", OTHER)
    with pytest.raises(UsageError, match="is still running; `rlctl cancel"):
        resumable(rd)


def test_follows_ctrl_c_gives_up_on_a_supervisor_that_does_not_exit(tmp_path, monkeypatch):
    """Ctrl-C in `rlctl launch` cancels as `rlctl cancel` does: SIGTERM to the supervisor (only
    while the pid is still the run's), then a bounded wait that ends in an error naming the log."""
    rd = run_dir(tmp_path, _word_of_this_command_line(), "running", OTHER)
    signals, waits = [], []
    monkeypatch.setattr(os, "kill", lambda *a: signals.append(a))
    monkeypatch.setattr(os, "killpg", lambda *a: signals.append(a))
    monkeypatch.setattr(liveness, "let_go", lambda rd, wait_s, poll_s=0.5: waits.append(wait_s) or f"supervisor (pid {OTHER})")
    with pytest.raises(RunError, match=rf"supervisor \(pid {OTHER}\) of {rd.id} still running after 30 s; see "):
        following._Watch(rd, rd.read()).cancel()
    assert signals == [(OTHER, signal.SIGTERM)] and waits == [30.0]
