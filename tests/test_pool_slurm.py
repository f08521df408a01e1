"""A pool on a Slurm allocation (pool file `launcher: slurm`) on scripts/slurm-test-cluster.sh's
nodes, each its own network namespace and hostname: `rlctl pool up` submits the pool's job, its
service answers on the first node's address, two runs launched here attach to it and their
engines run as steps of the pool's job on both nodes, a killed server step is started again, a
killed trainer step fails only its run, and `rlctl pool down` ends the job with nothing left
running."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import FAST, QUICKSTART, processes_mentioning, rejoined, rlctl, wait_for
from rlctl.run.dir import RunDir, read_jsonl

if not os.environ.get("RLCTL_SLURM_TESTS"):
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the Slurm tests: run scripts/run-tests.sh (it starts the test cluster)")
    pytest.skip("no Slurm test cluster (scripts/run-tests.sh starts one as root)", allow_module_level=True)

pytestmark = pytest.mark.slurm


def squeue_state(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


@pytest.fixture
def pool(tmp_path):
    spec = tmp_path / "pool.yaml"
    spec.write_text(f"""pool:
  name: sl
  launcher: slurm
  output_dir: {tmp_path / "pools"}
  devices: {{kind: cpu, count: 2, cpus_per_device: 1, memory_gb: 1.0}}
  quantum_s: 1.0
  slurm: {{nodes: 2, time: "10:00"}}
