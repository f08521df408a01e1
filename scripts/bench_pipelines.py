"""Pipeline modes side by side on one workload: sync, rolloutpipe (frontier), rolloutpipe (fifo),
rolloutpipe (frontier, whole train batches: pipeline.stream_train=false) and async, run for real,
interleaved, and compared in one table with ratios to sync.

    python scripts/bench_pipelines.py [--recipe recipes/bench-longtail.yaml] [--rounds 1] [KEY=VALUE ...]
    python scripts/bench_pipelines.py --sweep [KEY=VALUE ...]

--sweep runs 12 settings (group size x rollout batch x length cap) of rolloutpipe against sync in
`rlctl simulate` (recipes/sim-1024gpu.yaml on three cluster splits, 64 rollout + 16 trainer GPUs,
4 + 2 and 2 + 1; see SPLITS), under each admission policy (fifo, frontier, longest), and prints
each setting's train/rollout time ratio, both reductions per policy, and the most any policy can
reach while the rollout lasts as long as sync's (bounds). --reread: a dataset of B prompts read
every step (what length-aware admission learns from); add rollout.sampling.long_tail.prompt_share=R
for lengths that belong to their prompt.
--sweep --real runs 12 smaller settings for real on this machine (bench-longtail.yaml, 3 steps
each); --settings 4x16x256,... runs only those.

Writes results/bench_pipelines.json (real runs), bench_pipelines-sweep.json or
bench_pipelines-sweep-real.json; with another --recipe its name follows (e.g.
bench_pipelines-bench-longtail-gpu.json); --artifact NAME names it instead.

Each round runs every mode once with the same recipe and seed (rounds use seeds 0, 1, ...), so
slow drift of the machine hits all modes alike. Per run, the medians over steps (the first step
left out: it includes start-up effects) are taken; the table shows the median over rounds.
How rollout and training were kept apart on this machine (CPU pinning from the recipe) is
printed with the table.
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

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "recipes" / "bench-longtail.yaml"

MODES = [
    ("sync", ["pipeline.mode=sync", "pipeline.admission=fifo"]),
    ("rolloutpipe-frontier", ["pipeline.mode=rolloutpipe", "pipeline.admission=frontier"]),
    ("rolloutpipe-fifo", ["pipeline.mode=rolloutpipe", "pipeline.admission=fifo"]),
    # The same, but the trainer waits for whole train batches: what streaming groups buys, alone.
    ("rolloutpipe-batched", ["pipeline.mode=rolloutpipe", "pipeline.admission=frontier", "pipeline.stream_train=false"]),
    ("async", ["pipeline.mode=async", "pipeline.admission=frontier"]),
]
COLUMNS = [
    ("rollout_to_train_end", "r2t end s"),
    ("trainer_wait_ratio", "wait ratio"),
    ("wait_time_ratio", "slime wait"),
    ("step_time", "step s"),
    ("efficiency", "eff/bound"),
    ("rollout_idle_ratio", "srv idle"),
    ("reward_mean", "reward"),
]


def run_mode(recipe: Path, overrides: list[str], out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "rlctl", "launch", str(recipe), f"run.output_dir={out}", *overrides]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(overrides)}):\n{res.stderr[-2000:]}")
    run_id = res.stdout.strip().splitlines()[-1]
    return [json.loads(line) for line in (out / run_id / "metrics.jsonl").read_text().splitlines() if line]


def summarize(metrics: list[dict]) -> dict[str, float]:
    steps = metrics[1:] if len(metrics) > 1 else metrics
    out = {key: statistics.median(m[key] for m in steps) for key, _ in COLUMNS}
    out["final_reward"] = statistics.fmean(m["reward_mean"] for m in metrics[-5:])
    # The workload's balance: how long the step's training takes against its generation.
    ratios = [m["train_time"] / m["rollout_time"] for m in steps if m.get("rollout_time")]
    out["train_over_rollout"] = statistics.median(ratios) if ratios else float("nan")
    return out


SWEEP = [(g, b, cap) for g in (8, 16) for b in (128, 512) for cap in (4096, 8192, 16384)]


SWEEP_KEYS = ("rollout_to_train_end", "trainer_wait_ratio", "train_time", "rollout_time")
# sync, then rolloutpipe under each admission policy
POLICIES = (("sync", MODES[0][1]), ("fifo", MODES[2][1]), ("frontier", MODES[1][1]),
            ("longest", ["pipeline.mode=rolloutpipe", "pipeline.admission=longest"]))
PIPED = [name for name, _ in POLICIES[1:]]


def bounds(sync: dict[str, float]) -> tuple[float, float]:
    """The most pipelining can cut rollout-to-train-end and the waiting ratio against sync, if
    the rollout takes as long as sync's (R) and training as long (T), whatever the admission: the
    trainer cannot end before the rollout's last group is ready (and trained: its last piece at
    least), nor before it has trained T, so the window is at least max(R, T) (sync's: R + T), and
    the trainer waits at least that less T. rho = T / R: r2t falls by at most min(rho, 1) / (1 +
    rho), the waiting ratio at most to max(1 - rho, 0)."""
    r, t = sync["rollout_time"], sync["train_time"]
    window = max(r, t)
    best_wait = (window - t) / window
    return window / (r + t) - 1, (best_wait / sync["trainer_wait_ratio"] - 1 if sync["trainer_wait_ratio"]
                                  else float("nan"))


def print_sweep(settings, measure) -> list[dict]:
    """One row per (G, B, cap): train/rollout time ratio, and rolloutpipe's change of
    rollout-to-train-end and of the trainer's waiting ratio against sync under each admission
    policy, beside the most any policy can reach (bounds); then the ranges. `measure(g, b, cap,
    mode_overrides)` returns that mode's per-step metrics. Returns the rows' figures."""
    heads = " ".join(f"{n[:8]:>8}" for n in [*PIPED, "bound"])
    print(f"{'G':>3} {'B':>5} {'cap':>6} {'train/roll':>10} {'r2t sync s':>10} | r2t change: {heads} | "
          f"wait change: {heads} {'wall s':>7}", flush=True)
    rows = []
    for g, b, cap in settings:
        start = time.monotonic()
        runs = {mode: measure(g, b, cap, extra) for mode, extra in POLICIES}  # one run (or simulation) each
        medians = {mode: {k: statistics.median(m[k] for m in metrics) for k in SWEEP_KEYS} for mode, metrics in runs.items()}
        s = medians["sync"]
        r2t = {n: medians[n]["rollout_to_train_end"] / s["rollout_to_train_end"] - 1 for n in PIPED}
        wait = {n: medians[n]["trainer_wait_ratio"] / s["trainer_wait_ratio"] - 1 if s["trainer_wait_ratio"]
                else float("nan") for n in PIPED}
        r2t["bound"], wait["bound"] = bounds(s)
        rows.append({"group_size": g, "batch_size": b, "max_new_tokens": cap, **medians,
                     "train_over_rollout": s["train_time"] / s["rollout_time"], "r2t_change": r2t, "wait_change": wait,
                     "wall_s": time.monotonic() - start})
        cells = lambda d: " ".join(f"{d[n]:8.1%}" for n in [*PIPED, "bound"])  # noqa: E731
        print(f"{g:3d} {b:5d} {cap:6d} {s['train_time'] / s['rollout_time']:10.2f} {s['rollout_to_train_end']:10.2f} | "
              f"            {cells(r2t)} |              {cells(wait)} {rows[-1]['wall_s']:7.2f}", flush=True)
    print_range(rows)
    return rows


def print_range(rows: list[dict], label: str = "range") -> dict[str, dict[str, list[float]]]:
    """Prints and returns each policy's range of changes against sync over the rows (and the
    bounds'): rollout-to-train-end, then the trainer's waiting ratio."""
    span = {n: {k: [min(r[k][n] for r in rows), max(r[k][n] for r in rows)] for k in ("r2t_change", "wait_change")}
            for n in [*PIPED, "bound"]}
    print(f"{label} (RolloutPipe paper, against Slime: -30.7..-42.3% and -37..-76%):", flush=True)
    for n, d in span.items():
        print(f"  {n:9} rollout-to-train-end {d['r2t_change'][0]:7.1%} .. {d['r2t_change'][1]:7.1%}, "
              f"trainer waiting ratio {d['wait_change'][0]:7.1%} .. {d['wait_change'][1]:7.1%}", flush=True)
    return span


# Cluster splits (rollout GPUs, trainer GPUs) the simulated sweep runs. How much pipelining
# gains depends on how many waves of requests a server runs per step: on 64 rollout GPUs most
# settings are one wave (every sample starts at once, and the groups with a long sample all
# complete at the end); on 4, a rollout batch is 4-16 waves and complete groups arrive steadily;
# on 2, 8-32 waves, and with one trainer GPU train/rollout stays near 1 at B=512.
SPLITS = [(64, 16), (4, 2), (2, 1)]


def sweep(overrides: list[str], reread: bool = False) -> dict:
    """The simulated sweep on every split; its figures. `reread`: the run reads a dataset of B
    prompts every step (sim.dataset_prompts), for 3 steps of which the first is left out, so
    that length-aware admission has each prompt's earlier lengths to go by."""
    sys.path.insert(0, str(REPO))
    from rlctl.sim.run import simulate_run
    from rlctl.recipe import load_recipe

    every, splits = [], []
    steps = 3 if reread else 2
    for rollout_gpus, trainer_gpus in SPLITS:
        base = [f"run.steps={steps}", f"sim.rollout_gpus={rollout_gpus}", f"sim.trainer_gpus={trainer_gpus}", *overrides]
        print(f"\n{rollout_gpus} rollout + {trainer_gpus} trainer GPUs ({' '.join(base)})", flush=True)

        def measure(g, b, cap, mode_overrides, base=base):
            setting = [f"rollout.group_size={g}", f"rollout.batch_size={b}", f"train.groups_per_batch={b // 8}",
                       f"rollout.sampling.max_new_tokens={cap}", *([f"sim.dataset_prompts={b}"] if reread else [])]
            recipe = load_recipe(REPO / "recipes" / "sim-1024gpu.yaml", [*base, *setting, *mode_overrides],
                                 check_paths=False)
            return simulate_run(recipe).metrics[1 if reread else 0:]

        rows = print_sweep(SWEEP, measure)
        splits.append({"rollout_gpus": rollout_gpus, "trainer_gpus": trainer_gpus, "rows": rows})
        every += rows
    return {"recipe": "recipes/sim-1024gpu.yaml", "overrides": overrides, "steps": steps, "reread": reread,
            "splits": splits, "range": print_range(every, "\nrange over all splits")}


REAL_SWEEP = [(g, b, cap) for g in (4, 8) for b in (16, 32) for cap in (64, 128, 256)]


def sweep_real(recipe: Path, overrides: list[str], settings: list[tuple[int, int, int]] | None = None) -> dict:
    """The sweep for real on CPU: same table, smaller settings (G x B groups x length cap; all 12
    of REAL_SWEEP unless `settings` names some); its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        def measure(g, b, cap, mode_overrides):
            setting = ["run.steps=3", f"rollout.group_size={g}", f"rollout.batch_size={b}",
                       f"train.groups_per_batch={b // 8}", f"rollout.sampling.max_new_tokens={cap}", *overrides]
            return run_mode(recipe, [*setting, *mode_overrides], Path(tmp) / "runs")[1:]  # step 0 has start-up

        rows = print_sweep(settings or REAL_SWEEP, measure)
    return {"recipe": repo_path(recipe), "overrides": overrides, "steps": 3, "rows": rows, "range": print_range(rows)}


def parse_settings(text: str) -> list[tuple[int, int, int]]:
    """"4x16x256,8x32x64" -> [(4, 16, 256), (8, 32, 64)]: G x B x cap."""
    try:
        return [tuple(int(x) for x in part.split("x")) for part in text.split(",")]  # type: ignore[misc]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: settings are GxBxCAP, comma-separated (e.g. 4x16x256)") from None


def artifact_name(a: argparse.Namespace) -> str:
    """bench_pipelines[-sweep[-real]], then the recipe's name unless it is the default."""
    name = "bench_pipelines" + ("-sweep" if a.sweep else "") + ("-real" if a.sweep and a.real else "")
    name += "-reread" if a.sweep and a.reread and not a.real else ""
    if a.recipe.resolve() != DEFAULT_RECIPE and not (a.sweep and not a.real):  # the simulated sweep has its own recipe
        name += "-" + slug(a.recipe.stem)
    return a.artifact or name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--modes", default=",".join(name for name, _ in MODES))
    p.add_argument("--json", type=Path, help="also write the per-run summaries here")
    p.add_argument("--runs-dir", type=Path, help="keep the run directories here (for rlctl status/trace/compare)")
    p.add_argument("--sweep", action="store_true", help="12 simulated settings instead of real runs")
    p.add_argument("--real", action="store_true", help="with --sweep: 12 smaller settings run for real")
    p.add_argument("--settings", type=parse_settings, help="with --sweep --real: only these, GxBxCAP,...")
    p.add_argument("--reread", action="store_true",
                   help="with --sweep: a dataset of B prompts read every step, 3 steps (the first left out)")
    p.add_argument("--artifact", help="the name of the results/ file (default: from the mode and the recipe)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    if a.sweep:
        write_artifact(artifact_name(a), sweep_real(a.recipe, a.overrides, a.settings) if a.real
                       else sweep(a.overrides, a.reread))
        return
    figures = real_runs(a)
    if a.json:
        a.json.write_text(json.dumps({"table": figures["table"], "runs": figures["runs"]}, indent=2))
    write_artifact(artifact_name(a), figures)


def real_runs(a: argparse.Namespace) -> dict:
    """Every chosen mode, --rounds times, for real; prints the table and returns its figures."""
    chosen = [(n, o) for n, o in MODES if n in a.modes.split(",")]
    results: dict[str, list[dict[str, float]]] = {n: [] for n, _ in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = a.runs_dir or Path(tmp) / "runs"
        for rnd in range(a.rounds):
            for name, mode_overrides in chosen:
                metrics = run_mode(a.recipe, [*a.overrides, f"run.seed={rnd}", *mode_overrides], runs_dir)
                results[name].append(summarize(metrics))
                print(f"round {rnd} {name}: " + ", ".join(f"{k}={v:.3f}" for k, v in results[name][-1].items()),
                      file=sys.stderr, flush=True)

    table = {n: {k: statistics.median(r[k] for r in runs) for k, _ in COLUMNS} for n, runs in results.items()}
    base = table.get("sync")
    print(f"recipe {a.recipe.name} {' '.join(a.overrides)}; {a.rounds} round(s), medians over steps 1..N and rounds")
    sys.path.insert(0, str(REPO))
    from rlctl.recipe import load_recipe

    r = load_recipe(a.recipe, a.overrides)
    placement = {"cores": os.cpu_count(), "rollout_device": str(r.rollout.device), "rollout_cpus": r.rollout.cpus,
                 "train_device": str(r.train.device), "train_cpus": r.train.cpus,
                 "threads_per_process": r.run.threads_per_process}
    print(f"machine: {os.cpu_count()} cores; rollout servers on {r.rollout.device} cores {r.rollout.cpus or 'any'}, "
          f"trainer on {r.train.device} cores {r.train.cpus or 'any'}, {r.run.threads_per_process} torch thread(s) each")
    print(f"{'mode':22}" + "".join(f"{label:>12}" for _, label in COLUMNS))
    for name, row in table.items():
        print(f"{name:22}" + "".join(f"{row[k]:12.3f}" for k, _ in COLUMNS))
    ratios = {name: {k: row[k] / base[k] if base[k] else float("nan") for k, _ in COLUMNS}
              for name, row in table.items()} if base else {}
    if ratios:
        print(f"{'ratio to sync':22}")
        for name, row in ratios.items():
            print(f"{'  ' + name:22}" + "".join(f"{row[k]:12.2f}" for k, _ in COLUMNS))
    print("final reward (mean of the last 5 steps), over rounds:")
    finals = {}
    for name, runs in results.items():
        rewards = [r["final_reward"] for r in runs]
        finals[name] = {"mean": statistics.fmean(rewards), "stdev": statistics.stdev(rewards) if len(rewards) > 1 else 0.0,
                        "rounds": rewards}
        print(f"  {name:22} {finals[name]['mean']:.3f} +- {finals[name]['stdev']:.3f}  "
              f"({', '.join(f'{x:.3f}' for x in rewards)})")
    return {"recipe": repo_path(a.recipe), "overrides": a.overrides, "rounds": a.rounds, "placement": placement,
            "table": table, "ratio_to_sync": ratios, "final_reward": finals, "runs": results}


if __name__ == "__main__":
    main()
