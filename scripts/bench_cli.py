"""How fast the CLI answers: `rlctl --help`, and `rlctl status` over 2000 finished runs.

    python scripts/bench_cli.py [--runs 2000] [--repeat 15] [--as-is]

Measures the checkout's rlctl (the commands run in the repository's root). Makes the runs in a
temporary directory, each as a quickstart run leaves it (run.json of about 3 KiB with six
processes, 40 metrics records of about 1.2 KiB), and runs every command --repeat times as a
fresh process, round-robin with `python -c pass` (the floor: an interpreter that
imports nothing). Prints a table: the median wall time of each against its target, the ratio,
the fastest run, the median CPU time (user + system: what the command itself costs, less what
other processes take from it), and whether a heavy module was imported on the way; then the
machine's load averages before and after. Writes the figures to results/bench_cli.json
(scripts/artifact.py).

The commands run with Python's bytecode cached, as for an installed rlctl (pip compiles it): in
a temporary PYTHONPYCACHEPREFIX, warmed by one run of each first, whatever PYTHONDONTWRITEBYTECODE
says here. --as-is runs them in this environment as it is instead (with PYTHONDONTWRITEBYTECODE=1,
rlctl's own modules are compiled again at every start). A loaded machine's figures are slower
than an idle one's: the load averages say how loaded it was.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from artifact import REPO, write_artifact

TARGETS = {"help": 0.15, "status": 0.3, "status_json": 0.3}
"""Seconds of wall time, the median of --repeat fresh processes on the project's 2-core machine."""
HEAVY = ("torch", "transformers", "wandb", "megatron", "sglang", "omegaconf", "yaml", "pydantic", "markdown_it",
         "pygments", "numpy")
"""Modules that no command shown here needs: an import of one is a regression even under target."""
ROLES = ("supervisor", "prepare", "rollout-0", "rollout-1", "trainer-0", "controller")
METRIC_KEYS = ("reward_mean", "response_len_mean", "response_len_p50", "response_len_p90", "response_len_max",
               "samples", "groups", "groups_dropped", "train_batches", "step_time", "rollout_time", "train_time",
               "sync_time", "wait_time", "rollout_to_train_end", "trainer_wait_ratio", "wait_time_ratio",
               "rollout_idle_ratio", "tokens_per_s", "samples_per_s", "critical_path_bound", "efficiency",
               "staleness_max", "sync_lag_max", "optimizer_steps", "samples_total", "tokens_total", "elapsed_s",
               "loss", "kl", "entropy", "grad_norm", "lr", "clip_fraction", "version", "tokens_generated")


def make_runs(root: Path, n: int) -> None:
    """n finished runs, as a quickstart run leaves them."""
    for i in range(n):
        run_id = f"bench-20260101-{i:06d}-abcd"
        d = root / run_id
        (d / "logs").mkdir(parents=True)
        processes = {role: {"pid": 100000 + 10 * i + k, "port": 40000 + k if role.startswith("rollout") else None,
                            "log": str(d / "logs" / f"{role}.log"), "host": "node-0"} for k, role in enumerate(ROLES)}
        (d / "run.json").write_text(json.dumps({
            "schema": 1, "id": run_id, "name": "bench", "state": "completed",
            "created": "2026-01-01T00:00:00+00:00", "ended": "2026-01-01T00:05:00+00:00",
            "exit_reason": "all steps done", "processes": processes, "launcher": "local", "mode": "sync",
            "steps_total": 40, "recipe_file": "recipes/quickstart.yaml", "overrides": ["run.steps=40"],
            "model_path": None, "code": {"commit": "0" * 40, "dirty": False},
            "plan": {"roles": [{"role": role, "host": "127.0.0.1", "port": 40000 + k, "gpus": [], "cpus": [k]}
                               for k, role in enumerate(ROLES)]},
        }, indent=2))
        with (d / "metrics.jsonl").open("w") as f:
            for step in range(40):
                record = {"step": step, **{k: round(step / 40 + j / 1000, 9) for j, k in enumerate(METRIC_KEYS)}}
                f.write(json.dumps(record, separators=(",", ":")) + "\n")
        (d / "events.jsonl").write_text("")


def command_env(as_is: bool, pycache: str) -> dict[str, str]:
    if as_is:
        return dict(os.environ)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": pycache}


def run_once(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system) and exit code of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    code = subprocess.run(cmd, capture_output=True, env=env, cwd=REPO).returncode
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, code


