"""`rlctl logs RUN [ROLE] [-f]`: show or follow a role's log (the controller's by default)."""

from __future__ import annotations

import os
import re
import sys
import time
import typing
from pathlib import Path

import typer

from rlctl.errors import RunError, UsageError

if typing.TYPE_CHECKING:
    from rlctl.run.dir import RunDir

ROLE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
"""A role as the logs directory names it: controller, trainer-0, rollout-1, job ... (no path)."""


def logs(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    role: str | None = typer.Argument(None, help="controller, trainer-0, rollout-1, supervisor, prepare; job (Slurm's output) ..."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing as the log grows."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
) -> None:
    """Print a role's log."""
    from rlctl.run.find import find_run
    from rlctl.run.check import one_line
    from rlctl.run.tail import open_regular

    rd = find_run(run, runs_dir)
    path = log_file(rd, role or "controller")
    try:
        f = open_regular(path)
    except OSError as e:
        raise RunError(f"{one_line(rd.id, 120)}: cannot read {path.name} ({e.strerror})") from None
    try:
        with f:
            _copy(f, rd, follow)
    except BrokenPipeError:  # `rlctl logs RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def log_file(rd: RunDir, role: str) -> Path:
    """The run's log of `role`, only ever inside the run's own logs directory: a role that is a
    path (../../etc/passwd, /etc/passwd) is refused (exit 2), and so is a log that is a symlink
    leading out of logs/, or a logs/ leading out of the run directory (exit 1). run.json is not
    needed: the logs of a run whose run.json is damaged are what tells why."""
    from rlctl.run.dir import UnreadableRun
    from rlctl.run.check import one_line

    if not ROLE.fullmatch(role) or ".." in role:
        raise UsageError(f"'{one_line(role, 80)}' is not a role; roles are names like controller, trainer-0, rollout-1")
    if not os.path.isdir(rd.path):
        raise UnreadableRun(rd.id, "the run directory is not a directory")
    path = rd.log_path(role)
    if not os.path.lexists(path):
        have = ", ".join(rd.log_files()) or "none yet"
        raise UsageError(f"{one_line(rd.id, 120)}: no log for role '{role}'; logs: {have}")
    run_dir, logs_dir, real = (os.path.realpath(p) for p in (rd.path, rd.logs, path))
    if os.path.commonpath([run_dir, logs_dir]) != run_dir or os.path.commonpath([logs_dir, real]) != logs_dir:
        raise RunError(f"{one_line(rd.id, 120)}: the log of '{role}' leads out of the run's logs directory "
                       f"(to {one_line(real, 120)}); not shown")
    return path


def _copy(f: typing.BinaryIO, rd: RunDir, follow: bool) -> None:
    """The log to stdout in chunks of 1 MiB; with follow, on as it grows until the run ends."""
    while True:
        chunk = f.read(1 << 20)
        if chunk:
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            continue
        if not follow or _finished(rd):
            return
        time.sleep(0.5)


def _finished(rd: RunDir) -> bool:
    from rlctl.run.dir import RunState, UnreadableRun

    try:
        return RunState(rd.read()["state"]).finished
    except UnreadableRun:  # its state cannot be known: stop at the end of what is there
        return True
