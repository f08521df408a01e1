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
    from rlctl.rundir import RunDir

WAIT_S = 30.0


def cancel(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
) -> None:
    """Cancel a run: its supervisor (or Slurm: scancel) ends every process; waits until they are gone."""
    from rlctl.rundir import RunState, UnreadableRun, find_run, pid_alive

    rd = find_run(run, runs_dir)
    try:
        info = rd.read()
    except UnreadableRun as e:
        raise UnreadableRun(e.run_id, f"{e.why}; not cancelled: which processes are the run's is not known") from None
    if RunState(info["state"]).finished:
        print(f"{rd.id} already {info['state']}")
        return
    if info.get("launcher") == "slurm":
        _cancel_slurm(rd, info)
        return
    procs = info.get("processes") or {}
    supervisor = procs.get("supervisor", {}).get("pid")
    if supervisor and pid_alive(supervisor, expect_in_cmdline=rd.id):
        os.kill(supervisor, signal.SIGTERM)
        deadline = time.monotonic() + WAIT_S
        while pid_alive(supervisor) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(supervisor):
            raise RunError(f"supervisor (pid {supervisor}) of {rd.id} still running after {WAIT_S:.0f} s; see {rd.log_path('supervisor')}")
    # Whatever is left (the supervisor was already gone): end it ourselves.
    for role, p in procs.items():
        pid = p.get("pid")
        if role != "supervisor" and pid and pid_alive(pid, expect_in_cmdline=rd.id):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    rd.set_state(RunState.CANCELLED, "cancelled by rlctl cancel")
    print(f"{rd.id} {rd.read()['state']}")


def _cancel_slurm(rd: RunDir, info: dict) -> None:
    """scancel the run's job and wait until Slurm says it ended: then no process of the run is
    left on any node (Slurm kills every step of the job)."""
    from rlctl.launchers import slurm
    from rlctl.rundir import RunState

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
