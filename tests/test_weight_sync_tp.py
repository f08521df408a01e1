"""The weight sync to tensor-parallel servers, on CPU: built-in servers emulating SGLang 0.5.23
with --tp-size 2 take two ranks each in the weight-update group (rank_offset + tp_rank, as
SGLang's TP workers do), and every rank must receive every tensor bit for bit. The calls and
their bodies are checked against SGLang's own source (tests/sglang_source.py)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from conftest import free_port
from rlctl.engines.rollout.client import RolloutClient
from rlctl.engines.weightsync import WeightSender, tensor_sha256
from rlctl.errors import RunError
from sglang_bodies import check_body
from test_sglang_contract import sync_calls

pytestmark = pytest.mark.process

VERSION = "0.5.23"


def mixed_dtype_weights(model_dir) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters, changed so that a sync is visible, in three dtypes: float32,
    bfloat16 and float16 by turns, so that buckets mix itemsizes as a real model's may."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    kinds = (torch.float32, torch.bfloat16, torch.float16)
    out = []
    for i, (name, p) in enumerate(model.named_parameters()):
        out.append((name, (p.detach() * 1.5 + 0.01 * (i + 1)).to(kinds[i % 3])))
    return out


def test_two_servers_of_tp2_receive_every_tensor_on_every_rank(sglang, start_server, tiny_model_dir, tmp_path):
    src = sglang(VERSION)
    records = [tmp_path / f"requests-{i}.jsonl" for i in range(2)]
    urls = [start_server(i, "--emulate-sglang", VERSION, "--tp-size", "2", "--record-requests", str(r))
            for i, r in enumerate(records)]
    weights = mixed_dtype_weights(tiny_model_dir)
    assert len({t.dtype for _, t in weights}) == 3

    async def scenario():
        async with aiohttp.ClientSession() as s:
            clients = [RolloutClient(u, s) for u in urls]
            sender = WeightSender(clients, master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                  bucket_bytes=24 * 1024)  # float32 servers: nothing is narrowed on the wire
            await sender.connect()
            assert (sender.world_size, sender.rank_offsets) == (5, [1, 3])
            stats = await sender.send(weights, version="1")
            sums = [await c.weight_checksums() for c in clients]
            versions = [await c.weight_version() for c in clients]
            await sender.close()
            return stats, sums, versions

    stats, sums, versions = asyncio.run(scenario())
    assert stats.buckets > 2 and stats.tensors == len(weights) and versions == ["1", "1"]
    sent = {n: tensor_sha256(t) for n, t in weights}
    loaded = {n: tensor_sha256(t.float()) for n, t in weights}  # rank 0 holds a float32 model
    for server in sums:
        assert len(server["tp_ranks"]) == 1
        assert server["tp_ranks"][0] == sent  # TP rank 1 kept every tensor as it arrived
        assert {n: server["checksums"][n] for n in loaded} == loaded
    for record, offset in zip(records, (1, 3), strict=True):
        calls = [json.loads(line) for line in record.read_text().splitlines()]
        for call in calls:
            check_body(src, call["path"], call["body"])
        init = [c["body"] for c in calls if c["path"] == "/init_weights_update_group"]
        assert [(b["rank_offset"], b["world_size"]) for b in init] == [(offset, 5)]
        sync = [c["path"] for c in calls if c["path"] not in ("/init_weights_update_group", "/destroy_weights_update_group")]
        assert sync == sync_calls(True, stats.buckets)
        announced = [c["body"] for c in calls if c["path"] == "/update_weights_from_distributed"]
        assert all(b["load_format"] == "flattened_bucket" for b in announced)
        assert [b["weight_version"] for b in announced] == [None] * (len(announced) - 1) + ["1"]
        assert sorted(n for b in announced for n in b["names"]) == sorted(sent)


def test_a_refused_bucket_fails_the_sync_at_once(start_server):
    """SGLang refuses an update outside a session before it receives anything: the sender must
    report the refusal rather than wait in a broadcast that nobody joins."""
    url = start_server(0, "--emulate-sglang", VERSION, "--tp-size", "2")

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = RolloutClient(url, s)
            sender = WeightSender([c], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                  bucket_bytes=1 << 20)
            await sender.connect()
            sender.session_needed = [False]  # a sender that forgets begin_weight_update
            with pytest.raises(RunError, match="must run between begin_weight_update"):
                await asyncio.wait_for(sender.send([("model.norm.weight", torch.ones(32))], version="1"), 60)
            with pytest.raises(RunError, match="not connected"):
                await sender.send([("model.norm.weight", torch.ones(32))], version="2")
            await sender.close()

    asyncio.run(scenario())
