"""rlctl compare and the wandb tracker. Comparison is read from run directories: the layout tests
build them by hand (fixed ids and numbers, so the width-80 rendering is golden-tested); the rest
compare real runs."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import FAST, QUICKSTART, REPO, rlctl, rlctl_here
from rlctl.run.compare import bootstrap_ci, comparison, failing, sparkline
from rlctl.run.step_records import metrics_by_step
from rlctl.run.dir import RunDir

GOLDEN = REPO / "tests" / "golden" / "compare"


def make_run(root: Path, run_id: str, recipe: dict, rewards: list[float], *, state: str = "completed",
             step_time: float = 1.0, reason: str | None = None, extra_steps: list[dict] = (),
             train_batches: int = 4, samples: int = 512) -> RunDir:
    """A run directory as a finished run leaves it, with metrics that follow simple formulas."""
    path = root / run_id
    (path / "logs").mkdir(parents=True)
    (path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    info = {"schema": 1, "id": run_id, "name": run_id.split("-")[0], "state": state, "created": "2026-11-29T10:00:00+00:00",
            "ended": "2026-11-29T10:05:00+00:00", "exit_reason": reason, "processes": {}, "launcher": "local",
            "mode": recipe["pipeline"]["mode"], "steps_total": len(rewards), "code": {"commit": "0123456789abcdef", "dirty": False}}
    (path / "run.json").write_text(json.dumps(info))
    lines = []
    for step, r in enumerate(rewards):
        lines.append({"step": step, "reward_mean": r, "response_len_mean": 10.0 + step, "step_time": step_time,
                      "rollout_time": 0.6 * step_time, "train_time": 0.5 * step_time, "sync_time": 0.05,
                      "trainer_wait_ratio": 0.5 if recipe["pipeline"]["mode"] == "sync" else 0.2,
                      "rollout_to_train_end": 0.9 * step_time, "efficiency": 0.7, "tokens_per_s": 1000.0 / step_time,
                      "samples": samples, "train_batches": train_batches, "samples_total": samples * (step + 1),
                      "optimizer_steps": train_batches * (step + 1), "elapsed_s": step_time * (step + 1)})
    lines += list(extra_steps)
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return RunDir(path)


def base_recipe(mode: str, **more) -> dict:
    r = {"run": {"name": "bench", "seed": 0, "steps": 6}, "pipeline": {"mode": mode, "admission": "fifo"},
         "rollout": {"batch_size": 64, "group_size": 8}, "train": {"lr": 0.0003}}
    for key, value in more.items():
        section, _, name = key.partition("__")
        r.setdefault(section, {})[name] = value
    return r


@pytest.fixture
def two_runs(tmp_path):
    a = make_run(tmp_path, "sync-20261129-100000-aaaa", base_recipe("sync"), [0.2, 0.3, 0.4, 0.5, 0.55, 0.6],
                 step_time=2.0)
    # B was requeued: step 5 was written twice, the last record wins.
    b = make_run(tmp_path, "pipe-20261129-100000-bbbb",
                 base_recipe("rolloutpipe", pipeline__admission="frontier", algo__kl_coef=0.01),
                 [0.2, 0.25, 0.4, 0.45, 0.5, 0.1], step_time=1.3,
                 extra_steps=[{"step": 5, "reward_mean": 0.58, "response_len_mean": 15.0, "step_time": 1.3,
                               "rollout_time": 0.78, "train_time": 0.65, "sync_time": 0.05, "trainer_wait_ratio": 0.2,
                               "rollout_to_train_end": 1.17, "efficiency": 0.7, "tokens_per_s": 769.2,
                               "samples": 512, "train_batches": 4, "samples_total": 3072, "optimizer_steps": 24,
                               "elapsed_s": 7.8}])
    return tmp_path, a, b


def render_text(comp) -> str:
    from rich.console import Console

    from rlctl.commands.compare import render

    out = io.StringIO()
    Console(file=out, width=80, color_system=None, force_terminal=False).print(render(comp))
    return out.getvalue()


def test_three_parts_in_width_80(two_runs):
    """To accept a deliberate layout change: RLCTL_UPDATE_GOLDEN=1, then read the diff."""
    _, a, b = two_runs
    text = render_text(comparison([a, b], last=3))
    golden = GOLDEN / "two-runs.txt"
    if os.environ.get("RLCTL_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()
    assert max(len(line) for line in text.splitlines()) <= 80


def test_comparison_numbers(two_runs):
    _, a, b = two_runs
    comp = comparison([a, b], last=3)
    assert comp["config"]["differ"] == {"pipeline.admission": ["fifo", "frontier"], "pipeline.mode": ["sync", "rolloutpipe"],
                                        "algo.kl_coef": [None, 0.01]}  # None: the key is absent from A
    assert comp["config"]["keys_total"] == 9 and comp["config"]["keys_differ"] == 3
    reward = comp["metrics"]["reward_mean"]
    assert reward[0]["last_mean"] == pytest.approx(0.55) and reward[0]["best"] == 0.6
    assert reward[1]["last_mean"] == pytest.approx((0.45 + 0.5 + 0.58) / 3)  # requeued step: last write wins
    assert reward[1]["pct"] == pytest.approx(((0.45 + 0.5 + 0.58) / 3 / 0.55 - 1) * 100)
    assert comp["time"]["step_time"][1]["ratio"] == pytest.approx(0.65)
    assert comp["runs"][1]["steps"] == 6
    assert failing(comp, "step_time.ratio < 0.7") and not failing(comp, "step_time.ratio > 0.7")
    assert failing(comp, "reward_mean.pct < -1, trainer_wait_ratio.ratio > 2")


def test_cli_json_round_trips_and_fail_if_exit_codes(two_runs):
    root, a, b = two_runs
    res = rlctl_here("compare", a.id, b.id, "--runs-dir", str(root), "--json", "--last", "3", cwd=root)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data) == {"runs", "x", "config", "metrics", "time", "eval", "curves", "curves_x", "groups", "fail_if"}
    assert data.pop("groups") is None  # no --group-by
    data.pop("fail_if")
    assert render_text(data) == render_text(comparison([a, b], last=3))  # the JSON holds the whole comparison
    res = rlctl_here("compare", str(a.path), b.id, "--runs-dir", str(root), "--fail-if", "rollout_to_train_end.ratio > 0.6", cwd=root)
    assert res.returncode == 1 and "rollout_to_train_end.ratio" in res.stderr
    res = rlctl_here("compare", a.id, b.id, "--runs-dir", str(root), "--fail-if", "rollout_to_train_end.ratio > 0.8", cwd=root)
    assert res.returncode == 0, res.stderr
    res = rlctl_here("compare", a.id, b.id, "--runs-dir", str(root), "--fail-if", "r2t goes up", cwd=root)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1


def test_runs_of_different_lengths_and_step_units_are_aligned_on_samples(tmp_path):
    """A sync run (4 optimizer steps a step) against an async one (1 a step) four times as long in
    steps: the same samples, so the comparison covers both whole and says why steps would mislead."""
    a = make_run(tmp_path, "sync-20261129-100000-aaaa", base_recipe("sync"), [0.1 * i for i in range(5)],
                 step_time=2.0, train_batches=4, samples=256)
    b = make_run(tmp_path, "async-20261129-100000-bbbb", base_recipe("async"), [0.025 * i for i in range(24)],
                 step_time=0.5, train_batches=1, samples=64)
    comp = comparison([a, b], last=1)
    x = comp["x"]
    assert (x["by"], x["end"], x["covered"]) == ("samples", 1280, [1280, 1536])
    assert any("differ in length" in n for n in x["notes"]) and any("optimizer steps (A 4, B 1)" in n for n in x["notes"])
    reward = comp["metrics"]["reward_mean"]
    assert reward[0]["last_mean"] == pytest.approx(0.4)  # A's step 4 at 1,280 samples
    # B over the same last 256 samples as A's last step (its steps 16..19), not its last step (23)
    assert reward[1]["last_mean"] == pytest.approx(0.025 * 17.5) and comp["x"]["last_from"] == 1024
    per_1k = comp["time"]["seconds_per_1k_samples"]
    assert per_1k[0]["median"] == pytest.approx(2.0 / 256 * 1000) and per_1k[1]["median"] == pytest.approx(0.5 / 64 * 1000)
    by_steps = comparison([a, b], last=1, by="steps")
    assert by_steps["x"]["end"] == 5 and any("not the same unit" in n for n in by_steps["x"]["notes"])
    by_opt = comparison([a, b], last=1, by="optimizer_steps")
    assert by_opt["x"]["end"] == 20 and by_opt["metrics"]["reward_mean"][1]["last_mean"] == pytest.approx(0.025 * 17.5)
    text = render_text(comp)
    assert "compared over 0 .. 1,280 samples (--x samples)" in text and "note: runs differ in length" in text


@pytest.mark.process
def test_plot_without_matplotlib_says_so_before_any_output(two_runs):
    root, a, b = two_runs
    hidden = root / "no-matplotlib"  # a matplotlib that cannot be imported shadows the real one
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    import importlib.util
    assert importlib.util.find_spec("matplotlib") is not None  # the check below is not vacuous here
    res = rlctl("compare", a.id, b.id, "--runs-dir", str(root), "--plot", str(root / "p.png"), cwd=root,
                env={"PYTHONPATH": str(hidden)})
    assert res.returncode == 2 and res.stdout == "", res.stdout
    assert res.stderr.strip() == "error: --plot needs matplotlib: pip install 'rlctl[plot]'"


@pytest.mark.process
def test_unknown_run_failed_run_and_group_by(tmp_path):
    runs = [make_run(tmp_path, f"s{i}-20261129-100000-000{i}", base_recipe("sync", run__seed=i), [0.1 * i, 0.2 * i])
            for i in range(3)]
    runs.append(make_run(tmp_path, "p0-20261129-100000-0010", base_recipe("rolloutpipe"), [0.3], state="failed",
                         reason="rollout-1 (pid 7) was killed by SIGKILL"))
    res = rlctl("compare", runs[0].id, "no-such-run", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2 and "no-such-run" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    comp = comparison(runs, group_by="pipeline.mode")
    groups = {g["value"]: g for g in comp["groups"]["groups"]}
    assert groups["sync"]["n"] == 3 and groups["sync"]["reward_mean"]["lo"] is not None
    assert groups["rolloutpipe"]["reward_mean"]["lo"] is None  # one run: no interval
    text = render_text(comp)
    assert "fewer than 3 runs" in text and "D failed: rollout-1 (pid 7) was killed by SIGKILL" in text
    res = rlctl("compare", runs[0].id, runs[1].id, "--group-by", "pipeline.nope", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2


def test_metrics_are_read_a_line_at_a_time_and_a_line_over_1_mib_is_skipped(tmp_path):
    """A metrics.jsonl of gigabytes costs compare the fields it shows, not the file: records are
    streamed and cut to those fields, and a line over 1 MiB is skipped unread, counted as damage."""
    import tracemalloc

    pad = "x" * 10_000  # fields compare never shows: 20 MB of them over the run
    steps = [{"step": i, "reward_mean": 0.5, "step_time": 1.0, "samples": 512, "pad": pad} for i in range(2000)]
    big = make_run(tmp_path, "big-20261129-100000-cccc", base_recipe("sync"), [0.1], extra_steps=steps)
    with big.metrics_path.open("a") as f:
        f.write(json.dumps({"step": 2000, "reward_mean": 0.9, "pad": "y" * (2 << 20)}) + "\n")  # 2 MiB, one line
    small = make_run(tmp_path, "small-20261129-100000-dddd", base_recipe("sync"), [0.2, 0.3])
    tracemalloc.start()
    try:
        comp = comparison([small, big])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert big.metrics_path.stat().st_size > 20 << 20 and peak < 8 << 20, peak  # the file, whole, is 21 MiB
    (_, row) = comp["runs"]
    assert row["steps"] == 2000 and row["problems"] == ["metrics.jsonl: 1 line skipped (not JSON objects, or longer "
                                                       "than 1 MiB)"]
    assert [m["step"] for m in metrics_by_step(big)][-1] == 1999 and "pad" not in metrics_by_step(big)[-1]


def test_helpers():
    assert sparkline([0, 1, 2, 3]) == "▁▃▆█"
    assert len(sparkline(list(range(100)), width=16)) == 16
    lo, hi = bootstrap_ci([1.0, 2.0, 3.0, 4.0])
    assert 1.0 <= lo < 2.5 < hi <= 4.0


@pytest.mark.e2e
def test_real_runs_plot_and_wandb_offline(tmp_path):
    """A sync and a rolloutpipe run, the second tracked by wandb offline; read back with wandb's
    own tool (wandb leet inspect --json): each step's metrics and samples table, and each
    evaluation of a held-out set at the step of the steps trained before it."""
    out = tmp_path / "runs"
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"prompt": f"max({i},2,7)=", "answer": str(max(i, 7))}) + "\n"
                               for i in range(6)))
    tracked = ["tracking.wandb.mode=offline", "tracking.wandb.tags=[ci]", "eval.every=2",
               f"eval.sets=[{{path: {heldout}, samples: 2}}]"]
    for mode, extra in (("sync", []), ("rolloutpipe", tracked)):
        res = rlctl("launch", str(QUICKSTART), *FAST, "run.steps=4", f"pipeline.mode={mode}", f"run.output_dir={out}",
                    *extra, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
    a, b = sorted(out.iterdir(), key=lambda p: json.loads((p / "run.json").read_text())["mode"] != "sync")
    png = tmp_path / "compare.png"
    res = rlctl("compare", str(a), str(b), "--plot", str(png), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "config: 5 of" in res.stdout and "pipeline.mode" in res.stdout and "tracking.wandb.mode" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000

    info = json.loads((b / "run.json").read_text())
    assert info["code"]["commit"] and info["tracking"]["wandb"]["id"] == b.name
    (log,) = b.glob("wandb/offline-run-*/run-*.wandb")
    res = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)], capture_output=True,
                         text=True, timeout=120)
    records = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    (run,) = [r for r in records if r["type"] == "run"]
    config = run["run"]["config"]["update"]
    assert config["pipeline"]["mode"] == "rolloutpipe" and config["rollout"]["group_size"] == 4
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    history = [h for h in rows if "reward_mean" in h]
    metrics = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == len(metrics) == 4
    evals = [json.loads(line) for line in (b / "eval.jsonl").read_text().splitlines()]
    assert {h["_step"]: h["eval/heldout/pass@2"] for h in rows if "eval/heldout/pass@2" in h} == \
        {e["steps"]: e["pass@2"] for e in evals} and [e["steps"] for e in evals] == [0, 2, 4]
    for h, m in zip(history, metrics):
        assert h["_step"] == m["step"] and h["reward_mean"] == pytest.approx(m["reward_mean"])
        assert h["samples._type"] == "table-file" and h["samples.ncols"] == 12
        assert h["rollout_to_train_end"] == pytest.approx(m["rollout_to_train_end"])
    # samples.jsonl's lines, each in one step's table (run.sample_groups: 2 groups of 4 a step)
    assert sum(h["samples.nrows"] for h in history) == len((b / "samples.jsonl").read_text().splitlines()) == 32
    res = rlctl("status", b.name, "--runs-dir", str(out), cwd=tmp_path)
    assert "wandb (offline): run " + b.name in res.stdout
