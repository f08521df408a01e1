"""Weights handed over in place (rlctl/engines/weightsync/ipc.py) and cast for the wire.

On this host's CPU, the built-in servers open the trainer's buckets from shared memory, through
the same sender, HTTP route and unpickler as CUDA IPC on a GPU (scripts/gpu_checks.py --only ipc
runs that). The request bodies and the globals our pickles reference are checked against
SGLang's own source: its request struct and its SafeUnpickler's allowlist.
"""

from __future__ import annotations

import ast
import asyncio
import io
import json
import pickle

import aiohttp
import pytest
import torch

from conftest import free_port
from rlctl.engines.rollout.client import RolloutClient
from rlctl.engines.weightsync import WeightSender, ipc, tensor_sha256
from rlctl.errors import RunError
from sglang_bodies import check_body
from sglang_source import SUPPORTED

COMMON = "sglang/srt/utils/common.py"
PATCH_TORCH = "sglang/srt/utils/patch_torch.py"


def changed_weights(model_dir) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, p.detach() * 1.25 + 0.001 * i) for i, (n, p) in enumerate(model.named_parameters())]


async def sync(urls: list[str], weights, version: str, **sender_args) -> tuple:
    async with aiohttp.ClientSession() as s:
        clients = [RolloutClient(u, s) for u in urls]
        sender = WeightSender(clients, master_address="127.0.0.1", master_port=free_port(), **sender_args)
        await sender.connect()
        stats = await sender.send(weights, version=version)
        sums = [(await c.weight_checksums())["checksums"] for c in clients]
        versions = [await c.weight_version() for c in clients]
        await sender.close()
        return sender, stats, sums, versions


@pytest.mark.process
@pytest.mark.parametrize(("version", "flattened"), [(v, True) for v in SUPPORTED] + [(SUPPORTED[-1], False)])
def test_ipc_sync_is_bit_exact_and_no_weight_bytes_cross_http(sglang, start_server, tiny_model_dir, tmp_path, version,
                                                              flattened):
    """Flattened buckets (one handle each, load_format "flattened_bucket"), and lists of views
    (load_format null), to servers that check every body against the release's request struct."""
    src = sglang(version)
    records = [tmp_path / f"requests-{i}.jsonl" for i in range(2)]
    urls = [start_server(i, "--emulate-sglang", version, "--record-requests", str(r)) for i, r in enumerate(records)]
    weights = changed_weights(tiny_model_dir)
    _, stats, sums, versions = asyncio.run(sync(urls, weights, "3", backend="ipc", bucket_bytes=16 * 1024,
                                                flattened=flattened))
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    assert stats.buckets > 2 and stats.bytes == nbytes and versions == ["3", "3"]
    want = {n: tensor_sha256(t) for n, t in weights}
    assert all({n: got[n] for n in want} == want for got in sums)
    for record in records:
        calls = [json.loads(line) for line in record.read_text().splitlines()]
        for call in calls:
            check_body(src, call["path"], call["body"])
        updates = [c["body"] for c in calls if c["path"] == "/update_weights_from_tensor"]
        assert len(updates) == stats.buckets and not any(c["path"] == "/init_weights_update_group" for c in calls)
        assert [u["weight_version"] for u in updates] == [None] * (len(updates) - 1) + ["3"]
        assert {u["load_format"] for u in updates} == {"flattened_bucket" if flattened else None}
        assert sum(len(json.dumps(u)) for u in updates) < nbytes / 4  # handles and metadata, not the weights


@pytest.mark.process
def test_a_bf16_server_is_sent_bf16_and_holds_what_its_own_cast_makes(start_server, tiny_model_dir, tmp_path):
    """A float32 trainer and a bfloat16 server: the sender casts before the broadcast (half the
    bytes); the server ends with exactly the values its load would have cast to."""
    record = tmp_path / "requests.jsonl"
    url = start_server(0, "--dtype", "bfloat16", "--record-requests", str(record))
    weights = changed_weights(tiny_model_dir)
    sender, stats, sums, _ = asyncio.run(sync([url], weights, "1", backend="gloo", bucket_bytes=16 * 1024))
    assert sender.server_dtype == torch.bfloat16
    assert stats.bytes == sum(t.numel() * 2 for _, t in weights)
    assert {n: sums[0][n] for n, _ in weights} == {n: tensor_sha256(t.to(torch.bfloat16)) for n, t in weights}
    announced = [json.loads(line)["body"] for line in record.read_text().splitlines()
                 if json.loads(line)["path"] == "/update_weights_from_distributed"]
    assert len(announced) == stats.buckets > 1 and all(b["load_format"] == "flattened_bucket" for b in announced)
    assert {d for b in announced for d in b["dtypes"]} == {"bfloat16"}


