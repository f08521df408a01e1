"""How fast the CLI answers: `rlctl --help` and `rlctl status` over 200 finished runs.

    python scripts/bench_cli.py [--runs 200] [--repeat 7]

Creates the finished runs in a temporary directory (each with run.json and 40 steps of
metrics), runs each command --repeat times as a fresh process, and prints the median wall time
next to the target (0.3 s) and whether torch was imported along the way.
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

TARGET_S = 0.3
HEAVY = ("torch", "transformers", "wandb", "megatron", "sglang")


def make_runs(root: Path, n: int) -> None:
    for i in range(n):
        run_id = f"bench-20260101-{i:06d}-abcd"
        d = root / run_id
        (d / "logs").mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({
            "schema": 1, "id": run_id, "name": "bench", "state": "completed",
            "created": "2026-01-01T00:00:00+00:00", "ended": "2026-01-01T00:05:00+00:00",
            "exit_reason": "all steps done", "processes": {"supervisor": {"pid": 1}},
            "launcher": "local", "mode": "sync", "steps_total": 40,
        }))
        with (d / "metrics.jsonl").open("w") as f:
            for step in range(40):
                f.write(json.dumps({"step": step, "reward_mean": step / 40, "step_time": 0.4}) + "\n")
        (d / "events.jsonl").write_text("")


def timed(cmd: list[str], repeat: int) -> tuple[float, int]:
    times = []
    code = 0
    for _ in range(repeat):
        start = time.perf_counter()
        code = subprocess.run(cmd, capture_output=True).returncode
        times.append(time.perf_counter() - start)
    return statistics.median(times), code


def heavy_imports(args: list[str]) -> list[str]:
    code = (
        "import sys\nfrom rlctl.cli import app\n"
        f"try:\n    app({args!r}, prog_name='rlctl')\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY:' + ','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr.splitlines()
    marks = [line.removeprefix("HEAVY:") for line in err if line.startswith("HEAVY:")]
    if not marks:
        raise RuntimeError("could not read the imported modules")
    return [m for m in marks[-1].split(",") if m]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--repeat", type=int, default=7)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        make_runs(root, a.runs)
        rows = []
        for label, args in (("rlctl --help", ["--help"]),
                            (f"rlctl status ({a.runs} runs)", ["status", "--runs-dir", str(root)]),
                            (f"rlctl status --json ({a.runs} runs)", ["status", "--json", "--runs-dir", str(root)])):
            median, code = timed([sys.executable, "-m", "rlctl", *args], a.repeat)
            rows.append((label, median, code, heavy_imports(args)))
    baseline, _ = timed([sys.executable, "-c", "pass"], a.repeat)
    print(f"{'command':34} {'median s':>9} {'target s':>9} {'ratio':>6} {'exit':>5}  heavy imports")
    for label, median, code, heavy in rows:
        print(f"{label:34} {median:9.3f} {TARGET_S:9.3f} {median / TARGET_S:6.2f} {code:5d}  {','.join(heavy) or 'none'}")
    print(f"{'(python -c pass, for scale)':34} {baseline:9.3f}")
    ok = all(m < TARGET_S and code == 0 and not heavy for _, m, code, heavy in rows)
    print("all under target, no heavy imports" if ok else "TARGET MISSED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