def heavy_imports(args: list[str], env: dict[str, str]) -> list[str]:
    """The HEAVY modules a fresh `rlctl ARGS` has imported by the time it ends."""
    code = (
        "import sys\nfrom rlctl.cli import main\n"
        f"sys.argv = ['rlctl', *{args!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY:' + ','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO).stderr.splitlines()
    marks = [line.removeprefix("HEAVY:") for line in err if line.startswith("HEAVY:")]
    if not marks:
        raise RuntimeError(f"could not read the imported modules of rlctl {' '.join(args)}: {err[-3:]}")
    return [m for m in marks[-1].split(",") if m]


def measure(commands: dict[str, list[str]], repeat: int, env: dict[str, str]) -> dict[str, dict]:
    """Every command `repeat` times, round-robin (a burst of load hits them all alike), after a warm-up."""
    for cmd in commands.values():
        run_once(cmd, env)
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, cmd in commands.items():
            samples[name].append(run_once(cmd, env))
    return {name: {"median_s": statistics.median(s[0] for s in runs), "min_s": min(s[0] for s in runs),
                   "max_s": max(s[0] for s in runs), "cpu_median_s": statistics.median(s[1] for s in runs),
                   "exit_codes": sorted({s[2] for s in runs})}
            for name, runs in samples.items()}


def report(rows: dict[str, dict], labels: dict[str, str], floor: dict, load: dict) -> bool:
    print(f"{'command':38} {'median s':>9} {'target s':>9} {'ratio':>6} {'min s':>7} {'cpu s':>7} {'exit':>5}  heavy imports")
    ok = True
    for name, r in rows.items():
        met = r["median_s"] <= TARGETS[name] and r["exit_codes"] == [0] and not r["heavy_imports"]
        ok &= met
        print(f"{labels[name]:38} {r['median_s']:9.3f} {TARGETS[name]:9.3f} {r['median_s'] / TARGETS[name]:6.2f} "
              f"{r['min_s']:7.3f} {r['cpu_median_s']:7.3f} {','.join(map(str, r['exit_codes'])):>5}  "
              f"{','.join(r['heavy_imports']) or 'none'}{'' if met else '   <- MISSED'}")
    print(f"{'python -c pass (the floor)':38} {floor['median_s']:9.3f} {'':>9} {'':>6} {floor['min_s']:7.3f} "
          f"{floor['cpu_median_s']:7.3f}")
    print(f"load averages (1, 5, 15 min): before {load['before']}, after {load['after']} on {os.cpu_count()} cores"
          + ("  (a loaded machine: figures slower than on an idle one)" if max(load["before"][0], load["after"][0]) > 0.5
             else ""))
    print(f"bytecode: {load['bytecode']}")
    print("all under target, no heavy imports" if ok else "TARGET MISSED")
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2000, help="finished runs `rlctl status` lists")
    p.add_argument("--repeat", type=int, default=15, help="fresh processes per command")
    p.add_argument("--as-is", action="store_true", help="run in this environment as it is (see the docstring)")
    a = p.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        make_runs(root, a.runs)
        env = command_env(a.as_is, str(Path(tmp) / "pycache"))
        args = {"help": ["--help"], "status": ["status", "--runs-dir", str(root)],
                "status_json": ["status", "--json", "--runs-dir", str(root)]}
        labels = {"help": "rlctl --help", "status": f"rlctl status ({a.runs} runs)",
                  "status_json": f"rlctl status --json ({a.runs} runs)"}
        commands = {name: [sys.executable, "-m", "rlctl", *argv] for name, argv in args.items()}
        measured = measure({**commands, "floor": [sys.executable, "-c", "pass"]}, a.repeat, env)
        floor = measured.pop("floor")
        for name, r in measured.items():
            r["heavy_imports"] = heavy_imports(args[name], env)
            r["target_s"] = TARGETS[name]
            r["ratio"] = r["median_s"] / TARGETS[name]
            r["command"] = labels[name]
    load = {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()],
            "bytecode": ("as this environment has it (PYTHONDONTWRITEBYTECODE="
                         f"{os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r})" if a.as_is else
                         "cached, as an installed rlctl has it (a temporary PYTHONPYCACHEPREFIX, warmed first)")}
    ok = report(measured, labels, floor, load)
    write_artifact("bench_cli", {
        "runs": a.runs, "repeat": a.repeat, "commands": measured, "floor_python_c_pass": floor,
        "load_average_before": load["before"], "load_average_after": load["after"], "bytecode": load["bytecode"],
        "all_met": ok,
        "workload": "finished local runs as a quickstart run leaves them: run.json about 3 KiB (six processes), "
                    "40 metrics records of about 1.2 KiB",
    })
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
