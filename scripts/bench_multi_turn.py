"""Multi-turn learning on CPU: the calc task (recipes/tool-calc.yaml: the tiny model calls a
calculator) in every pipeline mode over several seeds, run for real, one after another.

    python scripts/bench_multi_turn.py [--seeds 3] [--steps 40] [--modes sync,rolloutpipe,async] [KEY=VALUE ...]

Per run, first steps against last steps (--window of each): the mean reward; the right-call
rate, the share of the written samples (run.sample_groups groups a step) whose first turn called
calc with exactly the prompt's product; the share of tool calls that parsed and ran
(tool_call_ok_ratio). And per run, the pipeline's promise for every turn, from the events: in
sync and rolloutpipe every turn of every completed group at its step's weights; in async every
trained sample within pipeline.max_staleness of the trainer. Every run of a mode uses the same
warmed-up base model (model.init is the recipe's; run.seed changes the RL run only).

Writes results/bench_multi_turn.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from artifact import write_artifact

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "sync": ["pipeline.mode=sync"],
    "rolloutpipe": ["pipeline.mode=rolloutpipe", "pipeline.admission=frontier", "rollout.concurrency=16"],
    "async": ["pipeline.mode=async", "pipeline.admission=frontier", "rollout.concurrency=16", "pipeline.max_staleness=1"],
}


def launch(recipe: Path, overrides: list[str], out: Path) -> Path:
    before = set(out.iterdir()) if out.is_dir() else set()
    res = subprocess.run([sys.executable, "-m", "rlctl", "launch", str(recipe), *overrides, f"run.output_dir={out}"],
                         capture_output=True, text=True, cwd=REPO)
    if res.returncode != 0:
        sys.exit(f"run failed ({' '.join(overrides)}):\n{res.stderr[-3000:]}")
    (path,) = set(out.iterdir()) - before
    return path


def right_call(sample: dict) -> bool:
    """The sample's first turn called calc with the prompt's own product."""
    from rlctl.agents.calls import parse_hermes

    calls = parse_hermes(sample.get("trajectory", "").split("</tool_call>")[0] + "</tool_call>")
    return bool(calls) and calls[0].name == "calc" and calls[0].arguments.get("expr") == str(sample["prompt"])[:-1]


def turns_on_policy(events: list[dict], mode: str) -> bool:
    if mode == "async":
        return True  # async's promise is checked on the trained samples' lags (staleness_max)
    version = {e["step"]: e["version"] for e in events if e["event"] == "step_start"}
    return all({v for turn in turns for v in turn[4]} == {version[e["step"]]}
               for e in events if e["event"] == "group_completed" for turns in e["turns"])


def measure(path: Path, mode: str, window: int, max_staleness: int) -> dict:
    metrics = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (path / "events.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (path / "samples.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics]
    first, last = set(steps[:window]), set(steps[-window:])

    def mean(key: str, chosen: set[int] | None = None) -> float:
        """Over the chosen steps that have the key (an async step may complete no trajectory)."""
        return statistics.fmean(m[key] for m in metrics if key in m and (chosen is None or m["step"] in chosen))

    def calls(chosen: set[int]) -> float:
        picked = [s for s in samples if s["step"] in chosen]
        return sum(right_call(s) for s in picked) / len(picked)

    lags = [lag for e in events if e["event"] == "train_start" for lag in e.get("staleness", [])]
    return {
        "reward_first": mean("reward_mean", first), "reward_last": mean("reward_mean", last),
        "right_calls_first": calls(first), "right_calls_last": calls(last),
        "calls_ok_first": mean("tool_call_ok_ratio", first), "calls_ok_last": mean("tool_call_ok_ratio", last),
        "turns_per_sample": mean("turns_per_sample"), "tool_seconds_per_step": mean("tool_seconds"),
        "turns_on_policy": turns_on_policy(events, mode),
        "staleness_max": max(lags, default=0), "staleness_ok": max(lags, default=0) <= max_staleness,
        "step_s": statistics.median(m["step_time"] for m in metrics[1:]),
        "steps": len(metrics),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=REPO / "recipes" / "tool-calc.yaml")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--keep", type=Path, help="Keep the runs in this directory.")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    out = a.keep or Path(tempfile.mkdtemp(prefix="rlctl-bench-multi-turn-"))
    rows = []
    for mode in a.modes.split(","):
        for seed in range(a.seeds):
            t0 = time.monotonic()
            path = launch(a.recipe, [*MODES[mode], f"run.seed={seed}", f"run.steps={a.steps}", "run.sample_groups=4",
                                     *a.overrides], out)
            row = {"mode": mode, "seed": seed, **measure(path, mode, a.window, 1), "wall_s": time.monotonic() - t0}
            rows.append(row)
            print(f"{mode:<12} seed {seed}: reward {row['reward_first']:.3f} -> {row['reward_last']:.3f}, right calls "
                  f"{row['right_calls_first']:.2f} -> {row['right_calls_last']:.2f}, calls ok {row['calls_ok_first']:.2f} "
                  f"-> {row['calls_ok_last']:.2f}, every turn on-policy {row['turns_on_policy']}, staleness max "
                  f"{row['staleness_max']}, {row['step_s']:.2f} s/step", flush=True)
    print(f"\n{'mode':<12} {'reward first':>12} {'last':>6} {'x':>5} {'right calls':>12} {'last':>6} "
          f"{'calls ok':>9} {'last':>6} {'turns':>6} {'on-policy':>10} {'s/step':>7}")
    summary = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        s = {k: statistics.fmean(float(r[k]) for r in mine) for k in
             ("reward_first", "reward_last", "right_calls_first", "right_calls_last", "calls_ok_first", "calls_ok_last",
              "turns_per_sample", "step_s")}
        s["all_on_policy"] = all(r["turns_on_policy"] and r["staleness_ok"] for r in mine)
        s["every_seed_rises"] = all(r["reward_last"] > r["reward_first"] and r["right_calls_last"] > r["right_calls_first"]
                                    for r in mine)
        summary[mode] = s
        print(f"{mode:<12} {s['reward_first']:>12.3f} {s['reward_last']:>6.3f} {s['reward_last'] / max(s['reward_first'], 1e-9):>5.2f} "
              f"{s['right_calls_first']:>12.2f} {s['right_calls_last']:>6.2f} {s['calls_ok_first']:>9.2f} "
              f"{s['calls_ok_last']:>6.2f} {s['turns_per_sample']:>6.2f} {str(s['all_on_policy']):>10} {s['step_s']:>7.2f}")
    print(f"(means over {a.seeds} seeds; first and last {a.window} steps of {a.steps})")
    write_artifact("bench_multi_turn", {"recipe": str(a.recipe.relative_to(REPO)) if a.recipe.is_relative_to(REPO)
                                               else str(a.recipe), "steps": a.steps, "window": a.window,
                                               "overrides": a.overrides, "runs": rows, "modes": summary})


if __name__ == "__main__":
    main()