@pytest.mark.process
def test_a_server_opens_only_its_own_runs_buffers_and_still_takes_its_trainers_sync(start_server, tiny_model_dir,
                                                                                    tmp_path):
    """Shared memory of the host that the run's trainer did not tag is refused over HTTP and left
    as it was; a trainer of another run (tags of another token) is refused; the run's own syncs."""
    from rlctl.process.auth import new_token
    from test_ipc_open import Segment, over, payload

    token = new_token()
    (tmp_path / "token").write_text(token + "\n")
    url = start_server(0, "--api-key-file", str(tmp_path / "token"))
    weights = changed_weights(tiny_model_dir)
    foreign = Segment(bytes(range(128)), tag=None)  # a torch-named file of this user, no tag
    before = foreign.state()

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = RolloutClient(url, s, token)
            await c.begin_weight_update()
            async with s.post(url + "/update_weights_from_tensor", headers=c.headers, json={
                    "serialized_named_tensors": [payload(("model.norm.weight", over(foreign, size=(32,))))],
                    "load_format": None}) as resp:
                refused = resp.status, await resp.json()
            await c.end_weight_update()
            results = []
            for run_token in ("another run's token", token):
                sender = WeightSender([c], master_address="127.0.0.1", master_port=0, backend="ipc",
                                      bucket_bytes=16 * 1024, run_token=run_token)
                await sender.connect()
                try:
                    await sender.send(weights, version="7")
                    results.append("synced")
                except RunError as e:
                    results.append(str(e))
            return refused, results, (await c.weight_checksums())["checksums"], await c.weight_version()

    try:
        (status, body), results, sums, version = asyncio.run(scenario())
        assert foreign.state() == before
    finally:
        foreign.remove()
    assert status == 400 and "is not a buffer of this run's trainer" in body["message"], body
    assert "is not a buffer of this run's trainer" in results[0] and results[1] == "synced"
    assert {n: sums[n] for n, _ in weights} == {n: tensor_sha256(t) for n, t in weights} and version == "7"


class _Shell:
    def __reduce__(self):
        import os

        return os.system, ("touch owned",)


@pytest.mark.process
def test_a_pickle_naming_other_code_is_refused(start_server, tmp_path):
    import base64

    url = start_server()
    evil = base64.b64encode(pickle.dumps([("model.norm.weight", _Shell())])).decode()

    async def scenario():
        async with aiohttp.ClientSession() as s:
            await s.post(url + "/begin_weight_update", json={})
            async with s.post(url + "/update_weights_from_tensor",
                              json={"serialized_named_tensors": [evil], "load_format": None}) as resp:
                return resp.status, await resp.json()

    status, body = asyncio.run(scenario())
    assert status == 400 and body["success"] is False
    assert "Blocked unsafe global (posix.system)" in body["message"]
    assert not (tmp_path / "owned").exists()


def _allows(src):
    """SGLang's SafeUnpickler.find_class as a predicate on (module, name), read with ast from
    utils/common.py: an exact ALLOWED_GLOBALS set (0.5.21 on), or ALLOWED_MODULE_PREFIXES less
    DENY_CLASSES (0.5.15.post1)."""
    cls = src.definition(COMMON, "SafeUnpickler", ast.ClassDef)[1]
    sets = {t.id: ast.literal_eval(stmt.value) for stmt in cls.body if isinstance(stmt, ast.Assign)
            for t in stmt.targets if isinstance(t, ast.Name)}
    if "ALLOWED_GLOBALS" in sets:
        return lambda module, name: (module, name) in sets["ALLOWED_GLOBALS"]
    prefixes, deny = sets["ALLOWED_MODULE_PREFIXES"], sets["DENY_CLASSES"]
    return lambda module, name: (module, name) not in deny and any((module + ".").startswith(p) for p in prefixes)


class _Recording(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module, name):
        self.seen.add((module, name))
        return super().find_class(module, name)


