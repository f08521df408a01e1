"""`rlctl plan RECIPE --gpus N`: every placement of the recipe on N GPUs, ranked before a GPU-hour
is spent.

The planner (rlctl/planner) enumerates the placements, keeps those that fit in memory, and
predicts each one's step from work and depth per stage on the recipe's cost model: the one
`rlctl simulate` runs, so `--simulate K` shows how far the analytic step is from the scheduler's
own, placement by placement. Placements are ranked by seconds per 1,000 samples (a step of async
trains fewer samples than a step of sync), then GPU-seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from rlctl.errors import RunError, UsageError


GPU_KINDS = "h200|h100|a100|cpu"
"""--gpu's choices as its help shows them: sim.gpu's (rlctl.recipe.GpuKind, which is not imported
for `--help`; tests/test_cli_help.py holds the two alike)."""


def _gpu_kinds(incomplete: str) -> list[str]:
    """--gpu's choices for shell completion: sim.gpu's (the recipe schema is imported only here,
    not by `rlctl --help`)."""
    from rlctl.recipe import GpuKind

    return [g.value for g in GpuKind if g.value.startswith(incomplete)]


def _table(rows: list[Any], simulated: dict[int, float]) -> str:
    from rlctl.costs.memory import GIB

    head = (f"{'#':>2} {'mode':<12}{'GPUs r+t':>10} {'servers':<10}{'trainer':<16}{'mb':>4}"
            f"{'step s':>8}{'s/1k':>7}{'GPU-s/1k':>9}{'GiB t/s':>10}  bound")
    if simulated:
        head += f"{'sim s':>9}{'diff':>7}"
    lines = [head]
    for i, e in enumerate(rows):
        p = e.placement
        mode = f"{p.mode}{' coloc' if p.colocated else ''}"
        where = str(p.rollout_gpus) if p.colocated else f"{p.rollout_gpus}+{p.trainer_gpus}"
        mb = f"{p.micro_batch_tokens // 1024}k" if p.micro_batch_tokens >= 1024 else str(p.micro_batch_tokens)
        mem = f"{e.trainer.total / GIB:.0f}/{e.server.total / GIB:.0f}"
        line = (f"{i + 1:>2} {mode:<12}{where:>10} {f'tp{p.rollout_tp} x{p.servers}':<10}"
                f"{f'tp{p.train_tp} pp{p.train_pp} dp{p.train_dp}':<16}{mb:>4}{e.step_s:>8.3g}"
                f"{e.step_s / e.samples * 1000:>7.3g}{e.gpu_s_per_1k:>9.4g}{mem:>10}  {e.bound:<12}")
        if i in simulated:
            line += f"{simulated[i]:>9.3g}{e.step_s / simulated[i] - 1:>+7.1%}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def _simulated_step(recipe_file: Path, overrides: list[str], e: Any, steps: int) -> float:
    """The median step time `rlctl simulate` gives the placement (the first step left out: the
    pipelines start empty)."""
    import statistics

    from rlctl.recipe import load_recipe
    from rlctl.sim.run import simulate_run

    r = load_recipe(recipe_file, [*overrides, *e.placement.overrides(e.running), f"run.steps={steps}"],
                    check_paths=False)
    metrics = simulate_run(r).metrics
    return statistics.median(m["step_time"] for m in (metrics[1:] or metrics))


def _describe(r: Any, cost: Any, gpus: int, per_node: int, result: Any, where: str) -> list[str]:
    from rlctl.costs.lengths import Lengths

    lengths = Lengths.of(r)
    tail = "long tail" if r.rollout.sampling.long_tail.enabled else "all at the cap"
    samples = r.rollout.batch_size * r.rollout.group_size
    return [
        f"plan for {r.run.name}: {gpus} {r.sim.gpu} GPUs, {per_node} per node: {result.considered} placements "
        f"in {result.seconds:.2f} s, {len(result.unfit)} do not fit",
        f"  model {cost.model.params / 1e9:.4g}B ({cost.model.bytes_per_param:g} bytes per weight served); "
        f"{samples} samples per rollout batch; responses {tail} up to {r.rollout.sampling.max_new_tokens} tokens "
        f"(mean {lengths.mean:.0f}, longest of the batch {lengths.expected_max(samples):.0f})",
        f"  cost model rlctl/costs/model.py: {where}",
    ]


def plan(
    recipe: Path = typer.Argument(..., help="The recipe YAML file."),
    overrides: list[str] | None = typer.Argument(None, help="KEY=VALUE overrides, e.g. rollout.batch_size=512."),
    gpus: int = typer.Option(..., "--gpus", help="GPUs to place the run on."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU kind (default: the recipe's sim.gpu).",
                                   metavar=f"<{GPU_KINDS}>", autocompletion=_gpu_kinds),
    per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node: tensor parallelism stays within one."),
    top: int = typer.Option(5, "--top", help="How many placements to show."),
    as_json: bool = typer.Option(False, "--json", help="Print the ranking as JSON."),
    simulate_k: int = typer.Option(0, "--simulate", help="Also simulate the top K and show predicted vs simulated."),
    sim_steps: int = typer.Option(4, "--sim-steps", help="Steps each --simulate run takes."),
    pp: bool = typer.Option(False, "--pp", help="Also pipeline-parallel trainers (planned; rlctl trains pp=1)."),
    calibrate_from: str | None = typer.Option(None, "--calibrate", help="Fit the cost model to this measured run first."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where --calibrate runs are."),
) -> None:
    """Rank every placement of a recipe on N GPUs: the rollout/train split or colocation, server
    and trainer parallelism, micro-batch and pipeline mode, each with its predicted step time,
    GPU-seconds per 1k samples, memory per GPU and the stage that bounds it."""
    from rlctl.commands.simulate import has_sim_section
    from rlctl.costs.recipe import cost_model
    from rlctl.planner.search import explain
    from rlctl.planner.search import plan as search
    from rlctl.recipe import load_recipe

    if gpus < 1 or per_node < 1 or top < 1 or simulate_k < 0 or sim_steps < 2:
        raise UsageError("--gpus, --gpus-per-node and --top must be at least 1, --simulate at least 0, "
                         "--sim-steps at least 2")
    if gpu is not None and gpu not in _gpu_kinds(""):
        raise UsageError(f"--gpu {gpu!r}: not a GPU kind the cost model knows; one of {', '.join(_gpu_kinds(''))}")
    asked = [*(overrides or []), *([f"sim.gpu={gpu}"] if gpu else [])]
    given = [*_calibration(calibrate_from, runs_dir, as_json), *asked]
    r = load_recipe(recipe, given, check_paths=False)
    cost = cost_model(r)
    per_node = min(per_node, gpus)
    result = search(r, cost, gpus, per_node, pp=pp)
    if not result.ranked:
        worst = result.unfit[0] if result.unfit else None
        raise RunError(f"no placement of {recipe} fits on {gpus} {r.sim.gpu} GPUs"
                       + (f": e.g. {worst.placement.label()}: {worst.unfit}" if worst else ""))
    shown = result.ranked[:top]
    simulated = {i: _simulated_step(recipe, given, e, sim_steps) for i, e in enumerate(shown[:simulate_k])}
    if as_json:
        print(json.dumps({"recipe": str(recipe), "gpus": gpus, "gpu": str(r.sim.gpu), "considered": result.considered,
                          "unfit": len(result.unfit), "seconds": result.seconds,
                          "ranked": [{**e.to_json(), **({"simulated_step_s": simulated[i]} if i in simulated else {}),
                                      **dict(zip(("launch", "not_launchable"), _launch(r, e, per_node),
                                                 strict=True))}
                                     for i, e in enumerate(shown)]}, indent=1))
        return
    where = f"calibrated on {calibrate_from}" if calibrate_from else (
        f"the sim: section of {recipe}" if has_sim_section(recipe) else "the sim: defaults (the recipe has no sim:)")
    print("\n".join(_describe(r, cost, gpus, per_node, result, where)))
    print(_table(shown, simulated))
    if len(result.ranked) > 1:
        print(f"#1 against #2: {explain(result.ranked[0], result.ranked[1])}")
    print("simulate #1: rlctl simulate " + " ".join([str(recipe), *given, *shown[0].placement.overrides(shown[0].running)]))
    print(_launch_line(recipe, asked, r, result.ranked, per_node))


def _launch(r: Any, e: Any, per_node: int) -> tuple[list[str] | None, str]:
    """The overrides that launch estimate e's placement, or None and why not."""
    from rlctl.planner.launch import NotLaunchable, launch_overrides

    try:
        return launch_overrides(r, e.placement, e.running, per_node), ""
    except NotLaunchable as why:
        return None, str(why)


def _launch_line(recipe: Path, given: list[str], r: Any, ranked: list[Any], per_node: int) -> str:
    """How to launch #1, or, when rlctl cannot launch it yet, why and the best one it can."""
    keys, why = _launch(r, ranked[0], per_node)
    if keys is not None:
        return "launch #1: rlctl launch " + " ".join([str(recipe), *given, *keys])
    for i, e in enumerate(ranked[1:], start=2):
        keys, _ = _launch(r, e, per_node)
        if keys is not None:
            return (f"launch #1: not yet ({why}); the first rlctl can launch is #{i} ({e.placement.label()}, "
                    f"{e.step_s:.3g} s a step): rlctl launch " + " ".join([str(recipe), *given, *keys]))
    return f"launch #1: not yet ({why}); no ranked placement can be launched by rlctl yet"


def _calibration(run: str | None, runs_dir: Path, quiet: bool) -> list[str]:
    if not run:
        return []
    from rlctl.run.find import find_run
    from rlctl.sim.calibrate import calibrate_run

    measured = find_run(run, runs_dir)
    knobs = calibrate_run(measured)
    if not quiet:
        print(f"calibrated on {measured.id}: " + " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in knobs.items()))
    return [f"{k}={v}" for k, v in knobs.items()]
