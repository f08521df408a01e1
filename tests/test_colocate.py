"""colocate.enabled: the rollout servers and the trainer take turns on the same devices
(rlctl/control/colocate.py). The recipe refuses what cannot take turns in one line; a real run
moves every server's and the trainer's memory off the device and back at each turn, never
generates while the trainer holds the devices, and every sync lands bit for bit."""

from __future__ import annotations

import pytest

from conftest import FAST, QUICKSTART, rlctl
from rlctl.errors import RecipeError
from rlctl.recipe import load_recipe

COLOCATED = ["colocate.enabled=true"]


@pytest.mark.parametrize("overrides, key, said", [
    (["pipeline.mode=rolloutpipe"], "pipeline.mode", "rolloutpipe trains while the servers generate"),
    (["launcher=slurm"], "colocate.enabled", "launcher=slurm is not built yet"),
    (["rollout.engine=vllm", "rollout.device=cuda", "train.device=cuda", "rollout.servers=1"], "rollout.engine",
     "vLLM's ipc weight transfer is not wired yet"),
    (["rollout.builtin.emulate_vllm=0.34.0", "colocate.server_release=[weights]"], "colocate.server_release",
     "vLLM's sleep puts the weights to sleep with the KV cache"),
    (["rollout.engine=sglang", "rollout.device=cuda", "train.device=cuda", "rollout.servers=1",
      "rollout.sglang.tp_size=2"], "rollout.sglang.tp_size", "set it to 1"),
    (["rollout.engine=sglang", "rollout.device=cuda", "train.device=cuda", "rollout.servers=1",
      "train.sync_backend=nccl"], "train.sync_backend", "NCCL refuses two ranks on one GPU"),
    (["rollout.device=cuda"], "rollout.device", "set rollout.device=cpu"),
    (["rollout.cpus=[0]"], "rollout.cpus", "rollout.cpus = train.cpus"),
    (["train.device=cuda", "rollout.device=cuda"], "rollout.servers", "set it to train.ranks (1)"),
    (["train.device=cuda", "rollout.device=cuda", "rollout.servers=2", "train.ranks=2"], "train.ranks",
     "one trainer rank and its server share one GPU"),
    (["train.device=cuda", "rollout.device=cuda", "rollout.servers=1", "rollout.gpus=[1]"], "rollout.gpus",
     "set it to train.gpus ([])"),
    (["colocate.server_release=[kv_cache,optimizer]"], "colocate.server_release", "'optimizer' is not one of"),
    (["colocate.trainer_release=[weights,weights]"], "colocate.trainer_release", "named twice"),
])
def test_what_cannot_take_turns_is_refused_in_one_line(overrides, key, said):
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, [*COLOCATED, *overrides], check_paths=False)
    assert e.value.key == key and said in e.value.message and "\n" not in str(e.value), str(e.value)


def test_colocated_one_gpu_and_the_cpu_are_accepted():
    on_gpu = load_recipe(QUICKSTART, [*COLOCATED, "train.device=cuda", "rollout.device=cuda", "rollout.servers=1"],
                         check_paths=False)
    assert on_gpu.colocate.enabled and on_gpu.rollout.servers == on_gpu.train.ranks == 1
    sglang = load_recipe(QUICKSTART, [*COLOCATED, "rollout.engine=sglang", "train.device=cuda", "rollout.device=cuda",
                                      "rollout.servers=1", "train.sync_backend=ipc"], check_paths=False)
    assert sglang.colocate.enabled and str(sglang.train.sync_backend) == "ipc"  # IPC is right on the shared GPU
    on_cpu = load_recipe(QUICKSTART, COLOCATED, check_paths=False)  # the quickstart's 2 servers share the CPU
    assert on_cpu.colocate.server_release == ["kv_cache", "weights"]
    assert on_cpu.colocate.trainer_release == ["weights", "optimizer"]


def test_ipc_to_sglang_servers_is_refused_in_one_line():
    """Each SGLang server sees only its own GPUs: the trainer's IPC handles fail there with
    "Invalid device_uuid" at the first update."""
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, ["rollout.engine=sglang", "rollout.device=cuda", "train.device=cuda",
                                 "train.sync_backend=ipc"], check_paths=False)
    assert e.value.key == "train.sync_backend" and "Invalid device_uuid" in e.value.message


