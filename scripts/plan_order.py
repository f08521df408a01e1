"""Does `rlctl plan` order real placements the way they run? Three placements of a bench recipe are
launched for real, one after the other; the planner, calibrated on the first run only (`rlctl plan
--calibrate`), predicts each one's step, and the table shows predicted against measured median
step time (the first step left out) and whether the two orders agree.

    python scripts/plan_order.py [--runs-dir DIR] [--steps 4]

On CPU (this project's 2-core machine), recipes/bench-longtail.yaml with every core a device:
  1+1 rolloutpipe   one server on core 0, the trainer on core 1, rolloutpipe with frontier
                    admission: the calibration run (its streamed groups are trainer calls without
                    an optimizer step, so a call's fixed cost is told from a step's; a sync run
                    cannot tell them apart)
  1+1 sync          the same split, sync
  colocated sync    two servers and two trainer ranks, none pinned: rollout and training take
                    turns on both cores
scripts/gpu_plan_checks.py runs the same check on one GPU (check_order below).
Writes results/plan_order.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from artifact import write_artifact

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlctl.costs.recipe import cost_model  # noqa: E402
from rlctl.planner.estimate import Placement, estimate  # noqa: E402
from rlctl.recipe import PipelineMode, load_recipe  # noqa: E402


@dataclass
class Variant:
    name: str
    overrides: list[str]
    placement: Placement
    measured: float = 0.0
    predicted: float = 0.0
    stages: dict = field(default_factory=dict)


def cpu_variants() -> list[Variant]:
    split = ["rollout.servers=1", "rollout.cpus=[0]", "train.cpus=[1]"]
    return [
        Variant("1+1 rolloutpipe", [*split, "pipeline.mode=rolloutpipe", "pipeline.admission=frontier"],
                Placement(PipelineMode.ROLLOUTPIPE, 1, 1, 1)),
        Variant("1+1 sync", [*split, "pipeline.mode=sync"], Placement(PipelineMode.SYNC, 1, 1, 1)),
        Variant("colocated sync", ["rollout.servers=2", "train.ranks=2", "rollout.cpus=[]", "train.cpus=[]",
                                   "pipeline.mode=sync"], Placement(PipelineMode.SYNC, 2, 1, 2, colocated=True)),
    ]


def launch(recipe: Path, runs: Path, name: str, overrides: list[str]) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in name)
    before = set(runs.iterdir()) if runs.exists() else set()
    res = subprocess.run([sys.executable, "-m", "rlctl", "launch", str(recipe), *overrides, f"run.name={slug}",
                          f"run.output_dir={runs}"], capture_output=True, text=True, cwd=REPO, timeout=1800)
    made = (set(runs.iterdir()) if runs.exists() else set()) - before
    if res.returncode != 0 or not made:
        raise RuntimeError(f"{name}: the run failed: {(res.stderr.strip().splitlines() or [''])[-1]}")
    return made.pop()


def check_order(recipe: Path, variants: list[Variant], common: list[str], runs: Path) -> tuple[bool, list[str]]:
    """Launch each variant, calibrate on the first, predict all (each variant's `measured` and
    `predicted` filled in); whether the orders agree, and the calibrated overrides."""
    from rlctl.run.dir import RunDir
    from rlctl.sim.calibrate import calibrate_run

    fitted: list[str] = []
    for v in variants:
        start = time.monotonic()
        run = launch(recipe, runs, v.name, [*common, *v.overrides])
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        v.measured = statistics.median(m["step_time"] for m in metrics[1:])
        if not fitted:
            fitted = [f"{k}={val}" for k, val in calibrate_run(RunDir(run)).items()]
        r = load_recipe(recipe, [*common, *v.overrides, *fitted], check_paths=False)
        e = estimate(r, cost_model(r), v.placement)
        v.predicted, v.stages = e.step_s, e.stages
        print(f"{v.name}: measured {v.measured:.2f} s, predicted {v.predicted:.2f} s "
              f"({time.monotonic() - start:.0f} s of wall time)", flush=True)
    print("calibrated on the first: " + " ".join(fitted))
    print(f"{'placement':<18}{'measured s':>11}{'predicted s':>12}{'ratio':>7}  predicted stages")
    for v in variants:
        stages = ", ".join(f"{k} {s:.2f}" for k, s in v.stages.items() if s > 0.005)
        print(f"{v.name:<18}{v.measured:>11.2f}{v.predicted:>12.2f}{v.predicted / v.measured:>7.2f}  {stages}")
    measured = [v.name for v in sorted(variants, key=lambda v: v.measured)]
    predicted = [v.name for v in sorted(variants, key=lambda v: v.predicted)]
    print(f"measured order:  {' < '.join(measured)}\npredicted order: {' < '.join(predicted)}")
    return measured == predicted, fitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs-dir", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    runs = args.runs_dir or Path(tempfile.mkdtemp(prefix="plan-order-"))
    variants, common = cpu_variants(), [f"run.steps={args.steps}"]
    try:
        ok, fitted = check_order(REPO / "recipes" / "bench-longtail.yaml", variants, common, runs)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    print("orders agree" if ok else "orders differ")
    write_artifact("plan_order", {"recipe": "recipes/bench-longtail.yaml", "overrides": common, "calibrated": fitted,
                                  "variants": [asdict(v) for v in variants],
                                  "orders_agree": ok})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
