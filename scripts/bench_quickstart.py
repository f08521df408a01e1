"""The quickstart as a new user runs it: wall time from `rlctl launch` to its exit, and how the
reward rises, over several seeds.

    python scripts/bench_quickstart.py [--seeds 0,1,2] [KEY=VALUE ...]

The first seed starts from an empty model cache (rlctl builds and warms up its tiny model, as on
a fresh machine); the others reuse that cache, as every later launch does. Per seed it records
the wall time, the final state and the whole reward curve (reward_mean per step), and prints the
mean reward of the first 5 and last 10 steps. The curves are what the learning tests' thresholds
are read from: a bar is set below the spread of seeds, not from one lucky run.
Writes results/quickstart.json (with overrides: quickstart-<overrides>.json).
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

from artifact import slug, write_artifact

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def launch(out: Path, cache: Path, seed: int, overrides: list[str]) -> dict:
    env = {**os.environ, "RLCTL_CACHE": str(cache)}
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "rlctl", "launch", str(QUICKSTART), f"run.seed={seed}",
                          f"run.output_dir={out}", *overrides], capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.monotonic() - start
    if res.returncode != 0:
        raise SystemExit(f"seed {seed}: rlctl launch failed ({res.returncode}): {res.stderr.strip()[-600:]}")
    run_dir = out / res.stdout.strip().splitlines()[-1]
    info = json.loads((run_dir / "run.json").read_text())
    rewards = [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {"seed": seed, "wall_s": round(wall, 1), "state": info["state"], "steps": len(rewards),
            "rewards": [round(r, 4) for r in rewards]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values; the first runs cold")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, as `rlctl launch` takes them")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-quickstart-") as tmp:
        cache = Path(tmp) / "cache"  # empty: the first seed builds the model as a fresh machine does
        for i, seed in enumerate(seeds):
            run = launch(Path(tmp) / "runs", cache, seed, args.overrides)
            run["model_cache"] = "empty" if i == 0 else "warm"
            runs.append(run)
            r = run["rewards"]
            print(f"seed {seed}: {run['wall_s']:6.1f} s ({run['model_cache']} model cache), {run['state']}, "
                  f"{run['steps']} steps, reward {statistics.fmean(r[:5]):.3f} (first 5) -> "
                  f"{statistics.fmean(r[-10:]):.3f} (last 10)")
    rises = [statistics.fmean(r["rewards"][-10:]) - statistics.fmean(r["rewards"][:5]) for r in runs]
    print(f"rise (last 10 - first 5): min {min(rises):.3f}, mean {statistics.fmean(rises):.3f}, max {max(rises):.3f}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    name = "quickstart" + (f"-{slug(' '.join(args.overrides))}" if args.overrides else "")
    write_artifact(name, {"overrides": args.overrides, "runs": runs, "rise_last10_first5": [round(x, 4) for x in rises],
                          "loadavg_1m_end": load})


if __name__ == "__main__":
    main()
