"""Does the controller's recording stay flat over a long run? A simulated run (virtual time) of
`--steps` steps of 4096 samples each (recipes/sim-1024gpu.yaml, 512 prompts x 8, 64 rollout and
64 trainer GPUs) goes through the controller's own Recorder: every event streamed to a real
events.jsonl in a temporary run directory, each step's metrics computed as the events come and
appended to metrics.jsonl.

    python scripts/bench_controller.py [--steps 1000] [--window 100] [--old-steps 200] [KEY=VALUE ...]

Prints CPU seconds per step (time.process_time) and memory (VmRSS; tracemalloc's traced size
with --tracemalloc, which slows the run down several times) over the first and the last
`--window` steps, with their ratios: the target is within 10% (flat). `--old-steps N` also runs
N steps the old way, every event kept in memory and each step's metrics recomputed from the
whole log, and prints how the cost of that recomputation grows. Writes
results/bench_controller.json.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from artifact import write_artifact

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.10
WORKLOAD = ["rollout.batch_size=512", "rollout.group_size=8", "train.groups_per_batch=64",
            "sim.rollout_gpus=64", "sim.trainer_gpus=64"]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Probe:
    """Samples CPU time and memory at each step's end."""

    def __init__(self, traced: bool) -> None:
        self.traced = traced
        self.cpu: list[float] = []
        self.rss: list[float] = []
        self.heap: list[float] = []
        self._last = time.process_time()

    def __call__(self, record: dict[str, Any]) -> None:
        now = time.process_time()
        self.cpu.append(now - self._last)
        self._last = now
        self.rss.append(rss_mib())
        if self.traced:
            self.heap.append(tracemalloc.get_traced_memory()[0] / 2**20)
        if len(self.cpu) % 100 == 0:
            print(f"  step {len(self.cpu)}: {self.cpu[-1]:.3f} CPU s, {self.rss[-1]:.0f} MiB", file=sys.stderr,
                  flush=True)


def row(label: str, values: list[float], window: int, fmt: str) -> tuple[str, dict[str, float]]:
    first, last = statistics.fmean(values[:window]), statistics.fmean(values[-window:])
    ratio = last / first if first else float("nan")
    return (f"{label:28} {fmt.format(first):>14} {fmt.format(last):>14} {ratio:8.3f}",
            {"first": first, "last": last, "ratio": ratio})


def run_new(recipe_overrides: list[str], steps: int, window: int, traced: bool) -> dict[str, Any]:
    """The Recorder over a simulated run of `steps` steps; its figures (`flat`: every ratio within TARGET)."""
    from rlctl.recipe import load_recipe
    from rlctl.run.dir import create_run_dir
    from rlctl.sim.run import simulate_run

    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(REPO / "recipes" / "sim-1024gpu.yaml", [*WORKLOAD, f"run.steps={steps}",
                                                                     *recipe_overrides], check_paths=False)
        rd = create_run_dir(Path(tmp), "bench-controller", "", {"launcher": "simulate"})
        probe = Probe(traced)
        if traced:
            tracemalloc.start()
        start = time.perf_counter()
        result = simulate_run(recipe, rd, on_step=probe)
        wall = time.perf_counter() - start
        size = rd.events_path.stat().st_size / 2**20
    samples = recipe.rollout.batch_size * recipe.rollout.group_size
    simulated = statistics.median(m["step_time"] for m in result.metrics)
    print(f"{steps} steps of {recipe.pipeline.mode}, {samples} samples per step; wall {wall:.0f} s; "
          f"events.jsonl {size:.0f} MiB; simulated step {simulated:.1f} s")
    print(f"{'':28} {f'first {window}':>14} {f'last {window}':>14} {'ratio':>8}")
    lines = {"cpu_s_per_step": row("CPU s per step", probe.cpu, window, "{:.4f}"),
             "vmrss_mib": row("VmRSS MiB", probe.rss, window, "{:.1f}")}
    if traced:
        lines["tracemalloc_mib"] = row("tracemalloc MiB", probe.heap, window, "{:.1f}")
    for text, _ in lines.values():
        print(text)
    flat = all(r["ratio"] <= TARGET for _, r in lines.values())
    print(f"flat (last/first <= {TARGET:.2f}): {'yes' if flat else 'NO'}")
    return {"mode": str(recipe.pipeline.mode), "samples_per_step": samples, "wall_s": wall, "events_mib": size,
            "simulated_step_s": simulated, **{k: r for k, (_, r) in lines.items()}, "flat": flat}


def run_old(recipe_overrides: list[str], steps: int) -> dict[str, Any]:
    """Every event in memory, each step's metrics from the whole log so far: what the controller
    used to do. Only a few steps' recomputations are timed, at the start and at the end, with the
    cyclic collector off (with every event in memory, its passes would cost more on top)."""
    from rlctl.metrics import step_metrics
    from rlctl.recipe import load_recipe
    from rlctl.sim.run import simulate_run

    recipe = load_recipe(REPO / "recipes" / "sim-1024gpu.yaml", [*WORKLOAD, f"run.steps={steps}", *recipe_overrides],
                         check_paths=False)
    before = rss_mib()
    events = simulate_run(recipe).events or []
    held = rss_mib() - before
    ends = [i for i, e in enumerate(events) if e["event"] == "step_end"]

    def recompute(step: int) -> float:
        t = time.process_time()
        step_metrics(events[: ends[step] + 1], step)
        return time.process_time() - t

    gc.disable()
    early = statistics.fmean(recompute(k) for k in range(5))
    late = statistics.fmean(recompute(k) for k in range(steps - 5, steps))
    gc.enable()
    print(f"old way, {steps} steps: metrics recomputed from the whole log cost {early:.4f} CPU s per step at "
          f"the start, {late:.4f} at step {steps} ({late / early:.0f}x, growing linearly: about "
          f"{late * 1000 / steps:.1f} s per step at step 1000); the {len(events)} events held "
          f"{held:.0f} MiB more VmRSS")
    return {"steps": steps, "recompute_cpu_s_first_5": early, "recompute_cpu_s_last_5": late, "events": len(events),
            "events_held_mib": held}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--window", type=int, default=100)
    p.add_argument("--old-steps", type=int, default=200, help="0: skip the old way")
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    sys.path.insert(0, str(REPO))
    window = min(a.window, max(1, a.steps // 2))
    new = run_new(a.overrides, a.steps, window, a.tracemalloc)
    old = run_old(a.overrides, a.old_steps) if a.old_steps >= 10 else None
    write_artifact("bench_controller", {"workload": WORKLOAD, "overrides": a.overrides, "steps": a.steps,
                                        "window": window, "target_ratio": TARGET, "recorder": new, "old_way": old})
    sys.exit(0 if new["flat"] else 1)


if __name__ == "__main__":
    main()
