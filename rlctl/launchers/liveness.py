"""Whether a run is alive, and if it ended, how and why: the one reading that `rlctl status`,
`rlctl launch`'s follow, `rlctl cancel` and `rlctl resume` share, so that no two of them can say
different things about the same run directory.

A run's state is what run.json says, except where run.json says it is still going and its
driver says otherwise:
- a local or pooled run's driver is its supervisor process (rlctl/launchers/local.py). A pid is
  the supervisor's only while its process runs and its command line names the run: a pid the
  kernel has since given to another process is no supervisor (the pid-reuse guard). A supervisor
  gone without recording the run's end (a SIGKILL, the OOM killer) failed the run, and the
  verdict is written into run.json, where it may be, since nothing else ever will write it. A run
  with no supervisor recorded is starting for STARTING_GRACE_S after its attempt began, then
  failed; that verdict is not written: a supervisor merely late would find its run ended under it.
- a Slurm run's driver is its job. With `ask_slurm`, Slurm's word is joined into run.json first
  (rlctl/launchers/slurm/reconcile.py: a job that ended unrecorded ends the run); `rlctl status`
  joins all its runs with one query before it reads them.

A run that has ended may still hold on for a moment: its supervisor exits after writing the end,
its job lets go of its nodes (COMPLETING). `let_go` waits for that, up to a deadline, and says
what still holds on when the deadline passes.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

from rlctl.run.dir import RunDir, RunState, pid_alive

STARTING_GRACE_S = 30.0
"""A local run with no supervisor pid yet is still starting for this long, then failed."""


@dataclass(frozen=True)
class Reading:
    """A run as the reading finds it."""

    state: RunState
    """run.json's state, or `failed` where its supervisor is gone."""
    reason: str | None
    """Why it ended: run.json's exit_reason, or the verdict's (the log to read); None while it goes on."""
    info: dict[str, Any]
    """run.json as read last, after a verdict was written into it."""


def read_run(rd: RunDir, info: dict[str, Any] | None = None, *, ask_slurm: bool = False) -> Reading:
    """The run's state and why it ended. `info`: run.json, when the caller has read it already.
    `ask_slurm`: a Slurm run's job is asked about first (one squeue)."""
    info = info if info is not None else rd.read()
    if info.get("launcher") == "slurm":
        if ask_slurm:
            from rlctl.launchers.slurm import refresh

            refresh([rd], {rd.id: info})
            info = rd.read()
        return Reading(RunState(info["state"]), info.get("exit_reason"), info)
    state = RunState(info["state"])
    if state.finished:
        return Reading(state, info.get("exit_reason"), info)
    pid = supervisor_pid(info)
    if pid is None:
        if _attempt_age_s(info) < STARTING_GRACE_S:
            return Reading(state, None, info)
        return Reading(RunState.FAILED, f"no supervisor ever started; see {rd.log_path('supervisor')}", info)
    if is_run_process(rd, pid):
        return Reading(state, None, info)
    return _supervisor_gone(rd, pid)


def supervisor_pid(info: dict[str, Any]) -> int | None:
    """The pid run.json records for the run's supervisor (None: not recorded yet)."""
    return (info.get("processes") or {}).get("supervisor", {}).get("pid")


def is_run_process(rd: RunDir, pid: int | None) -> bool:
    """pid is a live process of this run: it runs, is no zombie, and its command line names the run
    (every process of a local run gets its run directory on its command line). A pid run.json
    recorded and the kernel gave to another process since is not the run's."""
    return pid_alive(pid, expect_in_cmdline=rd.id)


def _attempt_age_s(info: dict[str, Any]) -> float:
    """Seconds since the run's current attempt began: `rlctl resume` starts an attempt of a run
    created long ago, and its supervisor has its grace from then (run.json's `created` where the
    attempt's start is not a time)."""
    begun = dt.datetime.fromisoformat(info["created"])  # checked by rlctl/run/check.py
    attempts = info.get("attempts")
    current = attempts[-1] if isinstance(attempts, list) and attempts and isinstance(attempts[-1], dict) else {}
    try:
        started = dt.datetime.fromisoformat(current.get("started"))
        begun = max(begun, started)
    except (TypeError, ValueError):  # absent, not a time, or without a time zone
        pass
    return (dt.datetime.now(dt.UTC) - begun).total_seconds()


def _supervisor_gone(rd: RunDir, pid: int) -> Reading:
    """The supervisor is gone and run.json, as first read, said the run goes on. The verdict is
    written under run.json's lock, where the first end written wins, and run.json is read again:
    a supervisor that wrote its own end just before it exited is read as it wrote it. A run
    directory this user may only read is left as it is, and the verdict is still given."""
    reason = f"supervisor (pid {pid}) is gone; see {rd.log_path('supervisor')}"
    try:
        rd.set_state(RunState.FAILED, reason)
    except OSError:
        pass
    info = rd.read()
    state = RunState(info["state"])
    if not state.finished:  # not written: the directory is read-only to this user
        return Reading(RunState.FAILED, reason, info)
    if state is RunState.FAILED and info.get("exit_reason") == reason:
        try:
            rd.event("run_end", state=state.value, reason=reason)
        except OSError:
            pass
    return Reading(state, info.get("exit_reason"), info)


def holding(rd: RunDir, info: dict[str, Any]) -> str | None:
    """What of the run still holds on, in words ("supervisor (pid 12)", "Slurm job 7 (COMPLETING)"),
    or None: its supervisor process has exited, its Slurm job is no longer pending or holding
    nodes as Slurm was last seen to say (a job not yet seen holds on while the run goes on)."""
    if info.get("launcher") != "slurm":
        pid = supervisor_pid(info)
        return f"supervisor (pid {pid})" if is_run_process(rd, pid) else None
    from rlctl.launchers.slurm import ACTIVE, job_id_of

    job_id = job_id_of(info)
    last = (info.get("slurm") or {}).get("last")
    if job_id is None:
        return None
    if last is None:
        return None if RunState(info["state"]).finished else f"Slurm job {job_id}"
    return f"Slurm job {job_id} ({last.get('state')})" if last.get("state") in ACTIVE else None


def let_go(rd: RunDir, wait_s: float, poll_s: float = 0.5) -> str | None:
    """Wait up to wait_s until nothing of the run holds on (`holding`; a Slurm run's job is asked
    about every poll). None once nothing does; else what still holds on at the deadline."""
    deadline = time.monotonic() + wait_s
    while True:
        info = rd.read()
        if info.get("launcher") == "slurm":
            info = read_run(rd, info, ask_slurm=True).info
        held = holding(rd, info)
        if held is None or time.monotonic() >= deadline:
            return held
        time.sleep(poll_s)