""")
    res = rlctl("pool", "up", str(spec), cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr
    path = tmp_path / "pools" / "sl"
    state = json.loads((path / "pool.json").read_text())
    try:
        yield path
    finally:
        res = rlctl("pool", "down", "sl", "--dir", str(tmp_path / "pools"), cwd=tmp_path)
        subprocess.run(["scancel", state["job_id"]], capture_output=True)  # a failed test leaves no job behind
        assert res.returncode == 0, res.stderr


def launch(tmp_path: Path, name: str, *overrides: str) -> RunDir:
    res = rlctl("launch", "--detach", str(QUICKSTART), *FAST, "launcher=pool", "pool.name=sl",
                f"pool.dir={tmp_path / 'pools'}", f"run.name={name}", f"run.output_dir={tmp_path / 'runs'}",
                *overrides, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return RunDir(tmp_path / "runs" / res.stdout.strip().splitlines()[-1])


def placed_node(rd: RunDir, role: str) -> str:
    return rd.read()["pool"]["placement"][role]["node"]


def ended(rd: RunDir) -> dict | None:
    info = rd.read()
    return info if info["state"] in ("completed", "failed", "cancelled") else None


def test_runs_attach_to_a_pool_on_slurm_and_their_engines_run_on_its_nodes(pool, tmp_path):
    state = json.loads((pool / "pool.json").read_text())
    job = state["job_id"]
    assert state["nodes"] == ["node1", "node2"] and state["url"].startswith("http://node1:")
    assert squeue_state(job) == "RUNNING"
    shown = rlctl("pool", "status", "--dir", str(tmp_path / "pools"), cwd=tmp_path)
    assert shown.returncode == 0 and "sl" in shown.stdout and " up " in shown.stdout, shown.stdout

    keeps = launch(tmp_path, "keeps", "run.steps=8", "run.seed=1")
    killed = launch(tmp_path, "killed", "run.steps=400", "pipeline.mode=async")
    wait_for(lambda: len(keeps.metrics()) >= 2 and len(killed.metrics()) >= 2, 240, "both runs to train")

    # Each engine is a step of the pool's job on the node of its device, listening there; the
    # plan the controllers read says so.
    for rd in (keeps, killed):
        info = rd.read()
        procs, plan = info["processes"], info["plan"]
        placed = info["pool"]["placement"]
        for role in ("rollout-0", "rollout-1", "trainer-0"):
            assert procs[role]["host"] == placed[role]["node"], (role, procs[role], placed[role])
            assert procs[role]["slurm_step"].startswith(f"{job}."), procs[role]
        assert {procs["rollout-0"]["host"], procs["rollout-1"]["host"]} == {"node1", "node2"}
        assert [r["host"] for r in plan["rollout"]] == [procs["rollout-0"]["host"], procs["rollout-1"]["host"]]
        assert plan["trainers"][0]["host"] == procs["trainer-0"]["host"]
    # Attached together, the two runs never share a port on a node.
    ports = [{(r["host"], r["port"]) for r in [*p["rollout"], p["trainers"][0]]} | {
        (p["trainers"][0]["host"], p["trainer_dist_port"]), (p["trainers"][0]["host"], p["weight_sync_port"])}
        for p in (keeps.read()["plan"], killed.read()["plan"])]
    assert not ports[0] & ports[1] and len(ports[0]) == len(ports[1]) == 5, ports

    # One run's server step killed on its node: the pool starts it again there, as a new step.
    step = killed.read()["processes"]["rollout-1"]["slurm_step"]
    subprocess.run(["scancel", "--signal=KILL", step], check=True, capture_output=True)
    wait_for(lambda: rejoined(killed, "rollout-1"), 120, "rollout-1 to rejoin")
    again = killed.read()["processes"]["rollout-1"]
    assert again["slurm_step"] != step and again["host"] == placed_node(killed, "rollout-1"), again
    # Its trainer's step killed: that run fails, saying which engine; the other goes on.
    step = killed.read()["processes"]["trainer-0"]["slurm_step"]
    subprocess.run(["scancel", "--signal=KILL", step], check=True, capture_output=True)
    info = wait_for(lambda: ended(killed), 60, "the killed run to end")
    assert info["state"] == "failed" and "trainer-0" in info["exit_reason"], info.get("exit_reason")
    info = wait_for(lambda: ended(keeps), 240, "the other run to end")
    assert info["state"] == "completed", info.get("exit_reason")
    metrics = keeps.metrics()
    assert [m["step"] for m in metrics] == list(range(8))
    optimizer_steps = [sum(m["train_batches"] for m in metrics[:k]) for k in range(8)]
    assert [m["weight_version_min"] for m in metrics] == optimizer_steps  # weights crossed nodes every step
    assert all(m["sync_bytes"] > 0 for m in metrics)
    usage = keeps.read()["pool"]["usage"]
    assert 0 < usage["used_device_s"] <= usage["dedicated_device_s"], usage

    events = read_jsonl(pool / "events.jsonl")
    assert {e["job"] for e in events if e["event"] == "job_detached"} == {keeps.id, killed.id}
    wait_for(lambda: not processes_mentioning(keeps.id) and not processes_mentioning(killed.id), 30,
             "the runs' engines to be gone")
    assert squeue_state(job) == "RUNNING"  # the pool outlives its runs


def test_pool_down_ends_the_pool_job_and_its_engines(pool, tmp_path):
    state = json.loads((pool / "pool.json").read_text())
    rd = launch(tmp_path, "cut", "run.steps=400")
    wait_for(lambda: len(rd.metrics()) >= 1, 240, "the run to train")
    res = rlctl("pool", "down", "sl", "--dir", str(tmp_path / "pools"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"Slurm job {state['job_id']} COMPLETED" in res.stdout, res.stdout
    info = wait_for(lambda: ended(rd), 60, "the run to end")
    assert info["state"] == "failed" and "shut down" in info["exit_reason"], info.get("exit_reason")
    assert json.loads((pool / "pool.json").read_text())["state"] == "down"
    wait_for(lambda: not processes_mentioning(rd.id) and not processes_mentioning(str(pool)), 30,
             "the pool's processes to be gone")
    shown = rlctl("pool", "status", "sl", "--dir", str(tmp_path / "pools"), cwd=tmp_path)
    assert shown.returncode == 0 and "COMPLETED" in shown.stdout, shown.stdout


def test_a_pool_that_slurm_refuses_says_why_in_one_line(tmp_path):
    spec = tmp_path / "pool.yaml"
    spec.write_text(f"pool: {{name: bad, launcher: slurm, output_dir: {tmp_path / 'pools'}, "
                    "slurm: {nodes: 2, partition: nosuch}}\n")
    res = rlctl("pool", "up", str(spec), cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "sbatch" in lines[0] and "partition" in lines[0].lower(), res.stderr
    assert json.loads((tmp_path / "pools" / "bad" / "pool.json").read_text())["state"] == "failed"
