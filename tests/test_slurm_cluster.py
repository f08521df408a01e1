"""launcher=slurm on a real multi-node Slurm: scripts/slurm-test-cluster.sh's 3 nodes, each in
its own network namespace with its own hostname (scripts/run-tests.sh starts it and sets
RLCTL_SLURM_TESTS=1). The run's trainer lands on one node and its two rollout servers on the two
others, so the weight broadcast and every HTTP call cross hosts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import FAST, QUICKSTART, processes_mentioning, rejoined, rlctl, wait_for
from rlctl.run.checkpoint import list_checkpoints
from rlctl.run.dir import RunDir

if not os.environ.get("RLCTL_SLURM_TESTS"):
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the Slurm tests: run scripts/run-tests.sh (it starts the test cluster)")
    pytest.skip("no Slurm test cluster (scripts/run-tests.sh starts one as root)", allow_module_level=True)

pytestmark = pytest.mark.slurm
SLURM = ["launcher=slurm", "slurm.time=10:00", "slurm.health_timeout_s=120"]


@pytest.fixture(autouse=True)
def _scancel_leftovers(tmp_path):
    """A failed test must not leave its job queued: a pending 5-node job would hold up the next."""
    yield
    for run_json in tmp_path.glob("*/run.json"):
        job_id = (json.loads(run_json.read_text()).get("slurm") or {}).get("job_id")
        if job_id:
            subprocess.run(["scancel", job_id], capture_output=True)


def launch(tmp_path: Path, *overrides: str, detach: bool) -> RunDir:
    args = ["launch", str(QUICKSTART), *SLURM, f"run.output_dir={tmp_path}", *overrides]
    res = rlctl(*args, *(["--detach"] if detach else []), cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return RunDir(tmp_path / res.stdout.strip().splitlines()[-1])


def scontrol(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
    first = out.splitlines()[0]  # component 0 of the het job
    return dict(item.split("=", 1) for item in first.split() if "=" in item)


def squeue_state(job_id: str) -> str | None:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i|%T"], capture_output=True, text=True).stdout
    states = {line.split("|")[1] for line in out.splitlines() if "|" in line}
    return states.pop() if len(states) == 1 else None


def status_json(tmp_path: Path, run_id: str) -> dict:
    res = rlctl("status", run_id, "--json", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_run_spans_three_nodes_and_learns(tmp_path):
    # 20 steps: the quickstart's reward barely moves in its first dozen steps (about 0.25 to 0.3,
    # within step-to-step noise) and climbs after that.
    rd = launch(tmp_path, "run.steps=20", detach=False)
    info = rd.read()
    assert info["state"] == "completed", info.get("exit_reason")
    hosts = {role: p["host"] for role, p in info["processes"].items()}
    assert hosts["trainer-0"] not in (hosts["rollout-0"], hosts["rollout-1"])
    assert hosts["rollout-0"] != hosts["rollout-1"]
    assert hosts["trainer-0"] == hosts["controller"] == info["slurm"]["batch_host"]
    assert {hosts["trainer-0"], hosts["rollout-0"], hosts["rollout-1"]} == {"node1", "node2", "node3"}
    plan = info["plan"]
    assert [s["host"] for s in plan["rollout"]] == [hosts["rollout-0"], hosts["rollout-1"]]

    # Weights crossed hosts after every step: the servers generated step k with the version the
    # trainer had after all optimizer steps before it.
    metrics = rd.metrics()
    assert len(metrics) == 20
    optimizer_steps = [sum(m["train_batches"] for m in metrics[:k]) for k in range(20)]
    assert [m["weight_version_min"] for m in metrics] == optimizer_steps
    assert [m["weight_version_max"] for m in metrics] == optimizer_steps
    assert all(m["sync_bytes"] > 0 for m in metrics)
    # The bar sits below the seeds' spread: over seeds 0-2 of the quickstart (results/quickstart.json,
    # scripts/bench_quickstart.py) the mean of steps 15-19 is 0.137-0.165 above that of steps 0-4.
    first = sum(m["reward_mean"] for m in metrics[:5]) / 5
    last = sum(m["reward_mean"] for m in metrics[-5:]) / 5
    assert last > first + 0.08, (first, last)

    # status agrees with Slurm after the end
    job_id = info["slurm"]["job_id"]
    wait_for(lambda: squeue_state(job_id) == "COMPLETED", 30, "the job to be COMPLETED")
    st = status_json(tmp_path, rd.id)
    assert st["state"] == "completed"
    assert st["slurm"]["state"] == scontrol(job_id)["JobState"] == "COMPLETED"
    assert st["slurm"]["exit_code"] == scontrol(job_id)["ExitCode"] == "0:0"
    assert processes_mentioning(rd.id) == []
    res = rlctl("logs", rd.id, "rollout-1", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0 and "rollout" in res.stdout


def test_killed_and_frozen_rollout_servers_are_restarted_on_their_nodes_and_the_run_completes(tmp_path):
    """Each server is its own srun step. SIGKILL of rollout-1 ends only its step, and the batch
    script starts it again on the same node. SIGSTOP of rollout-0: its /health stops answering,
    after rollout.stall_timeout_s the controller takes it out and SIGKILLs its step (scancel
    --signal=KILL), which the batch script starts again. Meanwhile the other server gets the
    requests; each comes back and gets the weights; every step is trained once."""
    steps = 100  # of the quickstart's (about 0.5 s each): both servers are back long before the end
    rd = launch(tmp_path, f"run.steps={steps}", "rollout.stall_timeout_s=5", detach=True)
    job_id = rd.read()["slurm"]["job_id"]
    wait_for(lambda: len(rd.metrics()) >= 3, 120, "three steps")

    # While running, status agrees with squeue / scontrol.
    st = status_json(tmp_path, rd.id)
    sc = scontrol(job_id)
    assert st["state"] == "running"
    assert st["slurm"]["state"] == squeue_state(job_id) == sc["JobState"] == "RUNNING"
    assert st["slurm"]["nodes"][0] == sc["NodeList"]

    def restarted(role: str, old: dict) -> dict:
        back = wait_for(lambda: (p := rd.read()["processes"][role])["pid"] != old["pid"] and p, 60,
                        f"{role} to be started again")
        assert back["host"] == old["host"] and back["slurm_step"] != old["slurm_step"]  # its node, a new step
        wait_for(lambda: rejoined(rd, role), 60, f"{role} to rejoin")
        return back

    killed = rd.read()["processes"]["rollout-1"]
    os.kill(killed["pid"], signal.SIGKILL)
    restarted("rollout-1", killed)
    frozen = rd.read()["processes"]["rollout-0"]
    assert re.fullmatch(r"\d+\.\d+", frozen["slurm_step"]), frozen
    os.kill(frozen["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    wait_for(lambda: any(e["event"] == "server_lost" and e["server"] == "rollout-0" for e in rd.events()), 30,
             "the stall to be seen")
    assert time.monotonic() - stopped < 5 + 10  # the timeout, plus a probe interval and the event's flush
    restarted("rollout-0", frozen)

    wait_for(lambda: rd.read()["state"] in ("completed", "failed"), 300, "the run to end")
    assert rd.read()["state"] == "completed", rd.read().get("exit_reason")
    events = rd.events()
    lost = {e["server"]: e["reason"] for e in events if e["event"] == "server_lost"}
    assert set(lost) == {"rollout-0", "rollout-1"} and "/health" in lost["rollout-0"], lost
    restarts = [(e["role"], e["attempt"]) for e in events if e["event"] == "server_restarted"]
    assert sorted(restarts) == [("rollout-0", 1), ("rollout-1", 1)], restarts
    assert [m["step"] for m in rd.metrics()] == list(range(steps))
    trained = [g for e in events if e["event"] == "train_start" for g in e["groups"]]
    assert len(trained) == len(set(trained))  # no group trained twice
    wait_for(lambda: not processes_mentioning(rd.id), 30, "every process of the run to exit")


def test_cancel_leaves_no_process_on_any_node_and_resume_submits_again(tmp_path):
    rd = launch(tmp_path, "run.steps=400", "run.save_every=3", *FAST[1:], detach=True)
    job_id = rd.read()["slurm"]["job_id"]
    wait_for(lambda: list_checkpoints(rd.path), 120, "the first checkpoint")
    assert processes_mentioning(rd.id)
    res = rlctl("cancel", rd.id, "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    # cancel returns once Slurm says the job ended: by then every step on every node is gone.
    assert processes_mentioning(rd.id) == []
    assert squeue_state(job_id) == scontrol(job_id)["JobState"] == "CANCELLED"
    st = status_json(tmp_path, rd.id)
    assert st["state"] == "cancelled" and st["slurm"]["state"] == "CANCELLED"

    # rlctl resume submits the batch script again; the new job continues from the newest checkpoint.
    ckpt = list_checkpoints(rd.path)[-1]
    res = rlctl("resume", rd.id, "--runs-dir", str(tmp_path), "--detach", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    new_job = rd.read()["slurm"]["job_id"]
    assert new_job != job_id
    # (metrics.jsonl still holds the cancelled attempt's steps until the new job trims it: wait for its start)
    wait_for(lambda: any(e["event"] == "run_start" and e.get("resumed_from") == ckpt.steps for e in rd.events())
             and len(rd.metrics()) > ckpt.steps + 1, 120, "steps of the new job")
    assert rlctl("cancel", rd.id, "--runs-dir", str(tmp_path), cwd=tmp_path).returncode == 0
    attempts = status_json(tmp_path, rd.id)["attempts"]
    assert [(a["attempt"], a["resumed_from"], a["slurm_job"], a["state"]) for a in attempts] == [
        (1, None, job_id, "cancelled"), (2, ckpt.steps, new_job, "cancelled")]
    steps = [m["step"] for m in rd.metrics()]
    assert steps == list(range(len(steps)))  # the steps after the checkpoint once, not twice
    assert (rd.logs / "attempt-2" / "controller.log").is_file()


@contextlib.contextmanager
def released_when_requeued(job_id: str):
    """Slurm holds a requeued job until a begin time about two minutes on (reason BeginTime); the
    job's own requeue is what is tested, not that wait, so the test lets it start early. Not in
    the requeue's own second: slurmd revokes the old attempt's credential with a timestamp of whole
    seconds, and a new attempt started within it is killed ("Job credential revoked")."""
    done = threading.Event()
    released: list[str] = []
    held_since: list[float] = []

    def watch() -> None:
        while not done.wait(1.0):
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True).stdout
            if not any(line.startswith("PENDING|BeginTime") for line in out.splitlines()):
                held_since.clear()
                continue
            held_since[:] = held_since or [time.monotonic()]
            if time.monotonic() - held_since[0] >= 3.0:
                res = subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True,
                                     text=True)
                released.append(res.stderr.strip() or "ok")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield released
    finally:
        done.set()
        thread.join()


@pytest.mark.timeout(600)
def test_a_preempted_job_checkpoints_requeues_and_resumes_until_the_run_completes(tmp_path):
    """Slurm's warning before a time limit is SIGUSR1 to the batch shell (#SBATCH --signal=B:USR1@N,
    tests/test_slurm_render.py); `scancel --signal=USR1 --batch` sends that same signal now, so
    the test preempts the job twice when it chooses instead of waiting out two time limits. Each
    attempt checkpoints, the job requeues itself (the same job id, Slurm's restart count up by one),
    and the next attempt resumes from the checkpoint; every step is trained once."""
    steps = 24
    rd = launch(tmp_path, f"run.steps={steps}", "rollout.batch_size=32", detach=True)
    job_id = rd.read()["slurm"]["job_id"]

    def starts() -> list[dict]:
        return [e for e in rd.events() if e["event"] == "run_start"]

    def preempt_after(attempt: int, more_steps: int) -> None:
        """Once attempt `attempt` has run `more_steps` steps of its own, warn its batch shell."""
        def progressed():
            if len(starts()) < attempt or rd.read()["state"] in ("completed", "failed", "cancelled"):
                return False
            return len(rd.metrics()) >= (starts()[-1].get("resumed_from") or 0) + more_steps
        wait_for(progressed, 300, f"attempt {attempt} to run {more_steps} steps")
        res = subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr

    with released_when_requeued(job_id):
        preempt_after(1, 4)
        preempt_after(2, 4)
        wait_for(lambda: rd.read()["state"] in ("completed", "failed", "cancelled"), 300, "the run to end")
    info = rd.read()
    assert info["state"] == "completed", info.get("exit_reason")
    attempts = status_json(tmp_path, rd.id)["attempts"]
    assert len(attempts) == 3, attempts
    assert [a["slurm_job"] for a in attempts] == [job_id] * 3
    assert [a["slurm_restart"] for a in attempts] == [0, 1, 2]
    assert [a["state"] for a in attempts] == ["requeued", "requeued", "completed"]
    resumed = [a["resumed_from"] for a in attempts]
    chain = resumed[1:] + [steps]  # each attempt starts past the one before, and the last ends the run
    assert resumed[0] is None and all(0 < a < b for a, b in zip(chain, chain[1:])), resumed
    events = rd.events()
    assert [e["steps"] for e in events if e["event"] == "preempted"] == resumed[1:]
    assert [e["checkpoint_steps"] for e in events if e["event"] == "requeue"] == resumed[1:]

    # Every step once; the weights went on from each checkpoint (version = optimizer steps before).
    metrics = rd.metrics()
    assert [m["step"] for m in metrics] == list(range(steps))
    optimizer_steps = [sum(m["train_batches"] for m in metrics[:k]) for k in range(steps)]
    assert [m["weight_version_min"] for m in metrics] == optimizer_steps

    wait_for(lambda: squeue_state(job_id) == "COMPLETED", 60, "the job to be COMPLETED")
    assert scontrol(job_id)["Restarts"] == "2"
    assert sorted(p.name for p in rd.logs.glob("attempt-*")) == ["attempt-1", "attempt-2", "attempt-3"]
    shown = rlctl("status", rd.id, "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout.count("requeued") >= 2, shown.stdout


def task_env(pid: int) -> dict[str, str]:
    """The environment a process started with (the cluster's nodes share this machine's pids)."""
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in items if b"=" in item)


def test_a_nodes_python_without_rlctl_ends_the_job_at_once_saying_why(tmp_path):
    rd = launch(tmp_path, *FAST, "slurm.python=/bin/false", detach=True)
    st = wait_for(lambda: (s := status_json(tmp_path, rd.id))["state"] != "starting" and s, 30, "the job to end")
    assert st["state"] == "failed" and st["slurm"]["state"] == "FAILED", st
    assert st["exit_reason"].endswith("the job's output said: error: the nodes' python, /bin/false (slurm.python), "
                                      "cannot import rlctl: install rlctl there, or fix slurm.setup / slurm.python")


def test_slurm_controller_down_is_a_one_line_error(tmp_path):
    conf = tmp_path / "slurm.conf"
    real = Path(os.environ["SLURM_CONF"]).read_text()
    # Same cluster, but a controller port where nothing listens.
    conf.write_text(real.replace("SlurmctldHost=", "SlurmctldPort=1\nSlurmctldHost=", 1))
    env = {"SLURM_CONF": str(conf)}
    res = rlctl("launch", str(QUICKSTART), *SLURM, f"run.output_dir={tmp_path}", *FAST, cwd=tmp_path, env=env, timeout=120)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "sbatch failed" in lines[0], res.stderr


def test_unsatisfiable_allocation_is_pending_with_a_reason_and_cancel_removes_it(tmp_path):
    # 4 rollout nodes + 1 trainer node on a 3-node cluster: Slurm keeps it pending.
    rd = launch(tmp_path, *FAST, "rollout.servers=4", detach=True)
    job_id = rd.read()["slurm"]["job_id"]
    wait_for(lambda: squeue_state(job_id) == "PENDING", 10, "squeue to list the job")
    st = wait_for(lambda: (s := status_json(tmp_path, rd.id))["slurm"].get("reason") not in (None, "None") and s, 15,
                  "a pending reason")
    assert st["state"] == "starting"
    # In words: PartitionNodeLimit, or PartitionConfig just after submission
    assert st["slurm"]["describe"] in ("PENDING: it asks for more nodes than the partition allows",
                                       "PENDING: it asks for more than the partition's configuration allows (nodes, CPUs or GPUs)")
    res = rlctl("status", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert f"{job_id} PENDING" in res.stdout
    res = rlctl("cancel", rd.id, "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert squeue_state(job_id) == "CANCELLED"
    assert status_json(tmp_path, rd.id)["state"] == "cancelled"


def test_state_is_read_by_column_name_whatever_the_job_name(tmp_path, monkeypatch):
    """The job name is the run id, and run.name may hold a `|`; the user's squeue settings (a
    format, a partition filter) must neither shift Slurm's columns nor hide the job."""
    from rlctl.launchers import slurm
    from rlctl.launchers.slurm import JobInfo
    from rlctl.run.dir import create_run_dir

    def job_when(job_id: str, ready: Callable[[JobInfo], bool]) -> JobInfo | None:
        job = slurm.query([job_id]).get(job_id)
        return job if job is not None and ready(job) else None

    rd = create_run_dir(tmp_path, "we|ird name|RUNNING", "run: {}\n",
                        {"launcher": "slurm", "mode": "sync", "steps_total": 3, "plan": None})
    script = tmp_path / "sleep.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH hetjob\n#SBATCH --nodes=2\nsleep 300\n")
    sbatch = ["sbatch", "--parsable", f"--job-name={rd.id}", f"--output={tmp_path}/%j.out", "--time=5:00"]
    het = subprocess.run([*sbatch, str(script)], capture_output=True, text=True, check=True).stdout.strip()
    rd.update(lambda d: d.update(state="running", slurm={"job_id": het}))
    pending = subprocess.run([*sbatch, "--nodes=4", "--wrap=sleep 300"], capture_output=True, text=True,
                             check=True).stdout.strip()
    for name, value in (("SQUEUE_FORMAT", "%i|%j"), ("SQUEUE_FORMAT2", "Name:30|"), ("SQUEUE_PARTITION", "nope")):
        monkeypatch.setenv(name, value)  # for the rlctl commands below too
    try:
        job = wait_for(lambda: job_when(het, lambda j: j.state == "RUNNING"), 30, "the job to run")
        lines = subprocess.run(["scontrol", "show", "job", "-o", het], capture_output=True, text=True).stdout.splitlines()
        assert job.nodes == [re.search(r" NodeList=(\S+)", line)[1] for line in lines]  # one per component
        assert len(job.nodes) == 2 and re.fullmatch(r"\d+:\d\d", job.elapsed), job
        waiting = wait_for(lambda: job_when(pending, lambda j: j.reason not in ("", "None")), 15, "a pending reason")
        assert waiting.describe().startswith("PENDING: it asks for more")

        st = status_json(tmp_path, rd.id)
        assert st["slurm"]["state"] == "RUNNING" and st["slurm"]["nodes"] == job.nodes
        assert f"{het} RUNNING" in rlctl("status", "--runs-dir", str(tmp_path), cwd=tmp_path).stdout
    finally:
        subprocess.run(["scancel", het, pending], capture_output=True)
    wait_for(lambda: job_when(het, lambda j: not j.active), 30, "the job to end")
    st = status_json(tmp_path, rd.id)
    assert st["state"] == "cancelled" and f"Slurm job {het} ended CANCELLED" in st["exit_reason"]
    assert st["slurm"]["state"] == "CANCELLED" and st["slurm"]["exit_code"] == scontrol(het)["ExitCode"]
    assert rd.read()["slurm"]["last"]["nodes"] == job.nodes
