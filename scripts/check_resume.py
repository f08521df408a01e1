"""A run killed mid-way and resumed against uninterrupted runs of the same recipe, for real.

    python scripts/check_resume.py [--recipe recipes/quickstart.yaml] [--steps 30] [--kill-at 12]
                                   [--seeds 0,1,2] [--killed-seeds 0] [--save-every 5] [--out DIR]
                                   [KEY=VALUE ...]

Runs the recipe run.steps=STEPS once per seed, uninterrupted; then once per killed seed with
run.save_every=SAVE_EVERY, SIGKILLs its trainer (trainer-0) once KILL_AT steps are in
metrics.jsonl, and continues it with `rlctl resume`. Prints one table: per run the steps in
metrics.jsonl, steps written twice, attempts, where the resume started, and the reward over the
first and last 5 steps; then whether each resumed run's final reward lies within the spread of
the uninterrupted seeds, and the paired difference (resumed minus uninterrupted, same seed): what
a resume promises is the same run statistically (the servers restart with their seeds, and which
groups finish first depends on timing, so two runs of one seed are not bit for bit the same).
Writes results/check_resume.json (another --recipe: check_resume-RECIPE).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from artifact import repo_path, slug, write_artifact

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def rlctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "rlctl", *args], capture_output=True, text=True, cwd=REPO)
    if check and res.returncode != 0:
        raise SystemExit(f"rlctl {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()[-600:]}")
    return res


def run_dir(out: Path, run_id: str) -> Path:
    return out / run_id.strip().splitlines()[-1]


def read_run(path: Path) -> dict:
    info = json.loads((path / "run.json").read_text())
    metrics = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m["step"] for m in metrics]
    rewards = [m["reward_mean"] for m in metrics]
    attempts = info.get("attempts") or [{}]
    return {"id": path.name, "state": info["state"], "steps": len(set(steps)), "twice": len(steps) - len(set(steps)),
            "in_order": steps == sorted(steps), "attempts": len(attempts),
            "resumed_from": attempts[-1].get("resumed_from"), "rewards": rewards,
            "first5": sum(rewards[:5]) / max(len(rewards[:5]), 1), "last5": sum(rewards[-5:]) / max(len(rewards[-5:]), 1)}


def killed_run(a: argparse.Namespace, common: list[str], seed: int) -> tuple[Path, float]:
    """Launch detached, SIGKILL trainer-0 at KILL_AT steps, wait for the failure, resume. Returns
    the run directory and the seconds from the kill to the run's recorded failure."""
    res = rlctl("launch", a.recipe, *common, f"run.seed={seed}", f"run.save_every={a.save_every}",
                f"run.name=resume-killed{seed}", "--detach")
    path = run_dir(a.out, res.stdout)
    while True:
        done = (path / "metrics.jsonl").is_file() and len((path / "metrics.jsonl").read_text().splitlines())
        if done and done >= a.kill_at:
            break
        if json.loads((path / "run.json").read_text())["state"] in ("failed", "cancelled", "completed"):
            raise SystemExit(f"{path}: ended before step {a.kill_at}")
        time.sleep(0.2)
    pid = json.loads((path / "run.json").read_text())["processes"]["trainer-0"]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while json.loads((path / "run.json").read_text())["state"] != "failed":
        time.sleep(0.2)
    noticed = time.monotonic() - killed
    print(f"killed trainer-0 (pid {pid}) of {path.name} after {done} steps; the run failed {noticed:.1f} s later",
          flush=True)
    rlctl("resume", str(path))
    return path, noticed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=str(QUICKSTART))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-at", type=int, default=12)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--killed-seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    a.out = (a.out or Path(tempfile.mkdtemp(prefix="rlctl-resume-"))).resolve()
    common = [f"run.steps={a.steps}", f"run.output_dir={a.out}", *a.overrides]
    rows = []
    for seed in a.seeds:
        res = rlctl("launch", a.recipe, *common, f"run.seed={seed}", f"run.name=resume-seed{seed}")
        rows.append((f"seed {seed}, uninterrupted", read_run(run_dir(a.out, res.stdout))))
        print(f"seed {seed}: done", flush=True)
    base = {seed: r for (_, r), seed in zip(rows, a.seeds)}
    killed = []
    for seed in a.killed_seeds:
        path, noticed = killed_run(a, common, seed)
        killed.append((seed, read_run(path), noticed))
        rows.append((f"seed {seed}, killed at {a.kill_at}, resumed", killed[-1][1]))
    report(a, rows, base, killed)


def report(a: argparse.Namespace, rows: list, base: dict, killed: list) -> None:
    print(f"\n{a.recipe} run.steps={a.steps} {' '.join(a.overrides)}  (runs in {a.out})")
    print(f"{'run':<32} {'state':<10} {'steps':>5} {'twice':>5} {'attempts':>8} {'resumed at':>10} "
          f"{'reward first 5':>14} {'last 5':>7}")
    for name, r in rows:
        print(f"{name:<32} {r['state']:<10} {r['steps']:>5} {r['twice']:>5} {r['attempts']:>8} "
              f"{str(r['resumed_from'] or '-'):>10} {r['first5']:>14.3f} {r['last5']:>7.3f}")
    finals = [r["last5"] for r in base.values()]
    low, high = min(finals), max(finals)
    print(f"\nuninterrupted seeds' final reward (mean of the last 5 steps): {low:.3f} .. {high:.3f} "
          f"(spread {high - low:.3f})")
    ok = True
    diffs, resumed = [], []
    for seed, r, noticed in killed:
        within = low <= r["last5"] <= high
        whole = r["state"] == "completed" and r["steps"] == a.steps and r["twice"] == 0 and r["in_order"]
        ok = ok and whole and within
        if seed in base:
            diffs.append(r["last5"] - base[seed]["last5"])
        resumed.append({"seed": seed, "within_spread": within, "whole": whole, "failure_recorded_s": noticed})
        print(f"seed {seed} resumed: final {r['last5']:.3f}, {'within' if within else 'OUTSIDE'} the spread; "
              f"{r['steps']} steps, {r['twice']} twice; trainer death recorded {noticed:.1f} s after the kill")
    if diffs:
        mean = sum(diffs) / len(diffs)
        print(f"paired difference, resumed minus uninterrupted (same seed): {' '.join(f'{d:+.3f}' for d in diffs)}"
              f" (mean {mean:+.3f})")
    name = "check_resume" + ("" if Path(a.recipe).resolve() == QUICKSTART else "-" + slug(Path(a.recipe).stem))
    write_artifact(name, {"recipe": repo_path(a.recipe), "steps": a.steps, "kill_at": a.kill_at, "save_every": a.save_every,
                          "overrides": a.overrides, "runs": {label: r for label, r in rows}, "final_spread": [low, high],
                          "resumed": resumed, "paired_differences": diffs, "ok": ok})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
