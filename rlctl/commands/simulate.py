"""`rlctl simulate RECIPE [key=value ...]`: plan a cluster-scale run without the cluster.

The recipe's own pipeline (sync, rolloutpipe, async; fifo or frontier admission) runs against
simulated rollout servers and a simulated trainer whose durations come from the cost model of
`sim:` (GPU kind, model size, GPU counts), under virtual time (rlctl/sim/run.py). It writes the
same run directory as a real run (launcher `simulate`, named sim-<run.name>-...: `rlctl status
NAME` finds the recipe's real runs, never its simulations), so status, logs and metrics read it
the same way, and prints the per-step metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

TABLE = [
    ("step", "step", "{:d}"),
    ("step_time", "step s", "{:.1f}"),
    ("rollout_time", "rollout s", "{:.1f}"),
    ("train_time", "train s", "{:.1f}"),
    ("sync_time", "sync s", "{:.2f}"),
    ("rollout_to_train_end", "r2t end s", "{:.1f}"),
    ("trainer_wait_ratio", "wait", "{:.2f}"),
    ("efficiency", "eff", "{:.2f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
]


TOOLS = [
    ("turns_per_sample", "turns", "{:.2f}"),
    ("tool_calls", "calls", "{:d}"),
    ("tool_seconds_max", "tool max s", "{:.1f}"),
    ("rollout_idle_tool_ratio", "idle tools", "{:.2f}"),
]
"""A multi-turn recipe's columns besides (rollout.multi_turn with sim.tools)."""


def render_metrics(metrics: list[dict[str, Any]]) -> str:
    table = TABLE + (TOOLS if metrics and "tool_calls" in metrics[0] else [])
    widths = [max(len(label), 9) for _, label, _ in table]
    lines = [" ".join(label.rjust(w) for (_, label, _), w in zip(table, widths))]
    for m in metrics:
        lines.append(" ".join(fmt.format(m[key]).rjust(w) for (key, _, fmt), w in zip(table, widths)))
    return "\n".join(lines)


def render_pool(result: Any) -> str:
    """Each job's wall time alone and in the pool, and the GPU-hours of both, side by side."""
    head = f"{'job':<14}{'mode':<12}{'GPUs':>5}{'alone s':>9}{'pool s':>9}{'slowdown':>9}{'used GPU-h':>11}{'alone GPU-h':>12}"
    lines = [head]
    for j in result.jobs:
        lines.append(f"{j.name:<14}{j.mode:<12}{j.gpus:>5}{j.dedicated_s:>9.1f}{j.pool_s:>9.1f}{j.slowdown:>9.2f}"
                     f"{j.used_gpu_s / 3600:>11.2f}{j.dedicated_gpu_s / 3600:>12.2f}")
    dedicated, pooled = result.dedicated_gpu_s / 3600, result.held_gpu_s / 3600
    lines.append(f"GPU-hours: dedicated {dedicated:.2f} ({sum(j.gpus for j in result.jobs)} GPUs), "
                 f"pool {pooled:.2f} ({result.gpus} GPUs, busy {result.busy_gpu_s / result.held_gpu_s:.0%}): "
                 f"{1 - pooled / dedicated:.1%} fewer than dedicated")
    if result.co_location:
        d, (need, cap) = next(iter(result.co_location.items()))
        lines.append(f"naive co-location: does not fit on {len(result.co_location)} of {result.gpus} GPUs "
                     f"(GPU {d} needs {need / 1e9:.0f} GB of {cap / 1e9:.0f} GB)")
    else:
        lines.append("naive co-location: every GPU's models fit at once")
    return "\n".join(lines)


def _is_pool_file(path: Path) -> bool:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()[:1 << 20])
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # the recipe loader says what is wrong with it
    return isinstance(data, dict) and "jobs" in data


def has_sim_section(recipe: Path) -> bool:
    """Whether the recipe file has a sim: section (False when it cannot be read: the recipe
    loader says what is wrong with it)."""
    import yaml

    try:
        data = yaml.safe_load(recipe.read_text()[:1 << 20])
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and isinstance(data.get("sim"), dict)


