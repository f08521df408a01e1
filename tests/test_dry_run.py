"""`rlctl launch --dry-run`: the batch script a Slurm run would get, printed, and nothing else: no
run directory on the cluster's path, nothing submitted, and no wandb needed on the submitting
machine when the job's nodes are the ones that log."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import FAST, QUICKSTART, REPO, rlctl_here
from rlctl.errors import RecipeError
from rlctl.recipe import load_recipe, recipe_to_yaml
from rlctl.run.dir import RunDir, create_run_dir

CLUSTER = REPO / "recipes" / "slurm-qwen3-1.7b.yaml"  # names /shared paths and logs to wandb online


@pytest.fixture
def no_wandb(monkeypatch):
    """wandb as if it were not installed here: a None in sys.modules makes find_spec say so."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert importlib.util.find_spec("wandb") is None


def test_a_dry_run_prints_the_script_and_leaves_nothing_behind(tmp_path):
    cluster_runs = tmp_path / "shared" / "runs"
    res = rlctl_here("launch", str(QUICKSTART), "launcher=slurm", "--dry-run", f"run.output_dir={cluster_runs}", *FAST,
                     cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "shared").exists() and list(tmp_path.iterdir()) == []  # not even the output directory
    job = next(line for line in res.stdout.splitlines() if line.startswith("#SBATCH --job-name="))
    run_dir = cluster_runs.resolve() / job.removeprefix("#SBATCH --job-name=")
    assert res.stdout.startswith("#!/bin/bash\n") and f"#SBATCH --output={run_dir}/logs/slurm-%j.out" in res.stdout
    assert res.stderr.strip() == f"dry run: nothing written, nothing submitted (the run would be {run_dir})"


def test_a_dry_run_of_a_cluster_recipe_needs_no_wandb_here(tmp_path, no_wandb):
    res = rlctl_here("launch", str(CLUSTER), "--dry-run", f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "#SBATCH hetjob" in res.stdout and not (tmp_path / "runs").exists()


def test_a_run_whose_controller_logs_here_needs_wandb_here(no_wandb):
    """launcher=local (and pool) runs the controller, which logs to wandb, on this machine."""
    for launcher in ("local", "pool"):
        with pytest.raises(RecipeError, match=r": tracking\.wandb\.mode: wandb is not installed: pip install"):
            load_recipe(QUICKSTART, [f"launcher={launcher}", "pool.name=p", "tracking.wandb.mode=offline"],
                        check_paths=False)
    assert load_recipe(QUICKSTART, ["launcher=slurm", "tracking.wandb.mode=offline"]).tracking.wandb.mode == "offline"


def test_a_slurm_job_without_wandb_on_its_first_node_fails_saying_so(tmp_path, no_wandb):
    """The job's first step (it runs the controller's node) looks for wandb as it looks for the
    model: a run that would log nowhere ends at once, naming the key and the node."""
    from rlctl.launchers.slurm.steps import write_plan

    r = load_recipe(QUICKSTART, ["launcher=slurm", "tracking.wandb.mode=online", *FAST])
    rd = create_run_dir(tmp_path, r.run.name, recipe_to_yaml(r), {"launcher": "slurm", "plan": None})
    assert write_plan(rd, ["t1"], ["r1", "r2"], 30000) == 1
    info = RunDir(rd.path).read()
    assert info["state"] == "failed" and info["plan"] is None
    assert info["exit_reason"].startswith("tracking.wandb.mode: wandb is not installed")
    assert info["exit_reason"].endswith("the job's first node)")
