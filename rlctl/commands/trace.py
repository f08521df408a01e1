"""`rlctl trace RUN -o FILE`: the run's timeline as Chrome trace JSON, for Perfetto."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rlctl.errors import UsageError


def trace(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    output: Path = typer.Option(..., "-o", "--output", help="The trace file to write (JSON)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
) -> None:
    """Export a run's timeline: a track per rollout server and per trainer rank (open in Perfetto)."""
    from rlctl.metrics import chrome_trace
    from rlctl.run.find import find_run

    rd = find_run(run, runs_dir)
    info = rd.read()  # a run whose run.json cannot be read: one line, exit 1
    ranks = sum(1 for role in info.get("processes") or {} if role.startswith("trainer-")) or 1
    events, bad_lines = rd.jsonl(rd.events_path)
    data = chrome_trace(events, trainer_ranks=ranks)
    try:
        output.write_text(json.dumps(data))
    except OSError as e:
        raise UsageError(f"cannot write {output}: {e.strerror}") from None
    left_out = [f"events.jsonl lines that are not JSON objects: {bad_lines}"] if bad_lines else []
    skipped = data.get("otherData", {}).get("skipped_events")
    left_out += [f"events without a time or with fields of the wrong shape: {skipped}"] if skipped else []
    note = f" (left out: {'; '.join(left_out)})" if left_out else ""
    print(f"{output}: {len(data['traceEvents'])} trace events from {rd.id}{note}")
