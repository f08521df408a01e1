"""A live pool end to end: `rlctl pool up`, two runs attached with `launcher: pool` sharing its two
devices under a memory cap that forces model moves, the door between them, a killed server
started again by the pool, a run whose trainer was killed failing while the other goes on, a
killed run resumed in the pool, and `rlctl pool down`. The engines start forked warm
(rlctl/launchers/pool/warm.py), and cold in the resumed run's pool."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import FAST, QUICKSTART, REPO, rejoined, rlctl, wait_for
from rlctl.process.auth import LEASE_ROLE, bearer, key_of, read_token, role_key
from rlctl.run.dir import RunDir, pid_alive, read_jsonl

pytestmark = pytest.mark.e2e

# The FAST model's weights are ~90 kB: a server active is counted ~112 kB, a trainer ~358 kB
# (rlctl/launchers/pool/jobs.py), and each device gets a trainer and two servers (582 kB). 500 kB
# holds any one call's models, never all three active: the test checks this from the pool's events.
POOL = ["pool.devices.count=2", "pool.devices.memory_gb=0.0005", "pool.quantum_s=0.5", "pool.lease_s=5"]


@pytest.fixture
def pool(tmp_path):
    res = rlctl("pool", "up", str(REPO / "recipes" / "pool" / "cpu.yaml"), *POOL, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    yield tmp_path / "pools" / "cpu"
    res = rlctl("pool", "down", "cpu", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    state = json.loads((tmp_path / "pools" / "cpu" / "pool.json").read_text())
    assert state["state"] == "down" and not pid_alive(state["pid"])


def launch(tmp_path: Path, name: str, *overrides: str) -> RunDir:
    res = rlctl("launch", "--detach", str(QUICKSTART), *FAST, "launcher=pool", "pool.name=cpu", f"run.name={name}",
                "pipeline.check_weights=true", *overrides, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return RunDir(tmp_path / "runs" / res.stdout.strip().splitlines()[-1])


def ended(rd: RunDir) -> dict | None:
    info = rd.read()
    return info if info["state"] in ("completed", "failed", "cancelled") else None


def status(url: str, path: str, token: str, body: dict | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **bearer(token)},
                                 method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def check_the_doors(pool: Path, a: RunDir, b: RunDir) -> None:
    """While runs a and b run in the pool: what each can reach of the other's, and a kept slice."""
    url = json.loads((pool / "pool.json").read_text())["url"]
    ta, tb, tp = read_token(a.path), read_token(b.path), (pool / "token").read_text().strip()
    assert len({ta, tb, tp}) == 3
    # One run cannot take (or give back) the other's slices, nor ask the pool what it holds.
    needs = {"needs": [["rollout-0", "active"]], "kind": "generate"}
    assert status(url, f"/jobs/{b.id}/slice", ta, needs) == 403
    assert status(url, f"/jobs/{b.id}/release", ta, {"call": "x"}) == 403
    assert status(url, f"/jobs/{b.id}/slice", tp, needs) == 403  # the pool's token is not the run's
    assert status(url, "/status", ta) == 403
    assert status(url, "/status", tp) == 200
    # Nor reach the other's engines, which the pool started with keys derived from the other's
    # token; an engine takes its own key only, not even its run's token.
    b_server = b.read()["processes"]["rollout-0"]["port"]
    ka, kb = (key_of(t, rd.read()["processes"], "rollout-0") for t, rd in ((ta, a), (tb, b)))
    assert status(f"http://127.0.0.1:{b_server}", "/get_model_info", ka) == 403
    assert status(f"http://127.0.0.1:{b_server}", "/get_model_info", tb) == 403
    assert status(f"http://127.0.0.1:{b_server}", "/get_model_info", kb) == 200
    # A client that takes a slice with a's lease key and keeps it holds the devices for
    # pool.lease_s only: the pool takes it back, and both runs go on to the end.
    assert status(url, f"/jobs/{a.id}/slice", role_key(ta, LEASE_ROLE, a.id), needs) == 200
    wait_for(lambda: [e for e in read_jsonl(pool / "events.jsonl") if e["event"] == "lease_expired"
                      and e["job"] == a.id and e["held_s"] >= 5], 60, "the kept slice to be taken back")


