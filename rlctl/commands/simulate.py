"""`rlctl simulate RECIPE [key=value ...]`: plan a cluster-scale run without the cluster.

The recipe's own pipeline (sync, rolloutpipe, async; fifo or frontier admission) runs against
simulated rollout servers and a simulated trainer whose durations come from the cost model of
`sim:` (GPU kind, model size, GPU counts), under virtual time. It writes the same run directory
as a real run (launcher `simulate`), so status, logs and metrics read it the same way, and prints
the per-step metrics.
"""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path
from typing import Any

import typer

from rlctl.recipe import Recipe


def simulate_run(recipe: Recipe) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Run the recipe's pipeline in virtual time. Returns (events, metrics, wall seconds)."""
    from rlctl.metrics import step_metrics
    from rlctl.pipelines.build import build_pipeline
    from rlctl.sim.cost import HARDWARE, CostModel, ModelShape
    from rlctl.sim.engines import SimRollout, SimTrainer
    from rlctl.sim.loop import VirtualClock, run_virtual

    sim = recipe.sim
    cost = CostModel(
        HARDWARE[sim.gpu], ModelShape.from_params_b(sim.params_b, layers=sim.layers or None, kv_dim=sim.kv_dim or None),
        mfu_train=sim.mfu_train, mean_context_tokens=sim.context_tokens,
        mfu_prefill=sim.mfu_prefill, decode_bw_efficiency=sim.decode_bw_efficiency, gpus_per_server=sim.tp,
        trainer_gpus=sim.trainer_gpus, decode_step_overhead_s=sim.decode_step_overhead_s,
        train_step_overhead_s=sim.train_step_overhead_s,
    )
    servers = [SimRollout(f"rollout-{i}", cost, recipe.rollout.max_running_requests)
               for i in range(sim.rollout_gpus // sim.tp)]
    trainer = SimTrainer(cost, servers)
    events: list[dict[str, Any]] = []
    metrics: list[dict[str, Any]] = []
    rng = random.Random(recipe.run.seed)

    def emit(kind: str, t: float, **fields: Any) -> None:
        events.append({"t": t, "event": kind, **fields})

    def on_step_end(step: int) -> None:
        metrics.append(step_metrics(events, step))

    prompt = [0] * sim.prompt_tokens
    clock = VirtualClock()
    pipeline = build_pipeline(
        recipe, servers, trainer, clock, emit, on_step_end,
        tokenize=lambda text: prompt, detokenize=lambda ids: "",
        verify=lambda response, answer: 1.0 if rng.random() < sim.reward_rate else 0.0,
    )
    start = time.perf_counter()
    # Millions of small, acyclic, long-lived objects (events, samples): the cyclic collector would
    # rescan them over and over, making each step slower than the last. Reference counting frees
    # everything here; collect once at the end.
    gc.disable()
    try:
        run_virtual(pipeline.run(recipe.run.steps))
    finally:
        gc.enable()
    return events, metrics, time.perf_counter() - start


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


def render_metrics(metrics: list[dict[str, Any]]) -> str:
    widths = [max(len(label), 9) for _, label, _ in TABLE]
    lines = [" ".join(label.rjust(w) for (_, label, _), w in zip(TABLE, widths))]
    for m in metrics:
        lines.append(" ".join(fmt.format(m[key]).rjust(w) for (key, _, fmt), w in zip(TABLE, widths)))
    return "\n".join(lines)


def simulate(
    recipe: Path = typer.Argument(..., help="The recipe YAML file."),
    overrides: list[str] | None = typer.Argument(None, help="KEY=VALUE overrides, e.g. sim.rollout_gpus=512."),
    save: bool = typer.Option(True, "--save/--no-save", help="Write a run directory (launcher: simulate)."),
    calibrate_from: str | None = typer.Option(None, "--calibrate", help="Fit the cost model to this measured run first."),
    compare: str | None = typer.Option(None, "--compare", help="Print predicted vs measured step time for this run."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where --calibrate/--compare runs are."),
) -> None:
    """Simulate a run at cluster scale: the real scheduler, simulated engines, virtual time."""
    import json
    import statistics

    from rlctl.recipe import load_recipe, recipe_to_yaml
    from rlctl.rundir import RunState, create_run_dir, find_run, write_atomic

    fitted: list[str] = []
    if calibrate_from:
        from rlctl.sim.calibrate import calibrate

        measured = find_run(calibrate_from, runs_dir)
        info = measured.read()
        procs = info.get("processes", {})
        base = load_recipe(measured.recipe_path, check_paths=False)
        knobs = calibrate(measured.events(), info["model_path"],
                          servers=sum(r.startswith("rollout-") for r in procs),
                          trainer_ranks=sum(r.startswith("trainer-") for r in procs),
                          long_tail=base.rollout.sampling.long_tail.enabled)
        fitted = [f"{k}={v}" for k, v in knobs.items()]
        print(f"calibrated on {measured.id}: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                        for k, v in knobs.items()))
    r = load_recipe(recipe, [*fitted, *(overrides or [])], check_paths=False)
    events, metrics, wall = simulate_run(r)
    sim = r.sim
    samples = r.rollout.batch_size * r.rollout.group_size
    print(f"simulated {r.run.steps} steps of {r.pipeline.mode} ({r.pipeline.admission} admission): "
          f"{sim.params_b:g}B on {sim.rollout_gpus} rollout + {sim.trainer_gpus} trainer {sim.gpu} GPUs, "
          f"{samples} samples per step, in {wall:.2f} s of wall time")
    print(render_metrics(metrics))
    if compare:
        other = find_run(compare, runs_dir).metrics()
        steady = other[1:] or other
        predicted = statistics.median(m["step_time"] for m in (metrics[1:] or metrics))
        measured_s = statistics.median(m["step_time"] for m in steady)
        print(f"median step time: predicted {predicted:.3f} s, measured {measured_s:.3f} s "
              f"({predicted / measured_s - 1:+.1%}) for {compare}")
    if not save:
        return
    info = {"launcher": "simulate", "mode": r.pipeline.mode, "steps_total": r.run.steps,
            "recipe_file": str(recipe), "overrides": list(overrides or []), "plan": None, "model_path": None,
            "simulation": {"wall_seconds": wall, "virtual_seconds": events[-1]["t"] if events else 0.0}}
    rd = create_run_dir(Path(r.run.output_dir), r.run.name, recipe_to_yaml(r), info)
    write_atomic(rd.events_path, "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
    write_atomic(rd.metrics_path, "".join(json.dumps(m, separators=(",", ":")) + "\n" for m in metrics))
    rd.set_state(RunState.COMPLETED, "simulation done")
    print(rd.id)
