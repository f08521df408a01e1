"""`rlctl launch RECIPE [key=value ...]`: validate the recipe, create the run, start it, follow it."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from rlctl.errors import RunError, UsageError


def launch(
    recipe: Path = typer.Argument(..., help="The recipe YAML file."),
    overrides: list[str] | None = typer.Argument(None, help="KEY=VALUE overrides, e.g. run.steps=10."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return at once; the run goes on in the background."),
    dry_run: bool = typer.Option(False, "--dry-run", help="launcher=slurm: print the batch script; write and submit "
                                 "nothing."),
    resume: bool = typer.Option(False, "--resume", help="Continue the recipe's newest run (same run.name) from its "
                                "newest checkpoint if it stopped early; start a new run if there is none."),
) -> None:
    """Start a run from a recipe."""
    from rlctl.errors import RecipeError
    from rlctl.recipe import Launcher, load_recipe
    from rlctl.recipe.load import blame_overrides

    r = load_recipe(recipe, overrides or [])
    try:
        _check_trainer_fits(r, recipe)
        _check_data(r)
        _check_environment(r, recipe)
    except RecipeError as e:  # the key the command line set is blamed on it, as load_recipe does
        raise blame_overrides(e, str(recipe), overrides or []) from None
    if resume and not dry_run:
        from rlctl.commands.resume import resume_recipe

        code = resume_recipe(r, recipe, detach)
        if code is not None:
            raise typer.Exit(code)
    if r.launcher is Launcher.SLURM:
        code = launch_slurm(r, recipe, overrides or [], detach=detach, dry_run=dry_run)
        raise typer.Exit(code)
    if dry_run:
        raise UsageError("--dry-run is for launcher=slurm (a local run has no script to show)")
    code = launch_local(r, recipe, overrides or [], detach=detach)
    raise typer.Exit(code)


def code_version() -> dict:
    """The rlctl checkout's git commit and whether it had uncommitted changes ({} outside git)."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if commit.returncode != 0:
            return {}
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _run_info(r, recipe: Path, overrides: list[str], plan: dict | None) -> dict:
    return {
        "code": code_version(),
        "launcher": r.launcher,
        "mode": r.pipeline.mode,
        **({"colocated": True} if r.colocate.enabled else {}),
        "steps_total": r.run.steps,
        "recipe_file": str(recipe),
        "overrides": list(overrides),
        "model_path": str(Path(os.path.expanduser(r.model.path)).resolve()) if r.model.path else None,
        "plan": plan,
    }


def _check_trainer_fits(r, recipe: Path) -> None:
    """The Megatron trainer's largest micro-batch fits its GPU, by the planner's memory model
    (rlctl/planner/fit.py); else a recipe error naming the key to change."""
    from rlctl.errors import RecipeError
    from rlctl.planner.fit import micro_batch_problem

    problem = micro_batch_problem(r)
    if problem is not None:
        raise RecipeError(str(recipe), *problem)


def _check_data(r) -> None:
    """Every row of the data file, read and checked here: a malformed one stops the launch before
    anything starts (rlctl/data/check.py)."""
    from rlctl.data.check import check_data

    check_data(r)


def _check_environment(r, recipe: Path) -> None:
    """rollout.multi_turn's environment, made ready here (the python tool: a sandbox that runs),
    so that one that cannot work stops the launch before anything starts."""
    if not r.rollout.multi_turn.enabled:
        return
    from rlctl.agents.builtin import environment_factory
    from rlctl.errors import RecipeError
    from rlctl.recipe import FieldError

    try:
        environment_factory(r.rollout.multi_turn)
    except FieldError as e:
        raise RecipeError(str(recipe), f"rollout.multi_turn.{e.key}", e.message) from None


def _check_engines_importable(r) -> None:
    """A local run starts its engines here: say at once when one is not installed."""
    from rlctl.engines.rollout.registry import rollout_adapter
    from rlctl.engines.train.adapter import trainer_adapter

    rollout_adapter(r.rollout.engine).check_installed()
    trainer_adapter(r.train.engine).check_installed()


