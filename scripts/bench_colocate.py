"""Colocated (the servers and the trainer take turns on the devices, colocate.enabled) against the
same recipe with its processes side by side on the same devices at once, and with --pool against
the run as the only job of a shared pool of one device (the pool moves its models' memory as it
schedules them: docs/pool.md), over several seeds.

    python scripts/bench_colocate.py [--recipe recipes/quickstart.yaml] [--seeds 0,1,2] [--pool] [KEY=VALUE ...]
    python scripts/bench_colocate.py --recipe recipes/bench-longtail-gpu.yaml --seeds 0 --pool   # one GPU

Per variant and seed: the wall time of `rlctl launch`, the mean step, rollout, train and sync
seconds (metrics.jsonl), the seconds the trainer's own send of a sync took (sync_end), the
seconds a step spends taking turns (the colocate_turn events: releasing and resuming memory) and
in each part of them (their phases), trainer rank 0's peak GPU memory in its train calls
(metrics' peak_gib, the figure rlctl plan's trainer bytes are checked against), device-seconds
per 1k samples (wall x devices / samples: the CPU is one device, a GPU run one GPU), the peak
device memory where there is a GPU (nvidia-smi, polled every 0.2 s), and the reward: mean of the
first 5 and the last 20 steps. Learning is the same when each variant's mean final reward lies
within the other's spread over the seeds. Prints the table with colocated / side-by-side ratios
(on a GPU also rlctl plan's memory model beside the measured trainer peak) and writes
results/bench_colocate-cpu.json (or -gpu-torch, -gpu-megatron).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from artifact import slug, write_artifact

REPO = Path(__file__).resolve().parents[1]
FINAL_STEPS = 20
VARIANTS = {"side by side": [], "colocated": ["colocate.enabled=true"]}


class PeakMemory:
    """The most GPU memory nvidia-smi reports in use while the block runs (MiB), or None without one."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
                used = max(int(v) for v in out.split())
            except (OSError, ValueError, subprocess.TimeoutExpired):
                continue
            self.peak = max(self.peak or 0, used)

    def __enter__(self) -> PeakMemory:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.fmean(values) if values else float("nan")


def launch(recipe: Path, out: Path, seed: int, overrides: list[str]) -> dict:
    start = time.monotonic()
    with PeakMemory() as memory:
        res = subprocess.run([sys.executable, "-m", "rlctl", "launch", str(recipe), f"run.seed={seed}",
                              f"run.output_dir={out}", *overrides], capture_output=True, text=True, cwd=out.parent)
    wall = time.monotonic() - start
    if res.returncode != 0:  # recorded, not fatal: side by side may not fit a GPU that colocated fits
        reason = res.stderr.strip().splitlines()[-1:] or ["?"]
        print(f"seed {seed} {overrides}: rlctl launch failed ({res.returncode}): {res.stderr.strip()[-800:]}")
        return {"seed": seed, "state": "failed", "reason": reason[0][:400], "wall_s": round(wall, 2), "peak_mib": memory.peak}
    run = out / res.stdout.strip().splitlines()[-1]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    run_info = json.loads((run / "run.json").read_text())
    turns = [e for e in events if e["event"] == "colocate_turn"]
    steps = max(1, len(metrics))
    phases: dict[str, float] = {}
    for e in turns:
        for part, seconds in (e.get("phases") or {}).items():
            key = f"{e['to']}:{part}"
            phases[key] = phases.get(key, 0.0) + seconds / steps
    prompts = [e["prompt_tokens"] for e in events if e["event"] == "group_completed" and "prompt_tokens" in e]
    sends = [e["seconds"] for e in events if e["event"] == "sync_end" and isinstance(e.get("seconds"), int | float)]
    rewards = [m["reward_mean"] for m in metrics]
    samples = sum(m.get("samples", 0) for m in metrics)
    return {"seed": seed, "state": run_info["state"], "wall_s": round(wall, 2), "steps": len(metrics),
            "samples": samples, "step_s": round(mean(metrics, "step_time"), 4),
            "rollout_s": round(mean(metrics, "rollout_time"), 4), "train_s": round(mean(metrics, "train_time"), 4),
            "sync_s": round(mean(metrics, "sync_time"), 4),
            "prompt_tokens": round(statistics.fmean(prompts), 1) if prompts else None,
            "send_s": round(statistics.fmean(sends), 4) if sends else None,
            "turn_s_per_step": round(sum(e["seconds"] for e in turns) / steps, 4),
            "turn_phases_s_per_step": {k: round(v, 4) for k, v in sorted(phases.items())},
            "turns": [f"{e['to']} {e['seconds']:.3f}" for e in turns],  # the first ones pin their host memory
            "trainer_peak_gib": round(mean(metrics, "peak_gib"), 3) if any("peak_gib" in m for m in metrics) else None,
            "device_s_per_1k": round(wall / max(1, samples) * 1000, 3),
            "peak_mib": memory.peak,
            "reward_first": round(statistics.fmean(rewards[:5]), 4),
            "reward_final": round(statistics.fmean(rewards[-FINAL_STEPS:]), 4), "rewards": [round(r, 4) for r in rewards]}


