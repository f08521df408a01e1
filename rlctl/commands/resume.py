"""`rlctl resume RUN`: continue a failed or cancelled run from its newest checkpoint, as the same
run (same id and directory, a new attempt in run.json)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from rlctl.errors import UsageError

if TYPE_CHECKING:
    from rlctl.run.dir import RunDir, RunState


def resume(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return at once; the run goes on in the background."),
) -> None:
    """Continue a failed or cancelled run at the step after its newest checkpoint."""
    from rlctl.run.find import find_run

    raise typer.Exit(resume_run(find_run(run, runs_dir), detach))


def resumable(rd: RunDir) -> tuple[RunState, str | None, dict]:
    """The run's state, joined with its Slurm job's; a usage error unless it ran locally or on
    Slurm and has ended. Returns the state, why it is in it (the reading of
    rlctl/launchers/liveness.py, as `rlctl status` gives it), and run.json."""
    from rlctl.launchers.liveness import read_run

    info = rd.read()
    if info.get("launcher") not in ("local", "slurm", "pool"):
        raise UsageError(f"run {rd.id} ran with launcher={info.get('launcher')}; rlctl resume continues local, "
                         "Slurm and pooled runs")
    # Slurm's word on the job first: a run whose job ended unrecorded is ended now
    now = read_run(rd, info, ask_slurm=True)
    if not now.state.finished:
        raise UsageError(f"run {rd.id} is still {now.state.value}; `rlctl cancel {rd.id}` first to resume it from a checkpoint")
    return now.state, now.reason, now.info


def resume_run(rd: RunDir, detach: bool) -> int:
    """Continue the run at the step after its newest checkpoint; the exit code."""
    from rlctl.run.checkpoint import find_checkpoint, prepare_resume
    from rlctl.commands.follow import follow
    from rlctl.launchers.local import start_supervisor
    from rlctl.launchers.pool.pooldir import PoolDir
    from rlctl.run.dir import RunState

    state, why, info = resumable(rd)
    if state is RunState.COMPLETED:
        raise UsageError(f"run {rd.id} completed all its {info.get('steps_total')} steps; there is nothing to resume")
    ckpt = find_checkpoint(rd.path)
    if info.get("launcher") == "slurm":
        return resubmit(rd, ckpt.steps, detach)
    if info.get("launcher") == "pool":  # it continues in its pool, attached again and placed anew
        PoolDir(Path(info.get("pool_dir") or ".")).require_up(then=" to resume the run in it")
    if not RunState(info["state"]).finished:  # its supervisor died without saying so: say it now
        rd.set_state(state, why)
    attempt = prepare_resume(rd, ckpt)
    rd.record_process("supervisor", pid=start_supervisor(rd))
    typer.echo(f"resuming {rd.id} at step {ckpt.steps} of {info.get('steps_total')} "
               f"(attempt {attempt['attempt']}, {ckpt.path})", err=True)
    if detach:
        print(rd.id)
        return 0
    return follow(rd)


def resubmit(rd: RunDir, steps: int, detach: bool) -> int:
    """A Slurm run: submit its batch script again. The new job's first step sees a later attempt
    and resumes from the newest checkpoint (rlctl/launchers/slurm/steps.py)."""
    from rlctl.run.checkpoint import SLURM_ATTEMPT_KEYS
    from rlctl.commands.follow import follow
    from rlctl.launchers import slurm
    from rlctl.run.dir import RunState, now_iso

    script = rd.path / "job.sbatch"
    if not script.is_file():
        raise UsageError(f"{script}: the run's batch script is gone; it cannot be submitted again")
    job_id = slurm.submit(script)
    info = rd.read()
    old_job = info.get("slurm") or {}
    end = {"state": info["state"], "at": info.get("ended") or now_iso(), "reason": info.get("exit_reason"),
           "slurm": {k: old_job.get(k) for k in SLURM_ATTEMPT_KEYS}}

    def reopen(d: dict) -> None:
        d.update(state=RunState.STARTING.value, ended=None, exit_reason=None, attempt_end=end)
        d.setdefault("slurm", {}).update(job_id=job_id, last=None)
    rd.update(reopen)
    rd.event("submitted", job_id=job_id, resume_from=steps)
    typer.echo(f"resuming {rd.id} at step {steps} of {info.get('steps_total')}: submitted Slurm job {job_id}", err=True)
    if detach:
        print(rd.id)
        return 0
    return follow(rd)


def resume_recipe(r, recipe: Path, detach: bool) -> int | None:
    """`rlctl launch RECIPE --resume`: continue the recipe's newest run (its run.name in its
    run.output_dir) from its newest checkpoint; the exit code, or None where a new run should
    start (no earlier run, or one without a checkpoint). A batch script that always calls it
    runs the recipe to its end, however often it is stopped."""
    from rlctl.run.checkpoint import list_checkpoints
    from rlctl.recipe import recipe_to_yaml
    from rlctl.run.dir import RunState
    from rlctl.run.find import list_runs

    runs = [rd for rd in list_runs(Path(r.run.output_dir)) if rd.id.rsplit("-", 3)[0] == r.run.name]
    if not runs:
        typer.echo(f"--resume: no earlier run named {r.run.name} in {r.run.output_dir}; starting a new one", err=True)
        return None
    rd = runs[-1]  # ids are name-YYYYmmdd-HHMMSS-xxxx: the newest last
    state, _, info = resumable(rd)
    if state is RunState.COMPLETED:
        typer.echo(f"--resume: run {rd.id} completed all its {info.get('steps_total')} steps; nothing to do", err=True)
        print(rd.id)
        return 0
    if not list_checkpoints(rd.path):
        typer.echo(f"--resume: run {rd.id} ({state.value}) has no checkpoint; starting a new run", err=True)
        return None
    changed = recipe_differences(recipe_to_yaml(r), rd.recipe_path.read_text())
    if changed:
        raise UsageError(f"{recipe}: differs from the recipe of run {rd.id} in {', '.join(changed[:4])}"
                         f"{' ...' if len(changed) > 4 else ''}; resume it with the recipe it ran, or launch "
                         "without --resume")
    return resume_run(rd, detach)


def recipe_differences(a: str, b: str) -> list[str]:
    """The dotted keys whose values differ between two resolved recipes (YAML)."""
    import yaml

    from rlctl.run.compare import flatten

    fa, fb = flatten(yaml.safe_load(a)), flatten(yaml.safe_load(b))
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))