def launch_local(r, recipe: Path, overrides: list[str], *, detach: bool) -> int:
    rd = start_local_run(r, recipe, overrides)
    if detach:
        print(rd.id)
        return 0
    from rlctl.commands.follow import follow

    return follow(rd)


def start_local_run(r, recipe: Path, overrides: list[str]):
    """Create the run directory and start its supervisor (which starts every process); the RunDir."""
    from rlctl.launchers.local import start_supervisor
    from rlctl.process.topology import local_topology
    from rlctl.recipe import Launcher, recipe_to_yaml
    from rlctl.run.dir import create_run_dir

    _check_engines_importable(r)
    info = _run_info(r, recipe, overrides, local_topology(r).to_json())
    if r.launcher is Launcher.POOL:
        from rlctl.launchers.pool.pooldir import PoolDir

        pd = PoolDir((Path(r.pool.dir) / r.pool.name).resolve())
        pd.require_up("pool.name", then=" or set pool.dir")
        info["pool_dir"] = str(pd.path)
    rd = create_run_dir(Path(r.run.output_dir), r.run.name, recipe_to_yaml(r), info, shared_group=r.run.shared_group)
    start_supervisor(rd)
    return rd


def launch_slurm(r, recipe: Path, overrides: list[str], *, detach: bool, dry_run: bool) -> int:
    """Write the batch script into a new run directory and sbatch it. The plan is written by the
    job, once it knows its nodes. --dry-run prints the script the run would get and leaves no
    trace: no run directory on the cluster's path, nothing submitted."""
    if dry_run:
        text, run_dir = dry_run_script(r)
        print(text, end="")
        typer.echo(f"dry run: nothing written, nothing submitted (the run would be {run_dir})", err=True)
        return 0
    rd = write_batch_script(r, recipe, overrides)
    script = rd.path / "job.sbatch"
    job_id = submit(rd, script)
    if detach:
        typer.echo(f"submitted Slurm job {job_id}", err=True)
        print(rd.id)
        return 0
    from rlctl.commands.follow import follow

    return follow(rd)


def dry_run_script(r) -> tuple[str, Path]:
    """The batch script `rlctl launch` would write for the recipe, and the run directory it would
    make (a new run id under run.output_dir); nothing is created."""
    import sys

    from rlctl.launchers import slurm
    from rlctl.run.dir import new_run_id

    run_id = new_run_id(r.run.name)
    run_dir = (Path(r.run.output_dir) / run_id).resolve()
    return slurm.render_batch_script(r, run_dir, run_id, r.slurm.python or sys.executable), run_dir


def submit(rd, script: Path) -> str:
    """sbatch the run's batch script and record the job; the job id."""
    from rlctl.launchers import slurm
    from rlctl.run.dir import RunState

    try:
        job_id = slurm.submit(script)
    except RunError as e:
        rd.set_state(RunState.FAILED, f"not submitted: {e}")
        raise
    rd.update(lambda d: d["slurm"].update(job_id=job_id))
    rd.event("submitted", job_id=job_id)
    return job_id


def write_batch_script(r, recipe: Path, overrides: list[str]):
    """A new run directory holding the run's batch script (job.sbatch); the RunDir."""
    import sys

    from rlctl.launchers import slurm
    from rlctl.recipe import recipe_to_yaml
    from rlctl.run.dir import create_run_dir

    python = r.slurm.python or sys.executable
    rd = create_run_dir(Path(r.run.output_dir), r.run.name, recipe_to_yaml(r), _run_info(r, recipe, overrides, None),
                        shared_group=r.run.shared_group)
    script = rd.path / "job.sbatch"
    script.write_text(slurm.render_batch_script(r, rd.path.resolve(), rd.id, python))
    rd.update(lambda d: d.update(slurm={"script": str(script)}))
    return rd
