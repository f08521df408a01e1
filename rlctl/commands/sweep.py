"""`rlctl sweep RECIPE key=a,b key2=x,y [--seeds N]`: a grid of runs under one sweep id (rlctl/run/sweep.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

from rlctl.errors import RecipeError, UsageError


def sweep(
    recipe: Path = typer.Argument(..., help="The recipe YAML file."),
    grid: list[str] = typer.Argument(..., help="KEY=VALUE[,VALUE...]: one grid dimension each (a single value "
                                               "is a plain override)."),
    seeds: int = typer.Option(0, "--seeds", help="Also run every point with run.seed = 0 .. N-1."),
    parallel: int = typer.Option(1, "--parallel", help="Local runs alive at once (each is several processes)."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return at once; the sweep goes on in the background."),
) -> None:
    """Run a recipe over a grid of overrides and seeds; `rlctl status SWEEP`, `rlctl compare SWEEP --group-by KEY`."""
    from rlctl.recipe import Launcher
    from rlctl.run.sweep import Sweep, parse_grid, points

    if seeds < 0 or parallel < 1:
        raise UsageError("--seeds must be >= 0 and --parallel >= 1")
    dims, fixed = parse_grid(grid, seeds)
    if not dims:
        raise UsageError("sweep: no key has more than one value (KEY=A,B) and no --seeds: that is one run; "
                         "use rlctl launch")
    loaded = [_checked(recipe, fixed, p) for p in points(dims)]  # every point a valid recipe before anything starts
    first = loaded[0]
    if len({r.launcher for r in loaded}) > 1 or len({r.run.output_dir for r in loaded}) > 1:
        raise UsageError("sweep: every point must have the same launcher and run.output_dir")
    if first.launcher is Launcher.POOL:
        raise UsageError("sweep: launcher=pool is not swept yet; attach the runs one by one")
    sw = Sweep.create(Path(first.run.output_dir), first.run.name, recipe.resolve(), dims, fixed, str(first.launcher))
    typer.echo(f"sweep {sw.id}: {len(loaded)} runs ({' x '.join(str(len(v)) for _, v in dims)}) of {recipe}", err=True)
    if first.launcher is Launcher.SLURM:
        _submit_all(sw, recipe)
    elif detach:
        _drive_in_background(sw, parallel)
    else:
        _drive(sw, parallel)
    print(sw.id)


def _checked(recipe: Path, fixed: list[str], point: dict[str, str]) -> Any:
    from rlctl.recipe import load_recipe

    try:
        return load_recipe(recipe, [*fixed, *(f"{k}={v}" for k, v in point.items())])
    except RecipeError as e:
        values = " ".join(f"{k}={v}" for k, v in point.items())
        raise UsageError(f"sweep point {values}: {e}") from None


def _start_local(recipe: Path):
    from rlctl.commands.launch import start_local_run
    from rlctl.recipe import load_recipe

    return lambda overrides: start_local_run(load_recipe(recipe, overrides), recipe, overrides)


def _drive(sw: Any, parallel: int) -> None:
    """The local driver, in the foreground: Ctrl-C cancels the runs it started that still run."""
    from rlctl.run.sweep import drive_local, finished

    recipe = Path(sw.read()["recipe"])
    try:
        drive_local(sw, _start_local(recipe), parallel, lambda line: typer.echo(line, err=True))
    except KeyboardInterrupt:
        typer.echo("cancelling the sweep's running runs...", err=True)
        for rd in sw.runs():
            if not finished(rd):
                subprocess.run([sys.executable, "-m", "rlctl", "cancel", str(rd.path)], check=False)
        raise typer.Exit(130) from None


def _drive_in_background(sw: Any, parallel: int) -> None:
    """The same driver as its own session, logging to .sweeps/ID.log: it outlives this command."""
    log = sw.path.with_suffix(".log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "rlctl.commands.sweep", str(sw.path.resolve()), str(parallel)],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    data = sw.read()
    data["driver_pid"] = proc.pid
    sw.write(data)


def _submit_all(sw: Any, recipe: Path) -> None:
    """Slurm: every point its own heterogeneous job, submitted now; Slurm's queue runs them."""
    from rlctl.commands.launch import submit, write_batch_script
    from rlctl.recipe import load_recipe
    from rlctl.run.sweep import overrides_of

    data = sw.read()
    for i, _ in enumerate(data["points"]):
        overrides = overrides_of(data, i)
        rd = write_batch_script(load_recipe(recipe, overrides), recipe, overrides)
        job = submit(rd, rd.path / "job.sbatch")
        sw.set_run(i, rd.id)
        typer.echo(f"point {i + 1}/{len(data['points'])}: {rd.id} (Slurm job {job})  {' '.join(overrides)}", err=True)


if __name__ == "__main__":  # the background driver (--detach), in the directory the sweep was started in
    from rlctl.run.sweep import Sweep

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _drive(Sweep(Path(sys.argv[1])), int(sys.argv[2]))
