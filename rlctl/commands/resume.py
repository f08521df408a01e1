"""`rlctl resume RUN`: continue a failed or cancelled run from its newest checkpoint, as the same
run (same id and directory, a new attempt in run.json)."""

from __future__ import annotations

from pathlib import Path

import typer

from rlctl.errors import UsageError
from rlctl.rundir import RunState, find_run


def resume(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return at once; the run goes on in the background."),
) -> None:
    """Continue a failed or cancelled run at the step after its newest checkpoint."""
    from rlctl.checkpoint import find_checkpoint, prepare_resume
    from rlctl.commands.launch import follow
    from rlctl.launchers.local import start_supervisor
    from rlctl.status import effective_state

    rd = find_run(run, runs_dir)
    info = rd.read()
    state, reason = effective_state(rd, info)
    if info.get("launcher") != "local":
        raise UsageError(f"run {rd.id} ran with launcher={info.get('launcher')}; rlctl resume continues local runs only")
    if not state.finished:
        raise UsageError(f"run {rd.id} is still {state.value}; `rlctl cancel {rd.id}` first to resume it from a checkpoint")
    if state is RunState.COMPLETED:
        raise UsageError(f"run {rd.id} completed all its {info.get('steps_total')} steps; there is nothing to resume")
    ckpt = find_checkpoint(rd.path)
    if not RunState(info["state"]).finished:  # its supervisor died without saying so: say it now
        rd.set_state(state, reason)
    attempt = prepare_resume(rd, ckpt)
    rd.record_process("supervisor", pid=start_supervisor(rd))
    typer.echo(f"resuming {rd.id} at step {ckpt.steps} of {info.get('steps_total')} "
               f"(attempt {attempt['attempt']}, {ckpt.path})", err=True)
    if detach:
        print(rd.id)
        return
    raise typer.Exit(follow(rd))
