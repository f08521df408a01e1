"""`rlctl sweep`: a grid of real runs under one sweep id, and status and compare over it."""

from __future__ import annotations

import json

import pytest

from conftest import FAST, QUICKSTART, rlctl, rlctl_here
from rlctl.errors import UsageError
from rlctl.run.sweep import parse_grid, points, split_values

ONE_STEP = [o for o in FAST if not o.startswith("run.steps=")] + ["run.steps=1"]  # a sweep's mechanics, not learning


def test_the_grid_is_the_product_of_the_values_and_seeds():
    grid, fixed = parse_grid(["train.lr=1e-4,3e-4", "rollout.cpus=[0,1],[1]", "run.steps=3"], seeds=2)
    assert grid == [("train.lr", ["1e-4", "3e-4"]), ("rollout.cpus", ["[0,1]", "[1]"]), ("run.seed", ["0", "1"])]
    assert fixed == ["run.steps=3"]  # one value: an override every point shares
    grid_points = points(grid)
    assert len(grid_points) == 8 and grid_points[0] == {"train.lr": "1e-4", "rollout.cpus": "[0,1]", "run.seed": "0"}
    assert grid_points[-1] == {"train.lr": "3e-4", "rollout.cpus": "[1]", "run.seed": "1"}
    assert split_values("{a: 1, b: 2},x") == ["{a: 1, b: 2}", "x"]


@pytest.mark.parametrize("args, seeds, says", [
    (["train.lr"], 0, "is not KEY=VALUE"),
    (["train.lr=1,2", "train.lr=3"], 0, "given twice"),
    (["train.lr=1,,2"], 0, "empty value"),
    (["run.seed=1,2"], 2, "not both"),
    ([f"k{i}=1,2" for i in range(11)], 0, "2048 points"),
])
def test_a_bad_grid_is_refused(args, seeds, says):
    with pytest.raises(UsageError, match=says):
        parse_grid(args, seeds)


def test_a_bad_point_stops_the_sweep_before_anything_starts(tmp_path):
    res = rlctl_here("sweep", str(QUICKSTART), "train.lr=1e-4,-1", f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "sweep point train.lr=-1" in res.stderr and "train.lr" in res.stderr
    assert not (tmp_path / "runs").exists()  # no run, no sweep record


@pytest.mark.e2e
def test_a_local_sweep_of_two_values(tmp_path):
    """Two points run at once (--seeds multiplies the grid: test_the_grid_is_the_product_of_the_values_and_seeds)."""
    runs = tmp_path / "runs"
    res = rlctl("sweep", str(QUICKSTART), "train.lr=1e-4,3e-4", "--parallel", "2", *ONE_STEP,
                f"run.output_dir={runs}", cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stderr
    sweep_id = res.stdout.strip()
    assert sweep_id.startswith("sweep-quickstart-") and res.stderr.count("point ") == 2
    status = json.loads(rlctl("status", sweep_id, "--runs-dir", str(runs), "--json", cwd=tmp_path).stdout)
    assert [p["values"] for p in status["points"]] == [{"train.lr": lr} for lr in ("1e-4", "3e-4")]
    assert [p["run"]["state"] for p in status["points"]] == ["completed"] * 2
    text = rlctl("status", sweep_id, "--runs-dir", str(runs), cwd=tmp_path).stdout
    assert "2 runs of" in text and "(2 completed)" in text
    comp = json.loads(rlctl("compare", sweep_id, "--runs-dir", str(runs), "--group-by", "train.lr", "--json",
                            cwd=tmp_path).stdout)
    assert [(g["value"], g["n"]) for g in comp["groups"]["groups"]] == [(0.0001, 1), (0.0003, 1)]
    assert len(comp["runs"]) == 2


@pytest.mark.slurm
@pytest.mark.skipif(not __import__("os").environ.get("RLCTL_SLURM_TESTS"), reason="no Slurm test cluster")
def test_a_slurm_sweep_is_one_job_per_point(tmp_path):
    """On the 3-node test cluster: every point is submitted at once as its own heterogeneous job,
    and Slurm's queue runs them (one at a time here: each takes 2 of the 3 nodes)."""
    from conftest import wait_for

    res = rlctl("sweep", str(QUICKSTART), "train.lr=1e-4,3e-4", *ONE_STEP, "rollout.servers=1",
                "launcher=slurm", "slurm.time=10:00", "slurm.health_timeout_s=120", f"run.output_dir={tmp_path}",
                cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    sweep_id = res.stdout.strip()
    assert res.stderr.count("(Slurm job ") == 2  # submitted at once, not one after the other

    def points():
        out = rlctl("status", sweep_id, "--runs-dir", str(tmp_path), "--json", cwd=tmp_path)
        return json.loads(out.stdout)["points"]
    try:
        wait_for(lambda: all(p["run"]["state"] in ("completed", "failed", "cancelled") for p in points()), 900,
                 "every run of the sweep to end")
    finally:
        for p in points():
            job = (p["run"] or {}).get("slurm") or {}
            if job.get("job_id"):
                __import__("subprocess").run(["scancel", str(job["job_id"])], capture_output=True)
    assert [p["run"]["state"] for p in points()] == ["completed"] * 2
    comp = json.loads(rlctl("compare", sweep_id, "--runs-dir", str(tmp_path), "--group-by", "train.lr", "--json",
                            cwd=tmp_path).stdout)
    assert [(g["value"], g["n"]) for g in comp["groups"]["groups"]] == [(0.0001, 1), (0.0003, 1)]
