"""Side by side: runs on a shared pool, against each run alone (dedicated, one after the other) and
all of them started together on the same devices with no pool (naive co-location).

    python scripts/bench_pool.py --sim             # 8 jobs on 64 simulated H200s (recipes/pool/sim-64gpu.yaml)
    python scripts/bench_pool.py --cpu             # 3 quickstart runs (sync, rolloutpipe, async) on this CPU
    python scripts/bench_pool.py --cpu --steps 150 --seeds 3 rollout.servers=1 \
        --placement 'train.cpus=[0]' 'rollout.cpus=[1]'   # disaggregated: trainer and server on their own core
    python scripts/bench_pool.py --share-check --steps 150 rollout.servers=1   # two like runs, shares 1 and 2
    python scripts/bench_pool.py --gpu dedicated|naive|pool|table   # two GPU-bench runs on one GPU (gpu_bench)

CPU: the devices are this machine's cores (2 here: the pool makes each core a device). A run's
device-seconds are its wall time x the devices it holds: dedicated, both cores for its whole run;
naive co-location and the pool, both cores until the last run ends (the pool also reports what
each run used: its slices and model moves). --placement says where a run's processes go alone
and under naive co-location (in the pool, the pool places them). Rewards are the mean of the
last 20 steps (FINAL_STEPS: one step's reward is a mean over 256 samples, and runs of one seed
differ by more than a few steps' mean shows); the spread of each dedicated run is taken over
--seeds seeds. One job runs with
share 2 in the pool; --share-check runs two identical runs with shares 1 and 2.
Each part writes its figures: results/bench_pool-sim.json (another --pool-file: bench_pool-sim-FILE),
bench_pool-cpu.json, bench_pool-share.json, bench_pool-gpu.json (after each GPU phase).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from artifact import repo_path, slug, write_artifact

ROOT = Path(__file__).resolve().parent.parent
SIM_POOL = ROOT / "recipes" / "pool" / "sim-64gpu.yaml"
FINAL_STEPS = 20
"""A run's final reward: the mean over its last this many steps."""
JOBS = [("sync", "pipeline.mode=sync", 0, 1.0), ("pipe", "pipeline.mode=rolloutpipe", 1, 1.0),
        ("async", "pipeline.mode=async", 2, 2.0)]


def rlctl(*args: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "rlctl", *args], cwd=cwd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"rlctl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()[-600:]}")
    return out.stdout.strip()


def launch(recipe: str, overrides: list[str], cwd: Path) -> str:
    return rlctl("launch", recipe, *overrides, "--detach", cwd=cwd).splitlines()[-1]


def wait(run_ids: list[str], cwd: Path) -> dict[str, dict]:
    """Each run's run.json once all have ended, with `wall_s` from creation to end."""
    done: dict[str, dict] = {}
    while len(done) < len(run_ids):
        for rid in run_ids:
            info = json.loads((cwd / "runs" / rid / "run.json").read_text())
            if rid not in done and info["state"] in ("completed", "failed", "cancelled"):
                if info["state"] != "completed":
                    raise SystemExit(f"{rid} {info['state']}: {info.get('exit_reason')}")
                done[rid] = info
        time.sleep(0.5)
    return done


def wall_s(cwd: Path, rid: str) -> float:
    events = [json.loads(line) for line in (cwd / "runs" / rid / "events.jsonl").read_text().splitlines() if line]
    created = json.loads((cwd / "runs" / rid / "run.json").read_text())["created"]
    from datetime import datetime

    t0 = datetime.fromisoformat(created).timestamp()
    return max(e["t"] for e in events) - t0


def started_s(cwd: Path, rid: str) -> float:
    """From launch to the controller's run_start: starting the engines."""
    from datetime import datetime

    events = [json.loads(line) for line in (cwd / "runs" / rid / "events.jsonl").read_text().splitlines() if line]
    t0 = datetime.fromisoformat(json.loads((cwd / "runs" / rid / "run.json").read_text())["created"]).timestamp()
    return next(e["t"] for e in events if e["event"] == "run_start") - t0


def final_reward(cwd: Path, rid: str) -> float:
    metrics = [json.loads(line) for line in (cwd / "runs" / rid / "metrics.jsonl").read_text().splitlines() if line]
    return statistics.mean(m["reward_mean"] for m in metrics[-FINAL_STEPS:])


