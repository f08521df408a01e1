"""How fast `rlctl simulate` plans a cluster step: recipes/sim-1024gpu.yaml (512 rollout + 512
trainer H200s, 32768 samples per step, responses up to 16k tokens), in each pipeline mode.

    python scripts/bench_simulate.py [--steps 3] [KEY=VALUE ...]

Prints the wall time per simulated step next to the target (2 s) and the simulated step time;
writes results/bench_simulate-NGPU.json (N: the cluster's rollout + trainer GPUs, e.g. 1024gpu).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from artifact import write_artifact

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 2.0
MODES = [("sync", ["pipeline.mode=sync", "pipeline.admission=fifo"]),
         ("rolloutpipe-frontier", ["pipeline.mode=rolloutpipe", "pipeline.admission=frontier"]),
         ("async", ["pipeline.mode=async", "pipeline.admission=frontier"])]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    sys.path.insert(0, str(REPO))
    from rlctl.sim.run import simulate_run
    from rlctl.recipe import load_recipe

    print(f"{'mode':22} {'wall s/step':>12} {'target s':>9} {'ratio':>6} {'simulated step s':>17}")
    worst = 0.0
    modes = {}
    for name, extra in MODES:
        recipe = load_recipe(REPO / "recipes" / "sim-1024gpu.yaml", [f"run.steps={a.steps}", *a.overrides, *extra],
                             check_paths=False)
        result = simulate_run(recipe)
        metrics = result.metrics
        per_step = result.wall_seconds / a.steps
        worst = max(worst, per_step)
        simulated = sum(m["step_time"] for m in metrics) / len(metrics)
        modes[name] = {"wall_s_per_step": per_step, "simulated_step_s": simulated}
        print(f"{name:22} {per_step:12.2f} {TARGET_S:9.2f} {per_step / TARGET_S:6.2f} {simulated:17.1f}")
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
