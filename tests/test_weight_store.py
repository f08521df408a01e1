"""The weight-sync group's store (rlctl/engines/weightsync/store.py) is open only while the group
forms, what is read from it runs no code, and a server joins a group at its run's trainer's host
and port only. Real processes and sockets, except the two checks of pure logic first."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import pickle
import socket

import aiohttp
import pytest
import torch
import torch.distributed as dist

from conftest import free_port
from rlctl.engines.rollout.builtin.state import ServerState
from rlctl.engines.rollout.client import RolloutClient
from rlctl.engines.weightsync import WeightSender, destroy_process_group, init_custom_process_group, tensor_sha256
from rlctl.engines.weightsync.group import close_store, seal_store
from rlctl.engines.weightsync.store import hosted
from rlctl.engines.rollout.vllm.group import StoreGroup, init_info


def test_a_server_pinned_to_host_and_port_names_any_other_master():
    pinned = ServerState(argparse.Namespace(weight_group_master="127.0.0.1:29500"))
    assert pinned.foreign_master("127.0.0.1", 29500) is None
    for address, port in (("127.0.0.1", 29501), ("10.0.0.9", 29500), ("localhost", 29500)):
        assert f"master_address {address}:{port} is not this run's trainer (127.0.0.1:29500)" in pinned.foreign_master(
            address, port
        )
    host_only = ServerState(argparse.Namespace(weight_group_master="127.0.0.1"))
    assert host_only.foreign_master("127.0.0.1", 1) is None and host_only.foreign_master("10.0.0.9", 1)
    assert ServerState(argparse.Namespace(weight_group_master="")).foreign_master("10.0.0.9", 1) is None


class _Shell:
    def __init__(self, path) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.path}",)


def test_a_store_value_that_names_code_is_refused_and_plain_data_is_read(tmp_path):
    store = dist.HashStore()  # a real c10d store, in this process
    group = StoreGroup(store, rank=1, world_size=2)
    store.set("broadcast_from/0/0", pickle.dumps(_Shell(tmp_path / "owned")))
    with pytest.raises(ValueError, match="broadcast_from/0/0.*plain data only, not posix.system"):
        group.broadcast_obj(None, src=0)
    assert not (tmp_path / "owned").exists()
    store.set("broadcast_from/0/1", pickle.dumps({"unique_id": b"\x01" * 8, "more": [1, 2.5, "gloo", None]}))
    assert group.broadcast_obj(None, src=0) == {"unique_id": b"\x01" * 8, "more": [1, 2.5, "gloo", None]}


def _flood(port: int) -> str:
    """What a client without any credential gets when it tries to put 64 MiB in the store."""
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
    except (RuntimeError, dist.DistError) as e:  # DistNetworkError, DistStoreError: no connection
        return f"no connection: {str(e).splitlines()[0]}"
    store.set("flood", b"\0" * (64 << 20))
    return "set"


def _connect(port: int) -> str:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError as e:
        return type(e).__name__
    return "connected"


def _rank_one(port: int, conn) -> None:
    """Rank 1 of a gloo group: joins, then receives a broadcast for each "broadcast" it is sent."""
    group = init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name="probe", timeout_s=60
    )
    conn.send("joined")
    while conn.recv() == "broadcast":
        t = torch.zeros(4)
        dist.broadcast(t, src=0, group=group)
        conn.send(t.tolist())
    destroy_process_group(group)
    conn.send("destroyed")


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_group_broadcasts_after_its_store_is_sealed_and_closed():
    """Two ranks in two processes. Sealed, the store keeps the connections made (what NCCL's first
    collective uses) and takes no new one; closed, its port refuses; the group broadcasts all along."""
    port = free_port()
    parent, child = mp.get_context("spawn").Pipe()
    rank_one = mp.get_context("spawn").Process(target=_rank_one, args=(port, child), daemon=True)
    rank_one.start()
    try:
        group = init_custom_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=2,
            rank=0,
            group_name="probe",
            timeout_s=60,
        )
        assert parent.recv() == "joined" and _connect(port) == "connected"

        def broadcast(values: list[float]) -> list[float]:
            parent.send("broadcast")
            dist.broadcast(torch.tensor(values), src=0, group=group)
            return parent.recv()

        seal_store(group)
        made_before = hosted(group).client
        made_before.set("still", b"served")
        assert made_before.get("still") == b"served"
        assert _connect(port) == "TimeoutError" and _flood(port).startswith("no connection")
        assert broadcast([1.0, 2.0, 3.0, 4.0]) == [1.0, 2.0, 3.0, 4.0]
        close_store(group)
        assert _connect(port) == "ConnectionRefusedError" and _flood(port).startswith("no connection")
        assert broadcast([5.0, 6.0, 7.0, 8.0]) == [5.0, 6.0, 7.0, 8.0]
        parent.send("stop")
        destroy_process_group(group)
        assert parent.recv() == "destroyed"
    finally:
        rank_one.join(10)
        if rank_one.is_alive():
            rank_one.kill()


@pytest.mark.process
def test_once_the_servers_joined_the_store_is_closed_and_the_sync_lands(start_server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    url = start_server()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = [(n, p.detach() + 0.5) for n, p in model.named_parameters()]
    port = free_port()

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = RolloutClient(url, s)
            sender = WeightSender(
                [c], master_address="127.0.0.1", master_port=port, backend="gloo", bucket_bytes=16 * 1024
            )
            await sender.connect()
            flood, connect = _flood(port), _connect(port)
            await sender.send(weights, version="2")
            sums = (await c.weight_checksums())["checksums"]
            await sender.close()
            return flood, connect, sums

    flood, connect, sums = asyncio.run(scenario())
    assert flood.startswith("no connection") and connect == "ConnectionRefusedError"
    assert {n: sums[n] for n, _ in weights} == {n: tensor_sha256(t) for n, t in weights}


@pytest.mark.process
def test_the_emulated_vllm_groups_store_is_closed_once_formed(start_server, tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from rlctl.engines.rollout.vllm.client import VllmClient
    from rlctl.engines.rollout.vllm.sender import VllmWeightSender

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    url = start_server(0, "--emulate-vllm", "0.34.0")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = [(n, p.detach() * 2) for n, p in model.named_parameters()]
    port = free_port()

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = VllmClient(url, s)
            sender = VllmWeightSender(
                [c], master_address="127.0.0.1", master_port=port, backend="gloo", bucket_bytes=16 * 1024
            )
            await sender.connect()
            flood = _flood(port)
            await sender.send(weights, version="5")
            sums = (await c._get_json("/rlctl/weight_checksums"))["checksums"]
            await sender.close()
            return flood, sums

    flood, sums = asyncio.run(scenario())
    assert flood.startswith("no connection")
    assert {n: sums[n] for n, _ in weights} == {n: tensor_sha256(t) for n, t in weights}


@pytest.mark.process
def test_a_server_joins_its_trainers_announced_port_only(start_server, tiny_model_dir, monkeypatch):
    port = free_port()
    url = start_server(0, "--weight-group-master", f"127.0.0.1:{port}")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    vllm_url = start_server(1, "--emulate-vllm", "0.34.0", "--weight-group-master", f"127.0.0.1:{port}")
    group = {
        "master_address": "127.0.0.1",
        "master_port": port + 1,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "weight_update_group",
        "backend": "gloo",
    }
    info = init_info(master_address="127.0.0.1", master_port=port + 1, rank_offset=1, world_size=2, buffer_bytes=1024)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/init_weights_update_group", json=group) as resp:
                sglang_side = resp.status, await resp.json()
            async with s.post(vllm_url + "/init_weight_transfer_engine", json={"init_info": info}) as resp:
                vllm_side = resp.status, await resp.json()
            c = RolloutClient(url, s)
            sender = WeightSender(
                [c], master_address="127.0.0.1", master_port=port, backend="gloo", bucket_bytes=1 << 20
            )
            await sender.connect()  # the announced port: joined
            await sender.close()
            return sglang_side, vllm_side

    (status, body), (vllm_status, vllm_body) = asyncio.run(scenario())
    named = f"master_address 127.0.0.1:{port + 1} is not this run's trainer (127.0.0.1:{port})"
    assert status == 400 and body["success"] is False and named in body["message"]
    assert vllm_status == 400 and named in vllm_body["error"]["message"]