def cpu_bench(steps: int, seeds: int, recipe: str, extra: list[str], placement: list[str], keep: Path | None,
              pool: list[str], pool_only: bool) -> None:
    """pool_only: the dedicated and naive runs are the ones already in --keep (same steps and
    overrides): only the pool phase runs again (a pool setting tried against the same baselines)."""
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="rlctl-bench-pool-") as tmp:
        cwd = keep or Path(tmp)
        cwd.mkdir(parents=True, exist_ok=True)
        common = [f"run.steps={steps}", *extra]
        if not pool_only:
            baselines(recipe, common, placement, seeds, cwd)
        rows, naive_makespan = baseline_rows(cwd, seeds)
        ids, infos, pool_makespan = pool_phase(recipe, common, cores, cwd, "pool", JOBS, pool)
        for name, rid in ids.items():
            usage = infos[rid]["pool"]["usage"]
            rows[name].update(pool_s=wall_s(cwd, rid), pool_reward=final_reward(cwd, rid), pool_start=started_s(cwd, rid),
                              used=usage["used_device_s"], moved=usage["moved_device_s"], share=usage["share"])
        totals = print_cpu(rows, cores, naive_makespan, pool_makespan)
    write_artifact("bench_pool-cpu", {"recipe": repo_path(recipe), "steps": steps, "seeds": seeds, "overrides": extra,
                                      "placement": placement, "pool_overrides": pool, "cores": cores, "jobs": rows, **totals})


def baselines(recipe: str, common: list[str], placement: list[str], seeds: int, cwd: Path) -> None:
    """Each job alone, one after the other, over `seeds` seeds (dedicated); then the three started
    together with no pool (naive co-location). Their runs are named ded-JOB-K and naive-JOB."""
    start = time.monotonic()
    for name, mode, seed, _ in JOBS:
        for k in range(seeds):
            rid = launch(recipe, [*common, *placement, mode, f"run.seed={seed + 10 * k}", f"run.name=ded-{name}-{k}"], cwd)
            wait([rid], cwd)
    print(f"dedicated runs done in {time.monotonic() - start:.0f} s", flush=True)
    ids = [launch(recipe, [*common, *placement, mode, f"run.seed={seed}", f"run.name=naive-{name}"], cwd)
           for name, mode, seed, _ in JOBS]
    wait(ids, cwd)


def baseline_rows(cwd: Path, seeds: int) -> tuple[dict[str, dict], float]:
    """The baselines' numbers, read back from their run directories in cwd, and naive
    co-location's makespan (from the first naive run's creation to the last one's end)."""
    from datetime import datetime

    def run(prefix: str) -> str:
        found = sorted(p.name for p in (cwd / "runs").glob(f"{prefix}-2*"))
        if not found:
            raise SystemExit(f"no run {prefix} in {cwd}/runs: run the baselines first (without --pool-only)")
        return found[-1]

    rows: dict[str, dict] = {}
    for name, *_ in JOBS:
        first = run(f"ded-{name}-0")
        rows[name] = {"dedicated_s": wall_s(cwd, first), "dedicated_start": started_s(cwd, first),
                      "dedicated_reward": [final_reward(cwd, run(f"ded-{name}-{k}")) for k in range(seeds)]}
    naive = {name: run(f"naive-{name}") for name, *_ in JOBS}
    created = {n: datetime.fromisoformat(json.loads((cwd / "runs" / r / "run.json").read_text())["created"]).timestamp()
               for n, r in naive.items()}
    for name, rid in naive.items():
        rows[name].update(naive_s=wall_s(cwd, rid), naive_reward=final_reward(cwd, rid), naive_start=started_s(cwd, rid))
    makespan = max(created[n] + rows[n]["naive_s"] for n in naive) - min(created.values())
    return rows, makespan


def pool_phase(recipe: str, common: list[str], cores: int, cwd: Path, tag: str, jobs: list[tuple[str, str, int, float]],
               pool: list[str]):
    """The jobs (name, mode, seed, share) on a pool of this machine's cores (one device each,
    unless `pool` overrides say otherwise); their run ids, run.json and the makespan."""
    rlctl("pool", "up", str(ROOT / "recipes" / "pool" / "cpu.yaml"), f"pool.devices.count={cores}", *pool, cwd=cwd)
    try:
        t = time.monotonic()
        ids = {name: launch(recipe, [*common, mode, f"run.seed={seed}", f"run.name={tag}-{name}", "launcher=pool",
                                     "pool.name=cpu", f"pool.share={share}"], cwd)
               for name, mode, seed, share in jobs}
        infos = wait(list(ids.values()), cwd)
        return ids, infos, time.monotonic() - t
    finally:
        rlctl("pool", "down", "cpu", cwd=cwd)


