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
    (["launcher=pool", "pool.name=p"], "colocate.enabled", "a pool places and moves its jobs' engines itself"),
    (["launcher=slurm"], "rollout.servers", "colocated on Slurm, each trainer rank shares its GPU with a server TP "
     "rank: set rollout.servers x TP (2 x 1) = train.ranks (1)"),
    (["launcher=slurm", "train.ranks=2"], "slurm.rollout.servers_per_node",
     "a node runs the servers of its 2 trainer rank(s): set it to 2"),
    (["launcher=slurm", "train.ranks=2", "slurm.trainer.nodes=2", "slurm.rollout.gpus_per_node=1"],
     "slurm.rollout.gpus_per_node", "the servers run on the trainer's nodes and GPUs"),
    (["launcher=slurm", "train.ranks=2", "slurm.rollout.servers_per_node=2", "train.device=cuda", "rollout.device=cuda",
      "slurm.trainer.gpus_per_node=8"], "slurm.trainer.gpus_per_node", "takes one GPU: set it to 2"),
    (["rollout.engine=vllm", "rollout.device=cuda", "train.device=cuda", "rollout.servers=1"], "rollout.engine",
     "vLLM's ipc weight transfer is not wired yet"),
    (["rollout.builtin.emulate_vllm=0.34.0", "colocate.server_release=[weights]"], "colocate.server_release",
     "vLLM's sleep puts the weights to sleep with the KV cache"),
    (["rollout.engine=sglang", "rollout.device=cuda", "train.device=cuda", "rollout.servers=1",
      "rollout.sglang.tp_size=2"], "rollout.servers", "rollout.servers x TP (1 x 2) = train.ranks (1)"),
    (["rollout.engine=sglang", "rollout.device=cuda", "train.device=cuda", "rollout.servers=1",
      "train.sync_backend=nccl"], "train.sync_backend", "NCCL refuses two ranks on one GPU"),
    (["rollout.device=cuda"], "rollout.device", "set rollout.device=cpu"),
    (["rollout.cpus=[0]"], "rollout.cpus", "rollout.cpus = train.cpus"),
    (["train.device=cuda", "rollout.device=cuda"], "rollout.servers", "rollout.servers x TP (2 x 1) = train.ranks (1)"),
    (["train.device=cuda", "rollout.device=cuda", "rollout.servers=2", "train.ranks=2", "train.gpus=[0]",
      "rollout.gpus=[0]"], "train.gpus", "list 2, or leave it empty"),
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
    tp2 = load_recipe(QUICKSTART, [*COLOCATED, "rollout.engine=sglang", "train.device=cuda", "rollout.device=cuda",
                                   "rollout.servers=2", "rollout.sglang.tp_size=2", "train.ranks=4"], check_paths=False)
    assert tp2.rollout.servers * tp2.rollout.server_tp == tp2.train.ranks == 4  # a TP rank beside each trainer rank
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
@pytest.mark.parametrize("protocol", ["sglang", "vllm", "from every rank"])
def test_a_colocated_run_takes_turns_and_every_sync_lands_bit_for_bit(tmp_path, protocol):
    """With vLLM's protocol the turns are vLLM's sleep mode (/sleep, /wake_up in two parts).
    "from every rank": 2 trainer ranks over ipc, each packing the buckets its own server opens
    (weightsync/ipc_ranks.py), as on several GPUs, where a rank's CUDA memory opens only on its GPU."""
    from rlctl.run.dir import RunDir

    keys = {"vllm": ["rollout.builtin.emulate_vllm=0.34.0"],
            "from every rank": ["train.ranks=2", "train.sync_backend=ipc"]}.get(protocol, [])
    res = rlctl("launch", str(QUICKSTART), *FAST, *COLOCATED, *keys, "pipeline.check_weights=true",
                f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rd = RunDir(tmp_path / "runs" / res.stdout.strip().splitlines()[-1])
    assert rd.read()["state"] == "completed"
    if protocol == "from every rank":
        log = (rd.path / "logs" / "trainer-0.log").read_text()
        assert "each server takes the weights from the trainer ranks on its devices: rollout-0 <- [0], " \
               "rollout-1 <- [1]" in log
    events = rd.events()
    turns = [e for e in events if e["event"] == "colocate_turn"]
    assert [t["to"] for t in turns][:2] == ["trainer", "servers"]  # the initial sync, then the first step
    assert all(a["to"] != b["to"] for a, b in zip(turns, turns[1:], strict=False))  # they alternate
    to_trainer = [t for t in turns[2:] if t["to"] == "trainer"]
    assert to_trainer and all(t["server_tags"] == ["kv_cache", "weights"] and t["trainer_bytes"] > 0
                              for t in to_trainer)  # the servers released, the trainer took its state back
    odd = [t for t in to_trainer if set(t["phases"]) != {"drain", "servers_release", "trainer_resume"}
           or sum(t["phases"].values()) > t["seconds"] + 5e-4]  # each figure is rounded to 0.1 ms
    assert not odd, odd  # where each turn's time went
    assert all({"trainer_release", "servers_resume"} <= set(t["phases"]) for t in turns[2:] if t["to"] == "servers")
    took_turns(events)
    checked = [e for e in events if e["event"] == "weights_checked"]
    syncs = [e for e in events if e["event"] == "sync_end"]
    assert len(checked) == len(syncs) + 1 and all(c["servers"] == 2 for c in checked)  # + the initial sync
    starts = {e["step"]: e["version"] for e in events if e["event"] == "step_start"}
    assert all(set(e["versions"]) == {starts[e["step"]]} for e in events if e["event"] == "group_completed")


def test_each_gpu_server_takes_the_weights_from_the_trainer_ranks_on_its_gpus():
    """Trainer rank s * tp + j and TP rank j of server s share a GPU (rlctl/process/devices.py):
    CUDA IPC opens only there, so those ranks hand that server the weights; on one GPU, or
    where the counts differ (the CPU's shared memory opens anywhere on the host), rank 0 hands over all."""
    from rlctl.control.colocate import rank_sources
    from rlctl.process.devices import gpu_group, process_device
    from rlctl.process.topology import Role, Topology

    def local_topology(recipe):  # its roles, without the ports a launch finds free
        return Topology(rollout=[Role(f"rollout-{i}", "rollout", i, "127.0.0.1") for i in range(recipe.rollout.servers)],
                        trainers=[Role(f"trainer-{r}", "trainer", r, "127.0.0.1") for r in range(recipe.train.ranks)],
                        controller=Role("controller", "controller", 0, "127.0.0.1"), trainer_dist_port=0,
                        weight_sync_port=0)

    gpus = [4, 5, 6, 7]
    recipe = load_recipe(QUICKSTART, [*COLOCATED, "rollout.engine=sglang", "train.device=cuda", "rollout.device=cuda",
                                      "rollout.servers=2", "rollout.sglang.tp_size=2", "train.ranks=4",
                                      f"train.gpus={gpus}", f"rollout.gpus={gpus}"], check_paths=False)
    plan = local_topology(recipe)
    servers = [{"role": role.name} for role in reversed(plan.rollout)]  # in any order, e.g. after a failover
    sources = rank_sources(recipe, plan, servers, "ipc")
    assert sources == [[2, 3], [0, 1]]
    for server, ranks in zip(reversed(plan.rollout), sources, strict=True):  # each rank is on its server's GPU
        assert gpu_group(gpus, 2, server.index).split(",") == [process_device(recipe.train.device, r, gpus)[5:]
                                                               for r in ranks]
    assert rank_sources(recipe, plan, servers, "nccl") is None
    one_gpu = load_recipe(QUICKSTART, [*COLOCATED, "train.device=cuda", "rollout.device=cuda", "rollout.servers=1"],
                          check_paths=False)
    assert rank_sources(one_gpu, local_topology(one_gpu), [{"role": "rollout-0"}], "ipc") is None
    cpu = load_recipe(QUICKSTART, [*COLOCATED, "train.ranks=3"], check_paths=False)  # 2 servers, 3 ranks
    assert rank_sources(cpu, local_topology(cpu), [{"role": "rollout-0"}, {"role": "rollout-1"}], "ipc") is None


def test_rank_zero_sends_each_server_the_pickles_of_its_own_ranks_and_refuses_a_layout_that_does_not_fit():
    import asyncio

    from rlctl.engines.weightsync.ipc_ranks import payloads_by_server
    from rlctl.engines.weightsync.sender import WeightSender
    from rlctl.errors import RunError

    assert payloads_by_server(["r0", "r1", "r2", "r3"], [[2, 3], [0, 1]]) == [["r2", "r3"], ["r0", "r1"]]
    with pytest.raises(RunError, match=r"trainer ranks \[1\] packed no bucket where rank 0 did"):
        payloads_by_server(["r0", None], [[0], [1]])

    class Server:  # what connect() asks a server: its TP size and whether it needs an update session
        def __init__(self, url: str, tp: int) -> None:
            self.url, self.tp = url, tp

        async def server_info(self) -> dict:
            return {"tp_size": self.tp, "dtype": "float32"}

        async def needs_update_session(self) -> bool:
            return True

    def connect(from_ranks, tps=(2, 2), backend="ipc", ranks=4):
        sender = WeightSender([Server(f"http://s{i}", tp) for i, tp in enumerate(tps)], master_address="127.0.0.1",
                              master_port=1, backend=backend, bucket_bytes=1 << 20, from_ranks=from_ranks,
                              trainer_ranks=ranks)
        asyncio.run(sender.connect())
        return sender

    assert connect([[0, 1], [2, 3]]).share_spec.server_dtype == "float32"  # what the other ranks pack with
    assert connect(None).share_spec is None  # rank 0 hands over all
    with pytest.raises(RunError, match=r"http://s1 has 2 TP rank\(s\), and trainer ranks \[2\] of 4"):
        connect([[0, 1], [2]])
    with pytest.raises(RunError, match=r"trainer ranks \[4, 5\] of 4"):
        connect([[0, 1], [4, 5]])
    with pytest.raises(RunError, match="1 lists of trainer ranks for 2 server"):
        connect([[0, 1]])