def planned(recipe: Path, overrides: list[str], prompt_tokens: float | None) -> dict:
    """What `rlctl plan`'s memory model gives this recipe colocated on one GPU (GiB per GPU): the
    trainer's parts and the server's, to set beside the measured peaks; priced at the runs' mean
    prompt length (sim.prompt_tokens, which the planner otherwise takes from the recipe)."""
    from rlctl.costs.memory import GIB
    from rlctl.costs.recipe import cost_model
    from rlctl.planner.estimate import estimate
    from rlctl.planner.placement import Placement
    from rlctl.recipe import PipelineMode, load_recipe

    prompt = [f"sim.prompt_tokens={max(1, round(prompt_tokens))}"] if prompt_tokens else []
    r = load_recipe(recipe, [*overrides, "colocate.enabled=true", *prompt], check_paths=False)
    e = estimate(r, cost_model(r), Placement(PipelineMode.SYNC, 1, 1, 1, micro_batch_tokens=r.train.micro_batch_tokens,
                                             colocated=True))
    return {"prompt_tokens": r.sim.prompt_tokens, "trainer_gib": round(e.trainer.total / GIB, 2),
            "server_gib": round(e.server.total / GIB, 2),
            "trainer_parts_gib": {k: round(v / GIB, 2) for k, v in e.trainer.parts.items() if v},
            "server_parts_gib": {k: round(v / GIB, 2) for k, v in e.server.parts.items() if v}}


def pool_of_one_device(on_gpu: bool, cwd: Path) -> tuple[str, list[str]]:
    """Bring up a pool of one device (the GPU, or all of this machine's cores as one device);
    its name and the keys that put a run on it."""
    import os

    if on_gpu:
        up = [str(REPO / "recipes" / "pool" / "gpu.yaml")]
    else:
        up = [str(REPO / "recipes" / "pool" / "cpu.yaml"), "pool.devices.count=1",
              f"pool.devices.cpus_per_device={len(os.sched_getaffinity(0))}"]
    name = "gpu" if on_gpu else "cpu"
    subprocess.run([sys.executable, "-m", "rlctl", "pool", "up", *up], cwd=cwd, check=True, capture_output=True,
                   timeout=600)
    return name, ["launcher=pool", f"pool.name={name}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "quickstart.yaml")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--pool", action="store_true", help="also run it as the one job of a pool of one device")
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every variant")
    args = ap.parse_args()
    args.recipe = args.recipe.resolve()  # the runs start in a temporary folder
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict]] = {}
    variants = dict(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="bench-colocate-") as tmp:
        pool = None
        if args.pool:
            from rlctl.recipe import Device, load_recipe

            on_gpu = load_recipe(args.recipe, args.overrides, check_paths=False).train.device is Device.CUDA
            pool, keys = pool_of_one_device(on_gpu, Path(tmp))
            variants["pool, one job"] = keys
        try:
            for seed in seeds:  # the variants of a seed one after the other: the machine's drift hits each
                for name, keys in variants.items():
                    run = launch(args.recipe, Path(tmp) / slug(name), seed, [*args.overrides, *keys])
                    results.setdefault(name, []).append(run)
                    if run["state"] == "completed":
                        print(f"{name:>14} seed {seed}: {run['wall_s']:.1f} s, step {run['step_s']:.3f} s, reward "
                              f"{run['reward_first']:.3f} -> {run['reward_final']:.3f}", flush=True)
        finally:
            if pool:
                subprocess.run([sys.executable, "-m", "rlctl", "pool", "down", pool], cwd=tmp, timeout=120)
    summary = summarize(results, len(seeds))
    kind, plan = "cpu", None
    if any(r["peak_mib"] for runs in results.values() for r in runs):  # one file per trainer on a GPU
        from rlctl.recipe import load_recipe

        kind = f"gpu-{load_recipe(args.recipe, args.overrides, check_paths=False).train.engine}"
        plan = planned(args.recipe, args.overrides, summary["table"]["colocated"]["prompt_tokens"])
        measured = summary["table"]["colocated"]["trainer_peak_gib"]
        print(f"rlctl plan's memory model, colocated: trainer {plan['trainer_gib']} GiB {plan['trainer_parts_gib']}, "
              f"server {plan['server_gib']} GiB {plan['server_parts_gib']}; measured trainer peak {measured:.2f} GiB")
    write_artifact(f"bench_colocate-{kind}", {"recipe": str(args.recipe.resolve().relative_to(REPO)),
                                              "overrides": args.overrides, "seeds": seeds, **summary,
                                              "plan": plan, "runs": results})