def share_bench(steps: int, recipe: str, extra: list[str], keep: Path | None) -> None:
    """Two identical sync runs (same seed) on a pool of one device (all the cores), one with
    share 2: each one's wall time, its device time, and that per second of its time attached to
    the pool. One device, so that their calls wait for each other and the pool decides who runs."""
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="rlctl-bench-share-") as tmp:
        cwd = keep or Path(tmp)
        cwd.mkdir(parents=True, exist_ok=True)
        jobs = [("share1", "pipeline.mode=sync", 0, 1.0), ("share2", "pipeline.mode=sync", 0, 2.0)]
        ids, infos, makespan = pool_phase(recipe, [f"run.steps={steps}", *extra], cores, cwd, "share", jobs,
                                          ["pool.devices.count=1", f"pool.devices.cpus_per_device={cores}"])
        print(f"{'job':<8}{'share':>6}{'wall s':>8}{'used dev-s':>11}{'dev-s per s':>12}{'steps/s':>9}")
        jobs_out = {}
        for name, rid in ids.items():
            usage, wall = infos[rid]["pool"]["usage"], wall_s(cwd, rid)
            jobs_out[name] = {"share": usage["share"], "wall_s": wall, "used_device_s": usage["used_device_s"],
                              "attached_s": usage["wall_s"], "steps_per_s": steps / wall}
            print(f"{name:<8}{usage['share']:>6g}{wall:>8.1f}{usage['used_device_s']:>11.1f}"
                  f"{usage['used_device_s'] / usage['wall_s']:>12.2f}{steps / wall:>9.2f}")
        print(f"makespan {makespan:.1f} s")
        split = contended_split(cwd / "pools" / "cpu" / "events.jsonl")
        print("the device while both ran (from both started to the first detached): "
              + ", ".join(f"{name} {split[rid]:.0%}" for name, rid in ids.items()))
    write_artifact("bench_pool-share", {"recipe": repo_path(recipe), "steps": steps, "overrides": extra, "cores": cores, "jobs": jobs_out,
                                        "makespan_s": makespan, "contended_split": {n: split[rid] for n, rid in ids.items()}})


def contended_split(events_path: Path) -> dict[str, float]:
    """Each job's part of the device time the pool gave out while every job was attached and
    started (from the end of the last job's first slice, its start, to the first detach)."""
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line]
    slices = [e for e in events if e["event"] == "slice"]
    jobs = {e["job"] for e in slices}
    lo = max(min(e["t"] for e in slices if e["job"] == j) for j in jobs)
    hi = min(e["t"] for e in events if e["event"] == "job_detached")
    got = {j: sum(max(0.0, min(e["t"], hi) - max(e["start"], lo)) for e in slices if e["job"] == j) for j in jobs}
    return {j: v / sum(got.values()) for j, v in got.items()}


def print_cpu(rows: dict[str, dict], cores: int, naive_makespan: float, pool_makespan: float) -> dict:
    """The table; returns its totals (device-seconds of each way, per share)."""
    print(f"{'job':<7}{'share':>6}{'alone s':>9}{'naive s':>9}{'pool s':>8}{'used dev-s':>11}"
          f"{'reward alone (seeds)':>26}{'naive':>7}{'pool':>7}")
    for name, r in rows.items():
        spread = r["dedicated_reward"]
        print(f"{name:<7}{r['share']:>6g}{r['dedicated_s']:>9.1f}{r['naive_s']:>9.1f}{r['pool_s']:>8.1f}{r['used']:>11.1f}"
              f"{min(spread):>12.3f}..{max(spread):.3f} ({len(spread)}){r['naive_reward']:>8.3f}{r['pool_reward']:>7.3f}")
    dedicated = sum(r["dedicated_s"] for r in rows.values()) * cores
    naive, pooled = naive_makespan * cores, pool_makespan * cores
    used = sum(r["used"] for r in rows.values())
    print(f"device-seconds ({cores} devices): dedicated {dedicated:.0f}, naive co-location {naive:.0f} "
          f"({naive / dedicated:.2f}x), pool {pooled:.0f} ({pooled / dedicated:.2f}x; {1 - pooled / dedicated:.0%} "
          f"below dedicated), used in the pool {used:.0f}")
    print("of which starting the engines (s): " + ", ".join(
        f"{n} alone {r['dedicated_start']:.1f} naive {r['naive_start']:.1f} pool {r['pool_start']:.1f}"
        for n, r in rows.items()))
    per_share = {n: r["used"] / r["pool_s"] / r["share"] for n, r in rows.items()}
    print("device time per second of wall, per unit of share, in the pool: "
          + ", ".join(f"{n} {v:.2f}" for n, v in per_share.items()))
    return {"naive_makespan_s": naive_makespan, "pool_makespan_s": pool_makespan, "dedicated_device_s": dedicated,
            "naive_device_s": naive, "pool_device_s": pooled, "used_in_pool_device_s": used,
            "device_s_per_s_per_share": per_share}


