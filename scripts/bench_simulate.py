"""How fast `rlctl simulate` plans a cluster step: recipes/sim-1024gpu.yaml (512 rollout + 512
trainer H200s, 32768 samples per step, responses up to 16k tokens), in each pipeline mode.

    python scripts/bench_simulate.py [--steps 3] [KEY=VALUE ...]

Prints the wall time per simulated step next to the target (2 s) and the simulated step time;
writes results/bench_simulate-NGPU.json (N: the cluster's rollout + trainer GPUs, e.g. 1024gpu).

Beside them it prints the floor of any simulation that drives every request as its own asyncio
task, as the scheduler does in a real run: the same number of samples, each a task that awaits
one timer on rlctl's virtual-time loop, gathered by group, and nothing else. A step can cost no
less than that on this machine; the ratio of a mode to the floor is what rlctl's own code adds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

from artifact import write_artifact

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 2.0
MODES = [("sync", ["pipeline.mode=sync", "pipeline.admission=fifo"]),
         ("rolloutpipe-frontier", ["pipeline.mode=rolloutpipe", "pipeline.admission=frontier"]),
         ("async", ["pipeline.mode=async", "pipeline.admission=frontier"])]


def asyncio_floor(samples: int, group_size: int) -> float:
    """Wall seconds for `samples` requests that do nothing but await a timer each, one task per
    request and one gather per group, on the virtual-time loop: the floor of a simulated step."""
    from rlctl.sim.loop import run_virtual

    rng = random.Random(0)

    async def request(loop: asyncio.AbstractEventLoop) -> int:
        done = loop.create_future()
        loop.call_at(loop.time() + rng.random(), done.set_result, 1)
        return await done

    async def group(loop: asyncio.AbstractEventLoop) -> list[int]:
        return await asyncio.gather(*(request(loop) for _ in range(group_size)))

    async def step() -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(group(loop) for _ in range(samples // group_size)))

    start = time.perf_counter()
    run_virtual(step())
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--floor", nargs=2, type=int, metavar=("SAMPLES", "GROUP_SIZE"),
                   help="print only the asyncio floor for this many samples, in seconds")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    sys.path.insert(0, str(REPO))
    if a.floor:
        print(asyncio_floor(*a.floor))
        return
    from rlctl.sim.run import simulate_run
    from rlctl.recipe import load_recipe

    print(f"{'mode':22} {'wall s/step':>12} {'target s':>9} {'ratio':>6} {'samples/step':>13} "
          f"{'floor s':>8} {'x floor':>8} {'simulated step s':>17}")
    worst = 0.0
    modes = {}
    floors: dict[int, float] = {}
    for name, extra in MODES:
        recipe = load_recipe(REPO / "recipes" / "sim-1024gpu.yaml", [f"run.steps={a.steps}", *a.overrides, *extra],
                             check_paths=False)
        result = simulate_run(recipe)
        metrics = result.metrics
        per_step = result.wall_seconds / a.steps
        worst = max(worst, per_step)
        simulated = sum(m["step_time"] for m in metrics) / len(metrics)
        # async's step is one train batch; sync and rolloutpipe generate the whole rollout batch.
        samples = round(sum(m["samples"] for m in metrics) / len(metrics))
        if samples not in floors:  # in a fresh process: this one's heap is full of the simulation's objects
            out = subprocess.run([sys.executable, __file__, "--floor", str(samples), str(recipe.rollout.group_size)],
                                 capture_output=True, text=True, check=True).stdout
            floors[samples] = float(out)
        floor = floors[samples]
        modes[name] = {"wall_s_per_step": per_step, "simulated_step_s": simulated, "samples_per_step": samples,
                       "asyncio_floor_s": floor, "ratio_to_floor": per_step / floor}
        print(f"{name:22} {per_step:12.2f} {TARGET_S:9.2f} {per_step / TARGET_S:6.2f} {samples:13d} "
              f"{floor:8.2f} {per_step / floor:8.2f} {simulated:17.1f}")
    print("all under target" if worst < TARGET_S else "TARGET MISSED")
    gpus = recipe.sim.rollout_gpus + recipe.sim.trainer_gpus
    write_artifact(f"bench_simulate-{gpus}gpu", {
        "recipe": "recipes/sim-1024gpu.yaml", "overrides": a.overrides, "steps": a.steps,
        "rollout_gpus": recipe.sim.rollout_gpus, "trainer_gpus": recipe.sim.trainer_gpus,
        "samples_per_step": recipe.rollout.batch_size * recipe.rollout.group_size,
        "max_new_tokens": recipe.rollout.sampling.max_new_tokens, "target_s": TARGET_S,
        "modes": modes, "worst_wall_s_per_step": worst, "under_target": worst < TARGET_S})
    sys.exit(0 if worst < TARGET_S else 1)


if __name__ == "__main__":
    main()