@pytest.mark.parametrize("version", SUPPORTED)
def test_our_pickles_are_ones_sglangs_unpickler_allows(sglang, version):
    import base64

    src = sglang(version)
    allows = _allows(src)
    from rlctl.engines.weightsync import ipc_open

    flat = torch.zeros(64 + ipc.TAG_BYTES, dtype=torch.uint8)
    ipc.tag_buffer(flat, ipc.ipc_key(None))  # past the tensors: bytes SGLang never reads
    payload = ipc.dumps([("a", flat[:32].view(torch.float32).view(2, 4)), ("b", flat[32:64].view(torch.bfloat16))])
    reader = _Recording(base64.b64decode(payload))
    named = reader.load()
    assert [n for n, _ in named] == ["a", "b"] and named[0][1].shape == (2, 4)
    assert reader.seen and all(allows(*g) for g in reader.seen), [g for g in reader.seen if not allows(*g)]
    assert reader.seen <= ipc.ALLOWED  # and ours takes them back:
    ours = ipc_open.loads(payload, key=ipc.ipc_key(None))
    assert [(n, t.shape, t.dtype) for n, t in ours] == [(n, t.shape, t.dtype) for n, t in named]
    # CUDA tensors pickle as torch's rebuild_cuda_tensor(Tensor, ..., TypedStorage, dtype, device, ...),
    # with the GPU's UUID where SGLang's patch puts it (seen on the GPU: scripts/gpu_checks.py)
    cuda = {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch.storage", "TypedStorage"),
            ("torch", "Tensor"), ("torch", "Size"), ("torch", "bfloat16")}
    assert all(allows(*g) for g in cuda) and cuda <= ipc.ALLOWED
    patch = src.module(PATCH_TORCH)
    index = next(ast.literal_eval(s.value) for s in patch.body if isinstance(s, (ast.Assign, ast.AnnAssign))
                 and "_REDUCE_TENSOR_ARG_DEVICE_INDEX" in ast.unparse(s))
    assert index == ipc._DEVICE_ARG


FLATTENED_PATHS = ("sglang/srt/model_executor/model_runner_components/weight_updater.py",  # 0.5.21 on
                   "sglang/srt/model_executor/model_runner.py")  # 0.5.15.post1


def _flattened_handler(src) -> ast.FunctionDef:
    """SGLang's _update_weights_from_flattened_bucket, wherever the release keeps it, after
    checking that its update_weights_from_tensor hands it the whole unpickled payload when
    load_format is "flattened_bucket" (what our client sends)."""
    for rel in FLATTENED_PATHS:
        if not src.has(rel):
            continue
        defs = {n.name: n for n in ast.walk(src.module(rel)) if isinstance(n, ast.FunctionDef)}
        if "_update_weights_from_flattened_bucket" not in defs:
            continue
        entry = defs["update_weights_from_tensor"]
        payload = entry.args.args[1].arg  # after self: the deserialized payload of this rank
        dispatch = [
            call for node in ast.walk(entry) if isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and any(isinstance(c, ast.Constant) and c.value == ipc.FLATTENED_BUCKET for c in node.test.comparators)
            for call in ast.walk(node) if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "_update_weights_from_flattened_bucket"
        ]
        assert len(dispatch) == 1, f"{rel}: update_weights_from_tensor does not dispatch {ipc.FLATTENED_BUCKET!r}"
        (given,) = [*dispatch[0].args, *(k.value for k in dispatch[0].keywords)]
        assert isinstance(given, ast.Name) and given.id == payload, ast.unparse(dispatch[0])
        return defs["_update_weights_from_flattened_bucket"]
    raise LookupError(f"no _update_weights_from_flattened_bucket in {FLATTENED_PATHS}")


def _bucket_of(weights: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list]:
    """The weights packed into one tagged CPU buffer, as the sender packs a bucket."""
    from rlctl.engines.weightsync.buckets import flatten_bucket

    total = sum(t.numel() * t.element_size() for _, t in weights)
    buf = torch.zeros(total + ipc.TAG_BYTES, dtype=torch.uint8)
    flatten_bucket([t for _, t in weights], out=buf)
    ipc.tag_buffer(buf, ipc.ipc_key(None))
    return buf, [(n, t.dtype, tuple(t.shape)) for n, t in weights]


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_flattened_bucket_is_one_handle_that_sglangs_own_code_rebuilds_bit_for_bit(sglang, version):
    """load_format "flattened_bucket": SGLang's unpickler allows every global of the payload,
    its handler reads the two keys the payload has and the fields its metadata class defines,
    and its own FlattenedTensorBucket (run from the release's file) rebuilds every weight."""
    import base64
    import sys

    from rlctl.engines.weightsync import ipc_open

    src = sglang(version)
    weights = [("w.weight", torch.randn(3, 5)), ("b.bias", torch.randn(7).to(torch.bfloat16)),
               ("e.weight", torch.randn(2, 2, 2).to(torch.float16)), ("i", torch.arange(3, dtype=torch.int64))]
    weights.sort(key=lambda w: -w[1].element_size())  # the sender's order (buckets.plan_buckets)
    buf, metas = _bucket_of(weights)
    payload = ipc.dumps_bucket(buf, metas)

    bucket_cls = src.flattened_tensor_bucket()
    meta_cls = sys.modules[bucket_cls.__module__].FlattenedTensorMetadata

    class SGLangSide(_Recording):  # the metadata class is the release's own
        def find_class(self, module, name):
            if (module, name) == ipc.FLAT_META:
                self.seen.add((module, name))
                return meta_cls
            return super().find_class(module, name)

    allows = _allows(src)
    reader = SGLangSide(base64.b64decode(payload))
    got = reader.load()
    assert reader.seen and all(allows(*g) for g in reader.seen), [g for g in reader.seen if not allows(*g)]
    assert ipc.FLAT_META in reader.seen and reader.seen <= ipc.ALLOWED
    # One shared-memory handle for the bucket; the (name, tensor) list names one per tensor.
    assert base64.b64decode(payload).count(b"/torch_") == 1
    views = [(n, buf[:0].new_empty(0).set_(buf.untyped_storage(), 0, (0,))) for n, _ in weights]
    assert base64.b64decode(ipc.dumps(views)).count(b"/torch_") == len(weights)

    handler = _flattened_handler(src)
    keys = {n.slice.value for n in ast.walk(handler) if isinstance(n, ast.Subscript)
            and isinstance(n.slice, ast.Constant)}
    read = {n.attr for n in ast.walk(handler) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "meta"}
    fields = set(src.class_fields("sglang/srt/weight_sync/tensor_bucket.py", "FlattenedTensorMetadata"))
    assert keys == {"flattened_tensor", "metadata"} and read <= fields == {
        "name", "shape", "dtype", "start_idx", "end_idx", "numel"}

    rebuilt = bucket_cls(flattened_tensor=got["flattened_tensor"], metadata=got["metadata"]).reconstruct_tensors()
    ours = ipc_open.loads(payload, key=ipc.ipc_key(None), flattened=True)
    for out in (rebuilt, ours):
        assert [n for n, _ in out] == [n for n, _ in weights]
        for (_, t), (_, want) in zip(out, weights, strict=True):
            assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)