class GpuMemory:
    """The GPU's used memory (nvidia-smi), polled in a thread: the peak since the last reset."""

    def __init__(self) -> None:
        import threading

        self.peak = 0.0
        self.stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def used(self) -> float:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10)
        return float(out.stdout.split()[0]) * 2**20

    def _poll(self) -> None:
        while not self.stop.wait(0.5):
            self.peak = max(self.peak, self.used())


BALLAST = """import sys, time, torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda:0")
print("ballast", x.numel(), flush=True)
time.sleep(3600)
"""


def gpu_bench(phase: str, steps: int, work: Path) -> dict:
    """One GPU, two GPU-bench runs (seeds 0 and 1). dedicated: each alone, its peak memory noted;
    naive/pool: a ballast fills the GPU down to 1.5x the larger peak (less than both runs need
    together), then both runs start together with no pool, or on a pool capped at that."""
    import torch

    work.mkdir(parents=True, exist_ok=True)
    results = json.loads((work / "gpu.json").read_text()) if (work / "gpu.json").exists() else {}
    recipe = str(ROOT / "recipes" / "bench-longtail-gpu.yaml")
    runs = [("a", 0), ("b", 1)]
    mem = GpuMemory()
    from rlctl.models.tiny import ensure_tiny_model
    from rlctl.recipe import load_recipe

    r = load_recipe(recipe)
    ensure_tiny_model(r.model.init, r.data.task)  # built once, before any run is timed
    if phase == "dedicated":
        for name, seed in runs:
            mem.peak = mem.used()
            base = mem.peak
            rid = launch(recipe, [f"run.steps={steps}", f"run.seed={seed}", f"run.name=ded-{name}"], work)
            wait([rid], work)
            results[f"ded-{name}"] = {"wall_s": wall_s(work, rid), "peak_bytes": mem.peak - base,
                                      "reward": final_reward(work, rid)}
    else:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = 1.5 * max(results["ded-a"]["peak_bytes"], results["ded-b"]["peak_bytes"])
        ballast = subprocess.Popen([sys.executable, "-c", BALLAST, str(int(total - cap - mem.used()))])
        time.sleep(15)
        try:
            # A dedicated run's peak, split as the runs' processes hold it (about 2:1 trainer to
            # server for this recipe), is what each run tells the pool it needs.
            peak = max(results["ded-a"]["peak_bytes"], results["ded-b"]["peak_bytes"]) / 1e9
            extra = ["launcher=pool", "pool.name=gpu", f"pool.trainer_memory_gb={0.65 * peak:.1f}",
                     f"pool.rollout_memory_gb={0.45 * peak:.1f}"] if phase == "pool" else []
            if phase == "pool":
                rlctl("pool", "up", str(ROOT / "recipes" / "pool" / "gpu.yaml"), f"pool.devices.memory_gb={cap / 1e9 - 3:.1f}",
                      cwd=work)
            t = time.monotonic()
            ids = {name: launch(recipe, [f"run.steps={steps}", f"run.seed={seed}", f"run.name={phase}-{name}", *extra], work)
                   for name, seed in runs}
            ended = {}
            while len(ended) < len(ids):
                for name, rid in ids.items():
                    info = json.loads((work / "runs" / rid / "run.json").read_text())
                    if info["state"] in ("completed", "failed", "cancelled"):
                        ended[name] = info
                time.sleep(1)
            results[phase] = {"makespan_s": time.monotonic() - t, "cap_bytes": cap,
                              "runs": {n: {"state": i["state"], "reason": i.get("exit_reason"),
                                           "usage": (i.get("pool") or {}).get("usage"),
                                           "reward": final_reward(work, ids[n]) if i["state"] == "completed" else None}
                                       for n, i in ended.items()}}
        finally:
            if phase == "pool":
                subprocess.run([sys.executable, "-m", "rlctl", "pool", "down", "gpu"], cwd=work, timeout=120)
            ballast.kill()
    mem.stop.set()
    (work / "gpu.json").write_text(json.dumps(results, indent=1))
    return results


