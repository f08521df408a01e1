"""rlctl's end of vLLM's weight-transfer group against vLLM's own code, run here.

Two pieces of vLLM need nothing but torch and run on the CPU, taken out of each supported wheel
and executed (vLLM itself is never imported): packed_tensor.py, which packs and unpacks the
chunks a weight update travels in, and StatelessProcessGroup from distributed/utils.py, the store
protocol every vLLM worker joins the group with. rlctl's packed buckets must be vLLM's chunks byte
for byte, and rlctl's store group must meet vLLM's on the same keys, whichever side hosts it."""

from __future__ import annotations

import ast
import logging
import os
import random
import sys
import threading
import types
import zipfile

import pytest
import torch

import vllm_source
from conftest import free_port
from rlctl.engines.weightsync.buckets import BucketMaker
from rlctl.engines.rollout.vllm.group import StoreGroup, packed_chunks

PACKED = "vllm/distributed/weight_transfer/packed_tensor.py"
UTILS = "vllm/distributed/utils.py"


def wheel_file(version: str, rel: str) -> str:
    try:
        whl = vllm_source.wheel(version)
    except vllm_source.MissingWheel as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))
    with zipfile.ZipFile(whl) as z:
        return z.read(rel).decode()


def packed_module(version: str) -> types.ModuleType:
    """vLLM's packed_tensor.py, executed as a module of its own (it imports only torch and the stdlib)."""
    module = types.ModuleType(f"vllm_packed_{version.replace('.', '_')}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up there
    exec(compile(wheel_file(version, PACKED), PACKED, "exec"), module.__dict__)  # noqa: S102 - vLLM's own file
    return module


def stateless_group_class(version: str) -> type:
    """StatelessProcessGroup and create_tcp_store, cut out of vLLM's distributed/utils.py by ast."""
    import collections
    import dataclasses
    import datetime
    import pickle
    import socket
    import time
    import typing
    import uuid

    tree = ast.parse(wheel_file(version, UTILS))
    wanted = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
              and n.name in ("StatelessProcessGroup", "create_tcp_store", "sched_yield")]
    assert {n.name for n in wanted} >= {"StatelessProcessGroup", "create_tcp_store"}
    module = types.ModuleType(f"vllm_stateless_{version.replace('.', '_')}")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    namespace.update({"dataclasses": dataclasses, "pickle": pickle, "socket": socket, "time": time, "uuid": uuid,
                 "deque": collections.deque, "Any": typing.Any, "torch": torch, "TCPStore": torch.distributed.TCPStore,
                 "timedelta": datetime.timedelta, "logger": logging.getLogger("vllm-test"), "os": os,
                 "sys": sys})
    exec(compile(ast.Module(body=wanted, type_ignores=[]), UTILS, "exec"), namespace)  # noqa: S102
    return namespace["StatelessProcessGroup"]


def pack(vllm, tensors, buffer_bytes: int):
    import warnings

    with warnings.catch_warnings():  # vLLM warns of a tensor larger than the buffer: cases tried here
        warnings.simplefilter("ignore", UserWarning)
        return vllm.pack_tensors(tensors, lambda item: item[1], buffer_bytes)


@pytest.mark.parametrize("version", vllm_source.SUPPORTED)
def test_packed_chunks_are_cut_where_vllm_cuts_them(version):
    vllm = packed_module(version)
    rng = random.Random(0)
    for _ in range(40):
        sizes = [rng.choice([1, 2, 4, 8, 100, 1000, 5000]) * rng.choice([1, 2, 4]) for _ in range(rng.randint(1, 30))]
        buffer_bytes = rng.choice([1, 64, 1000, 4096, 20000, 10**9])
        tensors = iter([(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)])
        theirs = []
        while (chunk := pack(vllm, tensors, buffer_bytes)) is not None:
            theirs.append([int(name[1:]) for name in chunk.names])
        assert packed_chunks(sizes, buffer_bytes) == theirs, (sizes, buffer_bytes)


