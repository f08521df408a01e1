"""A pool on Slurm without a cluster: the pool's batch script (shellcheck), the pool file's Slurm
errors, and the port book that gives each run its ports on the pool's nodes. The pool running on
the test cluster is tests/test_pool_slurm.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import QUICKSTART, REPO
from rlctl.recipe import load_recipe

PYTHON = "/shared/venvs/rl/bin/python"


@pytest.mark.process
def test_pool_batch_script_runs_the_service_on_the_first_node_and_passes_shellcheck(tmp_path):
    from rlctl.launchers.pool.slurm import render_pool_script
    from rlctl.recipe.load import load_pool_file

    spec = load_pool_file(REPO / "recipes" / "pool" / "slurm.yaml",
                          ["pool.devices.kind=cuda", "pool.devices.count=4", "pool.slurm.partition=gpu",
                           "pool.slurm.sbatch_args=[--exclusive]", "pool.slurm.setup=[module load cuda]"])
    text = render_pool_script(spec, Path("/shared/pools/slurm"), PYTHON)
    headers = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    for flag in ("--nodes=2", "--gpus-per-node=2", "--partition=gpu", "--exclusive", "--time=04:00:00",
                 "--output=/shared/pools/slurm/logs/pool.log", "--no-requeue"):
        assert f"#SBATCH {flag}" in headers, (flag, headers)
    assert "module load cuda\n" in text
    assert text.rstrip().endswith('exec "$PY" -m rlctl.launchers.pool.service --pool-dir /shared/pools/slurm')
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is not installed (scripts/run-tests.sh installs it)")
        pytest.skip("shellcheck is not installed")
    script = tmp_path / "pool.sbatch"
    script.write_text(text)
    res = subprocess.run(["shellcheck", "--severity=style", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


@pytest.mark.parametrize("overrides, key, words", [
    (["pool.devices.count=3"], "pool.devices.count", "spread evenly over slurm.nodes=2"),
    (["pool.devices.kind=cuda", "pool.devices.gpus=[0,1]"], "pool.devices.gpus", "Slurm gives each node"),
    (["pool.slurm.time=soon"], "pool.slurm.time", "not a Slurm time limit"),
    (["pool.slurm.sbatch_args=[--nodes=4]"], "pool.slurm.sbatch_args[0]", "set by rlctl"),
    (["pool.launcher=pool"], "pool.launcher", "local or slurm"),
    (["pool.slurm.port_base=80"], "pool.slurm.port_base", "1024..60000"),
])
def test_slurm_pool_file_errors_name_the_key(overrides, key, words):
    from rlctl.errors import RecipeError
    from rlctl.recipe.load import load_pool_file

    with pytest.raises(RecipeError) as info:
        load_pool_file(REPO / "recipes" / "pool" / "slurm.yaml", overrides)
    assert info.value.key == key and words in str(info.value), str(info.value)


@pytest.mark.process
def test_a_slurm_pool_gives_each_run_ports_of_its_own_on_each_node_and_takes_them_back():
    from rlctl.launchers.pool.slurm import PortBook
    from rlctl.process.topology import local_topology

    plan = local_topology(load_recipe(QUICKSTART, check_paths=False))  # two servers, one trainer rank
    nodes = {"rollout-0": "n1", "rollout-1": "n2", "trainer-0": "n1"}
    book = PortBook(21000)
    a = book.replan(plan, "a", nodes)
    assert [(r.host, r.port) for r in a.rollout] == [("n1", 21000), ("n2", 21000)]
    assert (a.trainers[0].host, a.trainers[0].port, a.trainer_dist_port, a.weight_sync_port) == ("n1", 21001, 21002, 21003)
    assert a.trainer_url == "http://n1:21001" and a.controller == plan.controller
    b = book.replan(plan, "b", {"rollout-0": "n2", "rollout-1": "n1", "trainer-0": "n2"})
    assert [(r.host, r.port) for r in b.rollout] == [("n2", 21001), ("n1", 21004)]
    assert (b.trainers[0].port, b.trainer_dist_port, b.weight_sync_port) == (21002, 21003, 21004)
    book.give_back("a")
    assert book.replan(plan, "c", nodes).server_urls == a.server_urls  # a's ports, free again