def gpu_table(work: Path) -> None:
    """The one-GPU phases side by side (gpu.json): GPU-seconds on one GPU, each run's wall time."""
    r = json.loads((work / "gpu.json").read_text())
    alone = {n: r[f"ded-{n}"]["wall_s"] for n in ("a", "b")}
    print(f"{'':<10}{'GPU-s':>8}{'vs dedicated':>14}  {'run a (s)':>12}{'run b (s)':>12}  notes")
    print(f"{'dedicated':<10}{sum(alone.values()):>8.1f}{1:>14.2f}  {alone['a']:>12.1f}{alone['b']:>12.1f}  "
          f"peaks {r['ded-a']['peak_bytes'] / 1e9:.1f} and {r['ded-b']['peak_bytes'] / 1e9:.1f} GB")
    for phase in ("naive", "pool"):
        if phase not in r:
            continue
        p, runs = r[phase], r[phase]["runs"]
        ok = all(x["state"] == "completed" for x in runs.values())
        walls = {n: (x["usage"] or {}).get("wall_s") if x["state"] == "completed" else None for n, x in runs.items()}
        moved = sum((x["usage"] or {}).get("moved_device_s", 0.0) for x in runs.values())
        cols = "".join(f"{walls[n]:>12.1f}" if walls.get(n) else f"{runs[n]['state']:>12}" for n in ("a", "b"))
        note = f"cap {p['cap_bytes'] / 1e9:.0f} GB; " + (f"moves {moved:.1f} GPU-s" if ok else str(runs["a"]["reason"])[:60])
        gpu_s = f"{p['makespan_s']:>8.1f}{p['makespan_s'] / sum(alone.values()):>14.2f}" if ok else f"{'-':>8}{'-':>14}"
        print(f"{phase:<10}{gpu_s}  {cols}  {note}")


def sim_bench(pool_file: Path) -> None:
    from rlctl.commands.simulate import render_pool
    from rlctl.recipe.load import load_pool_file
    from rlctl.sim.pool import simulate_pool

    t = time.perf_counter()
    result = simulate_pool(load_pool_file(pool_file))
    print(render_pool(result))
    wall = time.perf_counter() - t
    print(f"(simulated in {wall:.1f} s of wall time)")
    jobs = [{**vars(j), "slowdown": j.slowdown, "dedicated_gpu_s": j.dedicated_gpu_s} for j in result.jobs]
    name = "bench_pool-sim" + ("" if pool_file.resolve() == SIM_POOL else "-" + slug(pool_file.stem))
    write_artifact(name, {"pool_file": repo_path(pool_file), **{k: v for k, v in vars(result).items() if k != "events"},
                          "jobs": jobs, "dedicated_gpu_s": result.dedicated_gpu_s, "wall_s": wall})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim", action="store_true")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--pool-file", type=Path, default=SIM_POOL)
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "quickstart.yaml"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--keep", type=Path, help="Keep the runs and the pool in this directory.")
    p.add_argument("--share-check", action="store_true",
                   help="Two identical sync runs on the CPU pool, shares 1 and 2: what the larger share buys.")
    p.add_argument("--gpu", choices=["dedicated", "naive", "pool", "table"],
                   help="One phase of the one-GPU bench, or the table of those in --gpu-dir.")
    p.add_argument("--gpu-dir", type=Path, default=Path("/tmp/rlctl-gpu-pool-bench"))
    p.add_argument("--placement", nargs="*", default=[], metavar="KEY=VALUE",
                   help="Where a run's processes go when it runs alone and under naive co-location (--cpu), "
                        "e.g. train.cpus=[0] rollout.cpus=[1]; in the pool, the pool places them.")
    p.add_argument("--pool", nargs="*", default=[], metavar="KEY=VALUE",
                   help="Overrides of recipes/pool/cpu.yaml for the pool phase (--cpu), e.g. pool.quantum_s=1")
    p.add_argument("--pool-only", action="store_true",
                   help="--cpu: run only the pool phase, against the baselines already in --keep")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE for every run (--cpu)")
    args = p.parse_args()
    if args.sim:
        sim_bench(args.pool_file)
    if args.cpu:
        if args.pool_only and not args.keep:
            p.error("--pool-only needs --keep DIR, the directory of an earlier --cpu run")
        cpu_bench(args.steps, args.seeds, args.recipe, args.overrides, args.placement, args.keep, args.pool, args.pool_only)
    if args.share_check:
        share_bench(args.steps, args.recipe, args.overrides, args.keep)
    if args.gpu == "table":
        gpu_table(args.gpu_dir)
    elif args.gpu:
        phases = gpu_bench(args.gpu, args.steps, args.gpu_dir)
        print(json.dumps(phases, indent=1))
        write_artifact("bench_pool-gpu", {"steps": args.steps, "last_phase": args.gpu, "phases": phases})


if __name__ == "__main__":
    main()