@pytest.mark.parametrize("version", vllm_source.SUPPORTED)
def test_each_bucket_is_one_vllm_chunk_byte_for_byte(version):
    """The sender's buckets (mixed dtypes, largest itemsize first) against vLLM's packer and unpacker."""
    vllm = packed_module(version)
    gen = torch.Generator().manual_seed(1)
    weights = [(f"w{i}", torch.randn(shape, generator=gen).to(dtype))
               for i, (shape, dtype) in enumerate([((33, 7), torch.float32), ((5,), torch.bfloat16), ((64, 16), torch.float16),
                                                   ((3, 3), torch.float32), ((1000,), torch.bfloat16), ((17,), torch.float32)])]
    bucket_bytes = 2048
    maker = BucketMaker(iter(weights), bucket_bytes, True, None, staging="cpu", buffers=[None, None])
    by_name = dict(weights)
    seen = 0
    while (bucket := maker.next()) is not None:
        names = [m.name for m in bucket.metas]
        assert len(packed_chunks([m.nbytes for m in bucket.metas], bucket_bytes)) == 1
        chunk = vllm.pack_tensors(iter([(n, by_name[n]) for n in names]), lambda item: item[1], bucket_bytes)
        assert chunk.names == names
        assert torch.equal(chunk.packed_tensor, bucket.flat.clone())  # vLLM's packing = rlctl's bytes
        unpacked = vllm.unpack_tensor(bucket.flat.clone(), names, [list(by_name[n].shape) for n in names],
                                      [by_name[n].dtype for n in names], chunk.tensor_sizes)
        for name, tensor in unpacked:
            assert torch.equal(tensor, by_name[name])
        seen += len(names)
        if bucket.last:
            break
    assert seen == len(weights)


def run_ranks(*ranks) -> list:
    """Each callable on its own thread; their results, or the first error raised."""
    results, errors = [None] * len(ranks), []

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.process
@pytest.mark.parametrize("version", vllm_source.SUPPORTED)
def test_the_store_group_meets_vllms_whichever_side_hosts_it(version):
    Stateless = stateless_group_class(version)
    port = free_port()

    def ours_host():
        g = StoreGroup.create("127.0.0.1", port, 0, 3, timeout_s=30)
        g.broadcast_obj({"unique_id": b"\x01" * 8}, src=0)  # where rank 0 publishes NCCL's unique id
        # g kept: the store lives as long as its host, and rank 1 may read after rank 2 has written
        return g, g.broadcast_obj(None, src=2)

    def theirs(rank):
        def join():
            g = Stateless.create(host="127.0.0.1", port=port, rank=rank, world_size=3, store_timeout=30)
            got = g.broadcast_obj(None, src=0)
            if rank == 2:
                g.broadcast_obj("from worker 2", src=2)
            return got
        return join
    (_, hosted), w1, w2 = run_ranks(ours_host, theirs(1), theirs(2))
    assert w1 == w2 == {"unique_id": b"\x01" * 8} and hosted == "from worker 2"

    port = free_port()

    def theirs_host():
        g = Stateless.create(host="127.0.0.1", port=port, rank=0, world_size=2, store_timeout=30)
        return g, g.broadcast_obj("id", src=0)  # g kept: the store lives as long as its host

    def ours_worker():
        return StoreGroup.create("127.0.0.1", port, 1, 2, timeout_s=30).broadcast_obj(None, src=0)
    (_, sent), got = run_ranks(theirs_host, ours_worker)
    assert sent == got == "id"


@pytest.mark.process
def test_vllm_store_gets_an_address_remote_servers_reach_where_the_node_name_is_loopback_only():
    """vLLM's StatelessProcessGroup binds master_address itself; a name that resolves here to
    loopback only (Debian's 127.0.1.1 line; `localhost` stands in for it) is handed on as it is
    while every server is on this host, and replaced by this node's address on the route to a
    server on another node. An IP is never touched."""
    import ipaddress
    import socket

    from rlctl.process.auth import address_for_peers

    assert address_for_peers("localhost", ["127.0.0.1", "localhost"]) == "localhost"
    assert address_for_peers("10.1.2.3", ["192.0.2.7"]) == "10.1.2.3"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.7", 9))  # TEST-NET-1: the route's source address, nothing sent
            mine = probe.getsockname()[0]
    except OSError:
        pytest.skip("this machine has no route beyond loopback")
    assert not ipaddress.ip_address(mine).is_loopback
    assert address_for_peers("localhost", ["127.0.0.1", "192.0.2.7"]) == mine
