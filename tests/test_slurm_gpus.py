"""Which GPUs each task of a Slurm run takes, on the 3-node test cluster (scripts/slurm-test-cluster.sh:
4 fake GPUs a node, so Slurm sets CUDA_VISIBLE_DEVICES as on a GPU cluster), read from each
process's environment: servers sharing a node never share a GPU, and a colocated job puts each
trainer rank and its server on the same one."""

from __future__ import annotations

import contextlib
import re
import subprocess
from pathlib import Path

import pytest

from conftest import FAST, rlctl, wait_for
from test_slurm_cluster import _scancel_leftovers, launch, squeue_state, task_env  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.slurm


def test_servers_sharing_a_node_get_their_own_gpus(tmp_path):
    """Every node has 4 fake GPUs (gres, scripts/slurm-test-cluster.sh). Another job holds one GPU
    of every node, so the run's GPUs do not start at 0: each server must take its own among
    those Slurm gave its step, never a GPU another server or job holds."""
    blocker = subprocess.run(["sbatch", "--parsable", "--nodes=3", "--gpus-per-node=1", "--time=5:00",
                              f"--output={tmp_path}/blocker-%j.out", "--wrap=sleep 300"],
                             capture_output=True, text=True, check=True).stdout.strip()
    try:
        wait_for(lambda: squeue_state(blocker) == "RUNNING", 30, "the blocking job to run")
        detail = subprocess.run(["scontrol", "show", "job", "-d", blocker], capture_output=True, text=True).stdout
        held = {int(i) for i in re.findall(r"GRES=gpu:1\(IDX:(\d+)\)", detail)}
        assert len(held) == 1, detail  # the same GPU index on every node
        rd = launch(tmp_path, *FAST, "run.steps=400", "rollout.servers=2", "slurm.rollout.servers_per_node=2",
                    "slurm.rollout.gpus_per_node=3", detach=True)
        # A server's pid is in run.json as soon as it starts, with the environment it was started with.
        procs = wait_for(lambda: (p := rd.read()["processes"]) and {"rollout-0", "rollout-1"} <= set(p) and p, 120,
                         "both rollout servers to start")
        gpus = []
        for i in (0, 1):
            env = task_env(procs[f"rollout-{i}"]["pid"])
            mine = {int(g) for g in env["CUDA_VISIBLE_DEVICES"].split(",")}
            step = {int(g) for g in env["SLURM_STEP_GPUS"].split(",")}  # what Slurm gave the server's step
            assert len(step) == 1 and not step & held, (step, held)
            assert mine == step, (i, env["CUDA_VISIBLE_DEVICES"], step)  # one GPU per built-in server
            said = (Path(rd.read()["slurm"]["logs"]) / f"rollout-{i}.log").read_text()
            assert f"runs this server on GPUs {min(mine)} " in said, said
            gpus.append(mine)
        assert procs["rollout-0"]["host"] == procs["rollout-1"]["host"]
        assert not gpus[0] & gpus[1], gpus  # two servers of a node never share a GPU
        assert rlctl("cancel", rd.id, "--runs-dir", str(tmp_path), cwd=tmp_path).returncode == 0
    finally:
        subprocess.run(["scancel", blocker], capture_output=True)


def test_a_colocated_job_puts_each_trainer_rank_and_its_server_on_the_same_gpu_of_the_same_node(tmp_path):
    """colocate.enabled on 2 nodes of 2 (fake) GPUs: 4 trainer ranks and 4 built-in servers in one
    job, read from each process's environment: rank r and server r on one node and one GPU. The
    weights go over ipc, from every rank to the server beside it (weightsync/ipc_ranks.py): shared
    memory that only opens on the rank's own node, checked bit for bit at every sync."""
    rd = launch(tmp_path, *FAST, "run.steps=12", "colocate.enabled=true", "train.ranks=4", "rollout.servers=4",
                "slurm.trainer.nodes=2", "slurm.rollout.servers_per_node=2", "slurm.trainer.gpus_per_node=2",
                "slurm.trainer.cpus_per_task=1", "train.sync_backend=ipc", "pipeline.check_weights=true",
                detach=True)
    assert "hetjob" not in (rd.path / "job.sbatch").read_text()  # one component holds both
    roles = [f"{kind}-{i}" for kind in ("rollout", "trainer") for i in range(4)]
    placed: dict[str, tuple[str, str]] = {}

    def read_placement() -> bool:  # each process's node and GPU, while it runs
        for role, p in (rd.read().get("processes") or {}).items():
            if role in roles and role not in placed and p.get("pid"):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    placed[role] = (p["host"], task_env(p["pid"])["CUDA_VISIBLE_DEVICES"])
        return len(placed) == len(roles)

    wait_for(read_placement, 240, "every server and trainer rank to start")
    for i in range(4):
        assert placed[f"trainer-{i}"] == placed[f"rollout-{i}"], placed
    assert len({host for host, _ in placed.values()}) == 2, placed  # 2 ranks and their servers a node
    assert len(set(placed.values())) == 4, placed  # no two ranks share a GPU of a node
    wait_for(lambda: rd.read()["state"] in ("completed", "failed"), 400, "the run to end")
    info = rd.read()
    assert info["state"] == "completed", info.get("exit_reason")
    events = rd.events()
    checked = [e for e in events if e["event"] == "weights_checked"]
    assert len(checked) >= 12 and all(c["servers"] == 4 for c in checked)
    log = (Path(info["slurm"]["logs"]) / "trainer-0.log").read_text()
    assert "rollout-0 <- [0], rollout-1 <- [1], rollout-2 <- [2], rollout-3 <- [3]" in log
