"""`rlctl samples RUN [--step N] [--best|--worst] [--grep TEXT]`: read what the model wrote and
what the reward made of it, from the run directory's samples.jsonl."""

from __future__ import annotations

from pathlib import Path

import typer

from rlctl.errors import UsageError


def samples(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    step: int | None = typer.Option(None, "--step", help="Only this step's samples (default: the last step written; "
                                    "--all-steps for every one)."),
    all_steps: bool = typer.Option(False, "--all-steps", help="Samples of every step."),
    best: bool = typer.Option(False, "--best", help="Highest reward first."),
    worst: bool = typer.Option(False, "--worst", help="Lowest reward first."),
    grep: str | None = typer.Option(None, "--grep", help="Only samples whose prompt, response or answer holds this "
                                    "text (case-insensitive)."),
    limit: int = typer.Option(8, "--limit", "-n", min=1, help="At most this many samples."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
) -> None:
    """Print a run's samples: prompt, response, answer, reward and named scores."""
    from rlctl.run.find import find_run
    from rlctl.run.samples import choose, read_samples, render

    if best and worst:
        raise UsageError("--best and --worst: give one")
    if all_steps and step is not None:
        raise UsageError("--step and --all-steps: give one")
    rd = find_run(run, runs_dir)
    found = read_samples(rd)
    if not found:
        raise UsageError(f"{rd.id}: no samples yet ({rd.samples_path.name}: run.sample_groups groups a step are "
                         "written as they complete)")
    chosen = choose(found, step=None if all_steps else (-1 if step is None else step),
                    order="best" if best else "worst" if worst else None, grep=grep, limit=limit)
    if not chosen:
        steps = sorted({x["step"] for x in found})
        raise UsageError(f"{rd.id}: no sample matches (steps written: {steps[0]}..{steps[-1]})")
    typer.echo("\n\n".join(render(x) for x in chosen))
