"""launcher=slurm without a cluster: the rendered batch script (golden files, shellcheck), the
in-job plan, recipe validation, --dry-run, and the errors when Slurm is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import FAST, QUICKSTART, REPO, rlctl
from rlctl.launchers.slurm import JobInfo, render_batch_script
from rlctl.plan import slurm_plan
from rlctl.recipe import load_recipe

GOLDEN = REPO / "tests" / "golden" / "slurm"
RUN_DIR = Path("/shared/runs/RUN-ID")
PYTHON = "/shared/venvs/rl/bin/python"
CASES = {
    # name: (recipe, overrides)
    "quickstart-1x1": (QUICKSTART, ["launcher=slurm", "rollout.servers=1"]),
    "cluster-2x4": (GOLDEN / "cluster-2x4.yaml", []),
    "options": (GOLDEN / "options.yaml", []),
    "example-qwen3-1.7b": (REPO / "recipes" / "slurm-qwen3-1.7b.yaml", []),  # the README's cluster example
}


def render(name: str) -> str:
    recipe_file, overrides = CASES[name]
    r = load_recipe(recipe_file, overrides, check_paths=False)
    return render_batch_script(r, RUN_DIR, "RUN-ID", r.slurm.python or PYTHON)


@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_script_matches_golden_file(name):
    """To accept a deliberate change: RLCTL_UPDATE_GOLDEN=1 pytest tests/test_slurm_render.py, then
    read the diff."""
    text = render(name)
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("RLCTL_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_batch_script_structure():
    text = render("cluster-2x4")
    head, _, rest = text.partition("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=2" in head and "#SBATCH --ntasks-per-node=8" in head and "--gpus-per-node=8" in head
    assert "#SBATCH --nodes=4" in rest and "#SBATCH --ntasks-per-node=2" in rest
    for part in (head, rest):
        assert "#SBATCH --job-name=RUN-ID" in part
        assert "#SBATCH --partition=gpu" in part and "#SBATCH --account=rl-team" in part and "#SBATCH --qos=high" in part
    assert "#SBATCH --output=/shared/runs/RUN-ID/logs/slurm-%j.out" in head
    assert 'RLCTL_LOGS="$RUN_DIR/logs/attempt-${SLURM_RESTART_COUNT:-0}"' in text
    assert 'SLURM_JOB_NODELIST_HET_GROUP_0' in text and 'SLURM_JOB_NODELIST_HET_GROUP_1' in text
    # servers before trainers, and every process is `python -m rlctl.worker ROLE`
    servers = text.index("srun --het-group=1 --nodes=4 --ntasks=8 --ntasks-per-node=2")
    trainers = text.index("srun --het-group=0 --nodes=2 --ntasks=16 --ntasks-per-node=8")
    assert servers < text.index("until rlctl_step health") < trainers
    assert text.count("-m rlctl.worker") == 4  # rlctl_step, rollout, trainer, controller
    assert text.count("--kill-on-bad-exit=1") == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_script_passes_shellcheck(name, tmp_path):
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is not installed (scripts/run-tests.sh installs it)")
        pytest.skip("shellcheck is not installed")
    script = tmp_path / f"{name}.sbatch"
    script.write_text(render(name))
    res = subprocess.run(["shellcheck", "--severity=style", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_test_cluster_script_passes_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    res = subprocess.run(["shellcheck", str(REPO / "scripts" / "slurm-test-cluster.sh"),
                          str(REPO / "scripts" / "run-tests.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_plan_places_servers_and_ranks_on_their_nodes():
    r = load_recipe(GOLDEN / "cluster-2x4.yaml", check_paths=False)
    plan = slurm_plan(r, ["t1", "t2"], ["r1", "r2", "r3", "r4"], 30000)
    assert [(s.host, s.port) for s in plan.rollout] == [
        ("r1", 30000), ("r1", 30001), ("r2", 30000), ("r2", 30001),
        ("r3", 30000), ("r3", 30001), ("r4", 30000), ("r4", 30001)]
    assert all(s.listen == "0.0.0.0" for s in plan.rollout)
    assert [t.host for t in plan.trainers] == ["t1"] * 8 + ["t2"] * 8
    assert plan.trainer_url == "http://t1:30002" and plan.trainers[0].listen == "0.0.0.0"
    assert (plan.trainer_dist_port, plan.weight_sync_port) == (30003, 30004)
    assert plan.controller.host == "t1"
    with pytest.raises(ValueError, match="need 4 nodes"):
        slurm_plan(r, ["t1", "t2"], ["r1", "r2", "r3"], 30000)


@pytest.mark.parametrize("override, key", [
    ("slurm.time=soon", "slurm.time"),
    ("slurm.rollout.nodes=3", "slurm.rollout.nodes"),
    ("slurm.rollout.servers_per_node=3", "slurm.rollout.servers_per_node"),
    ("slurm.trainer.nodes=2", "slurm.trainer.nodes"),  # 1 rank does not spread over 2 nodes
    ("slurm.partition='gpu; rm -rf /'", "slurm.partition"),
    ("slurm.sbatch_args=[exclusive]", "slurm.sbatch_args[0]"),
    ("slurm.sbatch_args=[--job-name=x]", "slurm.sbatch_args[0]"),
    ("slurm.port_base=80", "slurm.port_base"),
    ("slurm.gpus=8", "slurm.gpus"),
    ("slurm.trainer.gpus_per_node=two", "slurm.trainer.gpus_per_node"),
])
def test_bad_slurm_settings_name_the_key(tmp_path, override, key):
    res = rlctl("launch", str(QUICKSTART), "launcher=slurm", override, f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f": {key}: " in lines[0], res.stderr
    assert not list(tmp_path.iterdir())  # no run directory


def test_dry_run_writes_and_prints_the_script_and_submits_nothing(tmp_path):
    # No Slurm commands on PATH at all: a dry run must not need them.
    env = {"PATH": os.path.dirname(os.sys.executable)}
    res = rlctl("launch", str(QUICKSTART), "launcher=slurm", "--dry-run", f"run.output_dir={tmp_path}", *FAST,
                cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    (run_dir,) = tmp_path.iterdir()
    script = (run_dir / "job.sbatch").read_text()
    assert res.stdout == script
    assert f"#SBATCH --job-name={run_dir.name}" in script and str(run_dir) in script
    info = json.loads((run_dir / "run.json").read_text())
    assert info["state"] == "dry-run" and "job_id" not in info["slurm"]


def test_missing_slurm_is_a_one_line_runtime_error(tmp_path):
    env = {"PATH": os.path.dirname(os.sys.executable)}  # python, but no sbatch
    res = rlctl("launch", str(QUICKSTART), "launcher=slurm", f"run.output_dir={tmp_path}", *FAST, cwd=tmp_path, env=env)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "sbatch not found" in lines[0], res.stderr
    (run_dir,) = tmp_path.iterdir()
    info = json.loads((run_dir / "run.json").read_text())
    assert info["state"] == "failed" and "not submitted" in info["exit_reason"]


def test_job_states_in_words():
    assert JobInfo("7", "PENDING", "Resources").describe() == "PENDING: waiting for nodes to free up"
    assert JobInfo("7", "PENDING", "QOSMaxGRESPerUser").describe() == "PENDING: you are at your QOS's GPU limit"
    running = JobInfo("7", "RUNNING", "None", "1:02", ["node1", "node[2-3]"])
    assert running.describe() == "RUNNING on node1 | node[2-3] for 1:02"
    assert JobInfo("7", "TIMEOUT", exit_code="0:15").describe() == "TIMEOUT (exit code 0:15)"


def _slurm_run(tmp_path, state: str, last_state: str | None):
    from rlctl.rundir import create_run_dir

    rd = create_run_dir(tmp_path, "r", "run: {}\n", {"launcher": "slurm", "mode": "sync", "steps_total": 3, "plan": None})
    last = None if last_state is None else JobInfo("7", last_state, "None", "0:05", ["node1", "node2"]).to_json()
    rd.update(lambda d: d.update(state=state, slurm={"job_id": "7", "last": last}))
    return rd


@pytest.mark.parametrize("slurm_state, run_state", [("TIMEOUT", "failed"), ("FAILED", "failed"), ("NODE_FAIL", "failed"),
                                                    ("CANCELLED", "cancelled")])
def test_a_job_that_ended_under_a_running_run_ends_the_run(tmp_path, slurm_state, run_state):
    from rlctl.launchers.slurm import needs_query, reconcile

    rd = _slurm_run(tmp_path, "running", "RUNNING")
    info = reconcile(rd, rd.read(), JobInfo("7", slurm_state, exit_code="0:15"), queried=True)
    assert info["state"] == run_state and f"Slurm job 7 ended {slurm_state}" in info["exit_reason"]
    assert info["slurm"]["last"]["state"] == slurm_state and not needs_query(info)


def test_a_finished_run_whose_job_slurm_forgot_is_not_asked_about_again(tmp_path):
    from rlctl.launchers.slurm import needs_query, reconcile

    rd = _slurm_run(tmp_path, "completed", "RUNNING")
    assert needs_query(rd.read())
    info = reconcile(rd, rd.read(), None, queried=True)
    assert info["state"] == "completed" and info["slurm"]["last"]["state"] == "ENDED" and not needs_query(info)
    running = _slurm_run(tmp_path, "running", "RUNNING")  # still going, and Slurm does not know it: failed
    info = reconcile(running, running.read(), None, queried=True)
    assert info["state"] == "failed" and "no longer known to Slurm" in info["exit_reason"]