def test_a_flattened_bucket_the_server_cannot_lay_out_is_refused_before_anything_is_loaded():
    from rlctl.engines.weightsync import ipc_open
    from rlctl.engines.weightsync.ipc_handles import Refused

    key = ipc.ipc_key(None)
    buf, metas = _bucket_of([("a", torch.ones(4)), ("b", torch.ones(2))])
    flat = buf[:24]

    def refused(entries, tensor=flat, flattened=True):
        payload = ipc.pickle_bucket(tensor, [ipc.FlatMeta(*e) for e in entries])
        with pytest.raises(Refused) as e:
            ipc_open.loads(payload, key=key, flattened=flattened)
        return str(e.value)

    f32 = torch.float32
    assert "bytes [0, 32)" in refused([("a", torch.Size([8]), f32, 0, 32, 32)])  # past the flattened tensor
    assert "aligned" in refused([("a", torch.Size([2]), f32, 2, 10, 8)])
    assert "aligned" in refused([("a", torch.Size([4]), f32, 0, 8, 8)])  # 8 bytes named for a 16-byte tensor
    assert "contiguous uint8" in refused([("a", torch.Size([4]), f32, 0, 16, 16)], tensor=flat.view(f32))
    assert "list of (name, tensor)" in refused([("a", torch.Size([4]), f32, 0, 16, 16)], flattened=False)
    with pytest.raises(Refused, match="a flattened bucket is"):
        ipc_open.loads(ipc.dumps([("a", flat[:16].view(f32))]), key=key, flattened=True)
    with pytest.raises(Refused, match="unknown parameter name 'c'"):
        payload = ipc.dumps_bucket(buf, [("c", f32, (4,))])
        ipc_open.loads(payload, key=key, flattened=True, params={"a": torch.zeros(4)})


def test_ipc_recipes_are_checked_and_auto_picks_ipc_only_on_one_gpu():
    from rlctl.control.controller import sync_backend
    from rlctl.errors import RecipeError
    from rlctl.recipe import SyncBackend, load_recipe

    from conftest import QUICKSTART

    gpu = ["train.device=cuda", "rollout.device=cuda", "rollout.servers=2"]
    assert sync_backend(load_recipe(QUICKSTART, [*gpu, "train.gpus=[0]", "rollout.gpus=[0]"])) is SyncBackend.IPC
    assert sync_backend(load_recipe(QUICKSTART, [*gpu, "train.gpus=[0]", "rollout.gpus=[0,1]"])) is SyncBackend.GLOO
    assert sync_backend(load_recipe(QUICKSTART, ["train.gpus=[0]", "rollout.gpus=[0]"])) is SyncBackend.GLOO  # CPU
    with pytest.raises(RecipeError, match="train.sync_backend.*launcher=slurm"):
        load_recipe(QUICKSTART, ["train.sync_backend=ipc", "launcher=slurm"])
    with pytest.raises(RecipeError, match="train.sync_backend.*tp_size"):
        load_recipe(QUICKSTART, ["train.sync_backend=ipc", "rollout.builtin.tp_size=2"])