def test_two_runs_share_the_pool_each_behind_its_own_door(pool, tmp_path):
    a = launch(tmp_path, "a", "run.steps=40", "run.seed=1")  # long enough to outlive a kept slice's lease
    b = launch(tmp_path, "b", "run.steps=4", "run.seed=2", "pipeline.mode=rolloutpipe")
    wait_for(lambda: a.read()["state"] == "running" and b.read()["state"] == "running", 300, "both runs to run")
    check_the_doors(pool, a, b)
    for rd in (a, b):
        info = wait_for(lambda rd=rd: ended(rd), 600, f"{rd.id} to end")
        assert info["state"] == "completed", info["exit_reason"]
        usage = info["pool"]["usage"]
        assert 0 < usage["used_device_s"] < usage["dedicated_device_s"]
        # pipeline.check_weights: after every sync each server's weights hashed equal to the
        # trainer's, moves to host and back included.
        checks = [e for e in rd.events() if e["event"] == "weights_checked"]
        assert len(checks) >= 4 and all(e["servers"] == 2 for e in checks)
    events = [json.loads(line) for line in (pool / "events.jsonl").read_text().splitlines()]
    cap = next(e["memory_bytes"] for e in events if e["event"] == "pool_up")
    need = {0: 0.0, 1: 0.0}
    for e in (e for e in events if e["event"] == "job_attached"):
        for m in e["models"].values():
            for d in m["devices"]:
                need[d] += m["weights_bytes"] + m["working_bytes"]
    assert min(need.values()) > cap  # all of a device's models cannot be active at once
    moves = [e for e in events if e["event"] == "move"]
    assert moves and all(e["ok"] for e in moves)  # the cap was felt: models left and came back
    assert {e["job"] for e in moves} == {a.id, b.id}
    assert {"offloaded", "weights"} & {e["to"] for e in moves}
    # A call beside the slices (its models stay put, it holds no device) may overlap another's.
    slices = [e for e in events if e["event"] == "slice" and not e.get("beside")]
    for d in (0, 1):  # never two runs on one device at once
        spans = sorted((e["start"], e["start"] + e["seconds"], e["job"]) for e in slices if e["device"] == d)
        for (s1, e1, j1), (s2, _, j2) in zip(spans, spans[1:]):
            assert j1 == j2 or s2 >= e1 - 1e-6, (d, s1, e1, j1, s2, j2)
    res = rlctl("pool", "status", "cpu", cwd=tmp_path)
    assert res.returncode == 0 and "device" in res.stdout
    shown = json.loads(rlctl("pool", "status", "cpu", "--json", cwd=tmp_path).stdout)  # the service's own answer
    assert isinstance(shown, dict) and shown
    res = rlctl("status", a.id, cwd=tmp_path)
    assert res.returncode == 0 and "pool cpu: used" in res.stdout, res.stdout
    res = rlctl("pool", "trace", "cpu", "-o", str(tmp_path / "pool-trace.json"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    spans = [e for e in json.loads((tmp_path / "pool-trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1} and {e["args"]["job"] for e in spans} == {a.id, b.id}


def test_a_killed_server_comes_back_and_a_killed_trainer_fails_only_its_run(pool, tmp_path):
    # Long enough to outlive the rejoin however fast its steps go (they took 0.07 s each on an
    # idle CI, 200 of them ending the run first); the test ends it by killing its trainer.
    a = launch(tmp_path, "a", "run.steps=100000")
    b = launch(tmp_path, "b", "run.steps=6", "run.seed=3")
    wait_for(lambda: any(e["event"] == "step_end" for e in a.events()), 300, "a's first step")
    victim = a.read()["processes"]["rollout-1"]["pid"]
    assert b"rlctl.launchers.pool.warm" in Path(f"/proc/{parent(victim)}/cmdline").read_bytes()  # started warm
    os.kill(victim, signal.SIGKILL)

    # The pool starts the server again on its device (warm too); a's controller gives it the
    # weights when it is back, and a goes on.
    back = wait_for(lambda: rejoined(a, "rollout-1"), 300,
                    "rollout-1 to rejoin")  # a warm start, then the next sync: a minute or more on a loaded 2-core CI
    assert back["server"] == "rollout-1"
    said = [e["event"] for e in a.events() if e.get("role") == "rollout-1"]
    assert said[-4:] == ["process_exit", "server_down", "server_restarted", "server_up"], said
    again = a.read()["processes"]["rollout-1"]["pid"]
    assert again != victim and b"rlctl.launchers.pool.warm" in Path(f"/proc/{parent(again)}/cmdline").read_bytes()
    assert a.read()["state"] == "running"
    steps = len(a.metrics())
    wait_for(lambda: len(a.metrics()) >= steps + 2, 120, "a to train on")

    os.kill(a.read()["processes"]["trainer-0"]["pid"], signal.SIGKILL)
    info = wait_for(lambda: ended(a), 120, "a to end")
    assert info["state"] == "failed" and "trainer-0 exited with code -9" in info["exit_reason"]
    # Its run said so only after the pool had let it go and stopped its other engines.
    assert a.id in {e["job"] for e in read_jsonl(pool / "events.jsonl") if e["event"] == "job_detached"}
    for role, proc in a.read()["processes"].items():
        assert role == "supervisor" or not pid_alive(proc["pid"]), role
    info = wait_for(lambda: ended(b), 600, "b to end")
    assert info["state"] == "completed", info["exit_reason"]


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_launch_into_a_pool_that_is_not_up(tmp_path):
    res = rlctl("launch", str(QUICKSTART), *FAST, "launcher=pool", "pool.name=nowhere", cwd=tmp_path)
    assert res.returncode == 1
    assert "pool nowhere is not up" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = rlctl("launch", str(QUICKSTART), *FAST, "launcher=pool", cwd=tmp_path)
    assert res.returncode == 2 and "pool.name" in res.stderr
    res = rlctl("launch", str(QUICKSTART), *FAST, "launcher=pool", "pool.name=cpu", "rollout.engine=sglang",
                "rollout.device=cuda", cwd=tmp_path)
    assert res.returncode == 2 and "rollout.engine" in res.stderr and "builtin" in res.stderr
    res = rlctl("pool", "up", str(REPO / "recipes" / "pool" / "cpu.yaml"), "pool.devices.bogus=1", cwd=tmp_path)
    assert res.returncode == 2 and "unknown key" in res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_pooled_run_resumes_in_its_pool_and_only_while_it_is_up(pool, tmp_path):
    a = launch(tmp_path, "a", "run.steps=12", "run.save_every=4")
    metrics = lambda: [json.loads(x) for x in (a.path / "metrics.jsonl").read_text().splitlines() if x]  # noqa: E731
    wait_for(lambda: (a.path / "metrics.jsonl").exists() and len(metrics()) >= 6, 300, "a's sixth step")
    os.kill(a.read()["processes"]["trainer-0"]["pid"], signal.SIGKILL)
    info = wait_for(lambda: ended(a), 120, "a to end")
    assert info["state"] == "failed" and "trainer-0 exited with code -9" in info["exit_reason"]
    assert rlctl("pool", "down", "cpu", cwd=tmp_path).returncode == 0
    res = rlctl("resume", a.id, cwd=tmp_path)
    assert res.returncode == 1 and "pool cpu is not up" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    up = rlctl("pool", "up", str(REPO / "recipes" / "pool" / "cpu.yaml"), *POOL, "pool.warm_start=false", cwd=tmp_path)
    assert up.returncode == 0  # this time its engines start cold, each a python of its own
    res = rlctl("resume", a.id, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    info = a.read()
    first, second = info["attempts"]
    assert info["state"] == "completed" and first["state"] == "failed" and second["resumed_from"] in (4, 8)
    assert sorted({m["step"] for m in metrics()}) == list(range(12))
    attached = [e for e in read_jsonl(pool / "events.jsonl") if e["event"] == "job_attached" and e["job"] == a.id]
    assert len(attached) == 2  # once per attempt, the second in the pool started again
