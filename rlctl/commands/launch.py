"""`rlctl launch RECIPE [key=value ...]`: validate the recipe, create the run, start it, follow it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import typer

from rlctl.errors import RunError
from rlctl.rundir import RunDir, RunState, pid_alive


def launch(
    recipe: Path = typer.Argument(..., help="The recipe YAML file."),
    overrides: list[str] | None = typer.Argument(None, help="KEY=VALUE overrides, e.g. run.steps=10."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return at once; the run goes on in the background."),
) -> None:
    """Start a run from a recipe."""
    from rlctl.launchers.local import start_supervisor
    from rlctl.plan import local_plan
    from rlctl.recipe import load_recipe, recipe_to_yaml
    from rlctl.rundir import create_run_dir

    r = load_recipe(recipe, overrides or [])  # validation admits only the launchers this version has
    plan = local_plan(r)
    info = {
        "launcher": r.launcher,
        "mode": r.pipeline.mode,
        "steps_total": r.run.steps,
        "recipe_file": str(recipe),
        "overrides": list(overrides or []),
        "model_path": str(Path(os.path.expanduser(r.model.path)).resolve()) if r.model.path else None,
        "plan": plan.to_json(),
    }
    rd = create_run_dir(Path(r.run.output_dir), r.run.name, recipe_to_yaml(r), info)
    start_supervisor(rd)
    if detach:
        print(rd.id)
        return
    code = follow(rd)
    raise typer.Exit(code)


def _supervisor_pid(rd: RunDir, wait_s: float = 10.0) -> int | None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pid = rd.read()["processes"].get("supervisor", {}).get("pid")
        if pid:
            return pid
        time.sleep(0.05)
    return None


def follow(rd: RunDir) -> int:
    """Show a progress bar until the run ends; Ctrl-C cancels the run. Returns the exit code."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    info = rd.read()
    total = info["steps_total"]
    err.print(f"run [bold]{rd.id}[/] ({info['mode']}, {info['launcher']}) in {rd.path}")
    supervisor = _supervisor_pid(rd)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("reward {task.fields[reward]}"), TextColumn("{task.fields[step_time]}"),
                        TimeElapsedColumn(), console=err, transient=False)
    task = progress.add_task("starting", total=total, reward="-", step_time="")
    try:
        with progress:
            while True:
                info = rd.read()
                metrics = rd.metrics()
                if metrics:
                    m = metrics[-1]
                    progress.update(task, completed=len(metrics), description="training",
                                    reward=f"{m['reward_mean']:.3f}", step_time=f"{m['step_time']:.2f} s/step")
                elif info["state"] == RunState.RUNNING.value:
                    progress.update(task, description="running")
                state = RunState(info["state"])
                if state.finished:
                    break
                if supervisor and not pid_alive(supervisor):
                    time.sleep(0.5)  # it may have just written its final state
                    if not RunState(rd.read()["state"]).finished:
                        rd.set_state(RunState.FAILED, f"supervisor (pid {supervisor}) is gone; see {rd.log_path('supervisor')}")
                    continue
                time.sleep(0.5)
    except KeyboardInterrupt:
        err.print("cancelling...")
        if supervisor:
            os.kill(supervisor, signal.SIGTERM)
            while pid_alive(supervisor):
                time.sleep(0.1)
        return 130
    info = rd.read()
    state = RunState(info["state"])
    if state is RunState.COMPLETED:
        metrics = rd.metrics()
        first = [m["reward_mean"] for m in metrics[:5]]
        last = [m["reward_mean"] for m in metrics[-5:]]
        summary = f"reward {sum(first) / len(first):.3f} (first {len(first)} steps) -> {sum(last) / len(last):.3f} (last {len(last)})" if metrics else ""
        err.print(f"[green]completed[/] {rd.id}: {summary}")
        print(rd.id)
        return 0
    if state is RunState.FAILED:
        raise RunError(f"run {rd.id} failed: {info.get('exit_reason')}")
    err.print(f"[yellow]{state.value}[/] {rd.id}: {info.get('exit_reason')}")
    return 1
