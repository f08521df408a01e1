"""`rlctl trace RUN -o FILE`: the run's timeline as Chrome trace JSON, for Perfetto."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rlctl.metrics import chrome_trace
from rlctl.rundir import find_run


def trace(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    output: Path = typer.Option(..., "-o", "--output", help="The trace file to write (JSON)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
) -> None:
    """Export a run's timeline: a track per rollout server and per trainer rank (open in Perfetto)."""
    rd = find_run(run, runs_dir)
    info = rd.read()
    ranks = sum(1 for role in info.get("processes", {}) if role.startswith("trainer-")) or 1
    data = chrome_trace(rd.events(), trainer_ranks=ranks)
    output.write_text(json.dumps(data))
    print(f"{output}: {len(data['traceEvents'])} trace events from {rd.id}")
