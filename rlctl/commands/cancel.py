"""`rlctl cancel RUN`: stop every process of a run and record it as cancelled."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from rlctl.errors import RunError

if TYPE_CHECKING:
    from rlctl.run.dir import RunDir

WAIT_S = 30.0


def cancel(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
) -> None:
    """Cancel a run: its supervisor (or Slurm: scancel) ends every process; waits until they are gone."""
    from rlctl.launchers.liveness import read_run
    from rlctl.run.dir import RunState, UnreadableRun
    from rlctl.run.find import find_run

    rd = find_run(run, runs_dir)
    try:
        info = rd.read()
    except UnreadableRun as e:
        raise UnreadableRun(e.run_id, f"{e.why}; not cancelled: which processes are the run's is not known") from None
    now = read_run(rd, info)  # the reading `rlctl status` gives: a run whose supervisor is gone has failed
    on_slurm = info.get("launcher") == "slurm"
    if not on_slurm and not RunState(info["state"]).finished:
        stop_local(rd, now.info)  # a failed run's processes too, should any outlive its supervisor
    if now.state.finished:
        print(f"{rd.id} already {now.state.value}")
        return
    if on_slurm:
        _cancel_slurm(rd, now.info)
        return
    rd.set_state(RunState.CANCELLED, "cancelled by rlctl cancel")
    print(f"{rd.id} {rd.read()['state']}")


def stop_local(rd: RunDir, info: dict) -> None:
    """End every process of a local (or pooled) run: SIGTERM to its supervisor, which ends the
    others and records the run's end, then SIGKILL to the process group of any role still there.
    A run just launched is given until its supervisor records its pid (liveness.STARTING_GRACE_S).
    Each wait is at most WAIT_S; a supervisor still running after it is a RunError. A pid that is
    no longer the run's (liveness.is_run_process) is never signalled."""
    from rlctl.launchers.liveness import is_run_process, let_go, supervisor_pid

    supervisor = supervisor_pid(info) or _recorded_supervisor(rd, WAIT_S)
    if supervisor and is_run_process(rd, supervisor):
        try:
            os.kill(supervisor, signal.SIGTERM)
        except ProcessLookupError:
            pass  # it exited meanwhile
        if let_go(rd, WAIT_S, poll_s=0.1):
            raise RunError(f"supervisor (pid {supervisor}) of {rd.id} still running after {WAIT_S:.0f} s; see {rd.log_path('supervisor')}")
    # Whatever is left (the supervisor was already gone): end it ourselves.
    for role, p in (rd.read().get("processes") or {}).items():
        pid = p.get("pid")
        if role != "supervisor" and is_run_process(rd, pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _recorded_supervisor(rd: RunDir, wait_s: float) -> int | None:
    """The supervisor pid of a run so new that its supervisor has not recorded it yet: run.json
    read again until it has, while the reading says the run is still starting, at most wait_s.
    None: no supervisor will (the reading says the run failed), or none did in time."""
    from rlctl.launchers.liveness import read_run, supervisor_pid

    deadline = time.monotonic() + wait_s
    while True:
        now = read_run(rd)
        pid = supervisor_pid(now.info)
        if pid or now.state.finished or time.monotonic() >= deadline:
            return pid
        time.sleep(0.1)


def _cancel_slurm(rd: RunDir, info: dict) -> None:
    """scancel the run's job and wait until Slurm says it ended: then no process of the run is
    left on any node (Slurm kills every step of the job)."""
    from rlctl.launchers import slurm
    from rlctl.run.dir import RunState

    job_id = slurm.job_id_of(info)
    if job_id is None:
        rd.set_state(RunState.CANCELLED, "cancelled by rlctl cancel before it was submitted")
    else:
        job = slurm.cancel(job_id, wait_s=WAIT_S)
        rd.set_state(RunState.CANCELLED, f"cancelled by rlctl cancel (scancel {job_id})")
        slurm.refresh([rd])
        if job is not None:
            print(f"slurm job {job_id}: {job.describe()}")
    print(f"{rd.id} {rd.read()['state']}")
