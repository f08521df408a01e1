"""`rlctl logs RUN [ROLE] [-f]`: show or follow a role's log (the controller's by default)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from rlctl.errors import UsageError
from rlctl.rundir import RunState, find_run


def logs(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    role: str | None = typer.Argument(None, help="controller, trainer-0, rollout-1, supervisor, prepare; job (Slurm's output) ..."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing as the log grows."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
) -> None:
    """Print a role's log."""
    rd = find_run(run, runs_dir)
    role = role or "controller"
    path = rd.log_path(role)
    if not path.is_file():
        have = ", ".join(rd.log_files()) or "none yet"
        raise UsageError(f"{rd.id}: no log for role '{role}'; logs: {have}")
    with path.open("rb") as f:
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            if not follow:
                return
            if RunState(rd.read()["state"]).finished and not chunk:
                return
            time.sleep(0.5)