def test_auto_sync_is_ipc_on_a_shared_gpu():
    from rlctl.control.controller import sync_backend

    gpu = load_recipe(QUICKSTART, [*COLOCATED, "rollout.engine=sglang", "train.device=cuda", "rollout.device=cuda",
                                   "rollout.servers=1"], check_paths=False)
    assert str(sync_backend(gpu)) == "ipc"
    assert str(sync_backend(load_recipe(QUICKSTART, COLOCATED, check_paths=False))) == "gloo"  # the CPU


def took_turns(events: list[dict]) -> list[dict]:
    """The trainer holds the devices from the end of each turn to it to the start of the next turn
    to the servers: every train call ends inside such a hold, and no sample's generation starts
    or ends inside one (a sample resumed across a turn, `segments` > 1, started before it)."""
    turns = [e for e in events if e["event"] == "colocate_turn"]
    holds = [(a["t"], b["start"]) for a, b in zip(turns, turns[1:], strict=False) if a["to"] == "trainer"]
    trained = [e["t"] for e in events if e["event"] == "train_end"]
    groups = [e for e in events if e["event"] == "group_completed"]
    ends = [t for g in groups for t in g["ends"]]
    starts = [t for g in groups for t, n in zip(g["starts"], g["segments"], strict=True) if n == 1]
    assert len(trained) >= 3 and all(any(a <= t <= b for a, b in holds) for t in trained)
    assert len(ends) >= 3 and not any(a < t < b for a, b in holds for t in ends + starts)
    return groups


@pytest.mark.e2e
def test_async_colocated_aborts_at_each_turn_resumes_after_it_and_keeps_the_staleness_bound(tmp_path):
    from rlctl.run.dir import RunDir

    res = rlctl("launch", str(QUICKSTART), *FAST, "run.steps=6", *COLOCATED, "pipeline.mode=async",
                "pipeline.inflight_at_update=abort_resume", "pipeline.max_staleness=1", "pipeline.check_weights=true",
                f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rd = RunDir(tmp_path / "runs" / res.stdout.strip().splitlines()[-1])
    events = rd.events()
    groups = {g["group"]: g for g in took_turns(events)}
    versions = {e["step"]: e["version"] for e in events if e["event"] == "step_start"}
    trained = [(e["step"], g) for e in events if e["event"] == "train_start" for g in e["groups"]]
    assert trained and all(versions[step] - min(groups[g]["versions"]) <= 1 for step, g in trained)
    assert all(c["servers"] == 2 for c in events if c["event"] == "weights_checked")


def test_async_colocated_needs_requests_that_resume_after_a_turn():
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, [*COLOCATED, "pipeline.mode=async"], check_paths=False)
    assert e.value.key == "pipeline.inflight_at_update" and "abort_resume" in e.value.message


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_colocated_run_takes_turns_and_every_sync_lands_bit_for_bit(tmp_path, protocol):
    """With vLLM's protocol the turns are vLLM's sleep mode (/sleep, /wake_up in two parts)."""
    from rlctl.run.dir import RunDir

    emulate = ["rollout.builtin.emulate_vllm=0.34.0"] if protocol == "vllm" else []
    res = rlctl("launch", str(QUICKSTART), *FAST, *COLOCATED, *emulate, "pipeline.check_weights=true",
                f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rd = RunDir(tmp_path / "runs" / res.stdout.strip().splitlines()[-1])
    assert rd.read()["state"] == "completed"
    events = rd.events()
    turns = [e for e in events if e["event"] == "colocate_turn"]
    assert [t["to"] for t in turns][:2] == ["trainer", "servers"]  # the initial sync, then the first step
    assert all(a["to"] != b["to"] for a, b in zip(turns, turns[1:], strict=False))  # they alternate
    to_trainer = [t for t in turns[2:] if t["to"] == "trainer"]
    assert to_trainer and all(t["server_tags"] == ["kv_cache", "weights"] and t["trainer_bytes"] > 0
                              for t in to_trainer)  # the servers released, the trainer took its state back
    took_turns(events)
    checked = [e for e in events if e["event"] == "weights_checked"]
    syncs = [e for e in events if e["event"] == "sync_end"]
    assert len(checked) == len(syncs) + 1 and all(c["servers"] == 2 for c in checked)  # + the initial sync
    starts = {e["step"]: e["version"] for e in events if e["event"] == "step_start"}
    assert all(set(e["versions"]) == {starts[e["step"]]} for e in events if e["event"] == "group_completed")