def summarize(results: dict[str, list[dict]], n_seeds: int) -> dict:
    """Print the table (means over the seeds), the ratios, each variant's turn phases and
    whether learning is the same; return the figures."""
    cols = ["prompt_tokens", "wall_s", "step_s", "rollout_s", "train_s", "sync_s", "send_s", "turn_s_per_step",
            "device_s_per_1k", "peak_mib", "trainer_peak_gib", "reward_first", "reward_final"]
    table = {name: {c: mean(runs, c) for c in cols} for name, runs in results.items()}
    side, colo = table["side by side"], table["colocated"]
    print(f"\n{'':>14}" + "".join(f"{c:>16}" for c in cols))
    for name, row in table.items():
        print(f"{name:>14}" + "".join(f"{row[c]:16.4f}" for c in cols))
    ratio = {c: (colo[c] / side[c] if side[c] else float("nan")) for c in cols}
    print(f"{'colo / side':>14}" + "".join(f"{ratio[c]:16.3f}" for c in cols))
    if "pool, one job" in table:
        pooled = table["pool, one job"]
        print(f"{'colo / pool':>14}" + "".join(f"{(colo[c] / pooled[c] if pooled[c] else float('nan')):16.3f}"
                                               for c in cols))
    for name, runs in results.items():
        phases = {k for r in runs for k in r.get("turn_phases_s_per_step") or {}}
        if phases:
            print(f"{name}: seconds per step in each part of the turns: " + ", ".join(
                f"{k} {mean([r['turn_phases_s_per_step'] for r in runs], k):.3f}" for k in sorted(phases)))
    spread = {name: (min(finals), max(finals)) if (finals := [r["reward_final"] for r in runs if "reward_final" in r])
              else (float("nan"), float("nan")) for name, runs in results.items()}
    same = (spread["side by side"][0] <= colo["reward_final"] <= spread["side by side"][1]
            or spread["colocated"][0] <= side["reward_final"] <= spread["colocated"][1])
    print(f"\nfinal reward (mean of the last {FINAL_STEPS} steps): side by side {side['reward_final']:.3f} "
          f"[{spread['side by side'][0]:.3f}, {spread['side by side'][1]:.3f}], colocated {colo['reward_final']:.3f} "
          f"[{spread['colocated'][0]:.3f}, {spread['colocated'][1]:.3f}]: "
          f"{'within' if same else 'OUTSIDE'} each other's spread over {n_seeds} seeds")
    return {"table": table, "ratio": ratio, "final_spread": spread, "same_learning": same}


if __name__ == "__main__":
    main()