def _sim_source(recipe: Path, overrides: list[str], fitted: list[str], defaults_ok: bool) -> str:
    """Where the cost model's numbers come from; a UsageError when the recipe says nothing of
    the cluster it would be priced on and --sim-defaults was not given."""
    from rlctl.errors import UsageError

    has_section = has_sim_section(recipe)
    overridden = [o.split("=")[0] for o in overrides if o.startswith("sim.")]
    if not (has_section or overridden or fitted or defaults_ok):
        raise UsageError(f"{recipe}: no sim: section, so nothing says what cluster and model to price; add one "
                         "(see recipes/sim-1024gpu.yaml), set sim.* keys, or pass --sim-defaults (a 1.7B "
                         "model on 8 + 8 H200s)")
    parts = [f"the sim: section of {recipe}"] if has_section else ["the sim: defaults"]
    parts += [f"overridden: {', '.join(overridden)}"] if overridden else []
    parts += [f"calibrated: {', '.join(f.split('=')[0] for f in fitted)}"] if fitted else []
    return "\n    " + "\n    ".join(parts)


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else f"{value}"


def simulate(
    recipe: Path = typer.Argument(..., help="The recipe YAML file."),
    overrides: list[str] | None = typer.Argument(None, help="KEY=VALUE overrides, e.g. sim.rollout_gpus=512."),
    save: bool = typer.Option(True, "--save/--no-save", help="Write a run directory (launcher: simulate)."),
    calibrate_from: str | None = typer.Option(None, "--calibrate", help="Fit the cost model to this measured run first."),
    compare: str | None = typer.Option(None, "--compare", help="Print predicted vs measured step time for this run."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where --calibrate/--compare runs are."),
    sim_defaults: bool = typer.Option(False, "--sim-defaults",
                                      help="Simulate with the sim: section's defaults (a 1.7B model on 8 + 8 H200s) when the recipe has none."),
) -> None:
    """Simulate a run at cluster scale: the real scheduler, simulated engines, virtual time. Given
    a pool file (a `jobs:` list), simulate its jobs sharing the pool's GPUs."""
    import statistics

    if _is_pool_file(recipe):
        from rlctl.recipe.load import load_pool_file
        from rlctl.sim.pool import simulate_pool

        spec = load_pool_file(recipe, list(overrides or []))
        print(render_pool(simulate_pool(spec)))
        return

    from rlctl.costs.recipe import cost_model
    from rlctl.recipe import load_recipe
    from rlctl.run.find import find_run
    from rlctl.sim.run import simulate_into_run_dir, simulate_run

    fitted: list[str] = []
    if calibrate_from:
        from rlctl.sim.calibrate import calibrate_run

        measured = find_run(calibrate_from, runs_dir)
        knobs = calibrate_run(measured)
        fitted = [f"{k}={v}" for k, v in knobs.items()]
        print(f"calibrated on {measured.id}: " + " ".join(f"{k}={_shown(v)}" for k, v in knobs.items()))
    where = _sim_source(recipe, list(overrides or []), fitted, sim_defaults)
    default_size = ["sim.params_b=1.7"] if where.endswith("the sim: defaults") else []  # not the recipe's model
    r = load_recipe(recipe, [*default_size, *fitted, *(overrides or [])], check_paths=False)
    rd = None
    if save:
        rd, result = simulate_into_run_dir(r, recipe, list(overrides or []))
    else:
        result = simulate_run(r)
    sim = r.sim
    samples = r.rollout.batch_size * r.rollout.group_size
    print(f"simulated {r.run.steps} steps of {r.pipeline.mode} ({r.pipeline.admission} admission) "
          f"in {result.wall_seconds:.2f} s of wall time")
    print(f"  model {cost_model(r).model.params / 1e9:.4g}B; {sim.gpu} GPUs: {sim.rollout_gpus} rollout (tp {sim.tp}) + "
          f"{sim.trainer_gpus} trainer")
    print(f"  per step: {r.rollout.batch_size} groups x {r.rollout.group_size} = {samples} samples asked")
    print(f"  cost model (rlctl/costs/model.py: durations priced, not measured):{where}")
    print(render_metrics(result.metrics))
    if compare:
        other = find_run(compare, runs_dir).metrics()
        predicted = statistics.median(m["step_time"] for m in (result.metrics[1:] or result.metrics))
        measured_s = statistics.median(m["step_time"] for m in (other[1:] or other))
        print(f"median step time: predicted {predicted:.3f} s, measured {measured_s:.3f} s "
              f"({predicted / measured_s - 1:+.1%}) for {compare}")
    if rd is not None:
        print(rd.id)
