"""rollout.engine=sglang, held to SGLang's own source: tests/sglang_source.py reads the wheel of
every supported release, and from it these tests take the routes the client may call, the fields
and types of every body it sends, the replies (success and refusal) the built-in server must give
when it emulates a release, and the weight-sync group's rank layout. The flattened weight bucket
is compared byte for byte with SGLang's FlattenedTensorBucket, run from the wheel. A release whose
source changes a field or a reply that rlctl relies on fails here.
"""

from __future__ import annotations

import ast
import asyncio
import json

import aiohttp
import pytest
import torch

from conftest import QUICKSTART, free_port, rlctl_here
from rlctl.engines.rollout.builtin.server import BuiltinServer, parser
from rlctl.engines.rollout.client import RolloutClient, SamplingRequest
from rlctl.engines.rollout.sglang.launch import colocated_flags, launch_command, speaks
from rlctl.engines.weightsync import (
    TensorMeta,
    WeightSender,
    dtype_name,
    flatten_bucket,
    group_layout,
    plan_buckets,
    tensor_sha256,
    unflatten_bucket,
)
from rlctl.errors import RunError
from rlctl.recipe import SGLangConfig, load_recipe
from sglang_bodies import check_body
from sglang_source import SUPPORTED

# GET routes the client reads (its POSTs are recorded from a real exchange below).
CLIENT_GETS = ("/health", "/server_info", "/model_info")
# Served by SGLang through a router of its own (entrypoints/v1_loads.py), not http_server.py's table.
INCLUDED_ROUTERS = {"/v1/loads"}


def test_launch_command():
    cfg = SGLangConfig(tp_size=2, mem_fraction_static=0.7, extra_args=["--attention-backend", "fa3"])
    cmd = launch_command("/venv/bin/python", "/models/Qwen3-1.7B", cfg, host="10.0.0.7", port=30001, seed=7,
                         config="/runs/r/sglang-rollout-0.yaml")
    assert cmd == [
        "/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/Qwen3-1.7B", "--tp-size", "2",
        "--host", "10.0.0.7", "--port", "30001", "--mem-fraction-static", "0.7", "--dtype", "bfloat16",
        "--random-seed", "7", "--skip-tokenizer-init", "--config", "/runs/r/sglang-rollout-0.yaml",
        "--attention-backend", "fa3"]
    assert "--api-key" not in cmd  # the key is in the --config file, never on the command line `ps` shows


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_colocated_server_starts_with_the_memory_saver_and_a_weights_backup(sglang, version):
    """--enable-memory-saver and --enable-weights-cpu-backup are ServerArgs fields, off by default,
    in every supported release: without the first, releasing memory frees nothing."""
    fields = sglang(version).server_args_fields()
    for flag in colocated_flags(["kv_cache", "weights"]):
        name = flag.removeprefix("--").replace("-", "_")
        assert name in fields and sglang(version).server_args_default(name) == "False", (version, name)
    assert colocated_flags(["kv_cache"]) == ["--enable-memory-saver"]  # weights kept: nothing to back up
    cmd = launch_command("python", "/m", SGLangConfig(), host="h", port=1, seed=0, config="c.yaml",
                         extra=colocated_flags(["weights"]))
    assert cmd[-4:] == ["--enable-memory-saver", "--enable-weights-cpu-backup", "--config", "c.yaml"]


def test_versions_the_adapter_speaks():
    assert speaks("0.5.15.post1") == "no-session"
    assert speaks("0.5.20") == "no-session"
    assert speaks("0.5.21") == "session"
    assert speaks("0.5.23") == "session"
    for outside in ("0.4.10", "0.5.30", "rlctl-builtin 1"):
        with pytest.raises(RunError):
            speaks(outside)


@pytest.mark.parametrize("override, key", [
    ("rollout.sglang.extra_args=[--port=1]", "rollout.sglang.extra_args[0]"),
    ("rollout.sglang.mem_fraction_static=1.5", "rollout.sglang.mem_fraction_static"),
    ("rollout.sglang.dtype=int8", "rollout.sglang.dtype"),
    ("rollout.engine=sglang", "rollout.device"),  # SGLang on CPU
    ("rollout.builtin.emulate_sglang=0.6.0", "rollout.builtin.emulate_sglang"),
    ("rollout.builtin.tp_size=2 rollout.device=cuda", "rollout.builtin.tp_size"),
])
def test_bad_sglang_settings_name_the_key(tmp_path, override, key):
    res = rlctl_here("launch", str(QUICKSTART), *override.split(), f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert res.returncode == 2 and f": {key}: " in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_local_sglang_servers_get_their_own_gpus(monkeypatch):
    from rlctl.process.devices import gpu_group

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # indices in rollout.gpus are the visible ones
    assert [gpu_group([], 2, i) for i in range(2)] == ["4,5", "6,7"]
    assert [gpu_group([3, 2, 1, 0], 1, i) for i in range(4)] == ["7", "6", "5", "4"]
    with pytest.raises(RunError, match="rollout server 2 needs 2 GPUs of its own"):
        gpu_group([], 2, 2)


def test_sglang_recipe_is_accepted():
    r = load_recipe(QUICKSTART, ["rollout.engine=sglang", "rollout.device=cuda", "train.device=cuda"])
    assert r.rollout.engine == "sglang" and r.rollout.sglang.skip_tokenizer_init


# -- what the client sends, against each release's request structs ---------------------------------

def sync_calls(version_has_sessions: bool, updates: int) -> list[str]:
    """One weight sync, as slime/miles order it against SGLang (docs/sglang.md). The last
    bucket's announce carries the version, so /update_weight_version is sent only when there
    is no bucket."""
    begin, end = (["/begin_weight_update"], ["/end_weight_update"]) if version_has_sessions else ([], [])
    version = [] if updates else ["/update_weight_version"]
    return ["/pause_generation", "/flush_cache", *begin, *["/update_weights_from_distributed"] * updates,
            *version, *end, "/continue_generation"]


@pytest.mark.process
@pytest.mark.parametrize("version", SUPPORTED)
def test_every_request_is_one_sglang_takes(sglang, start_server, tiny_model_dir, tmp_path, version):
    from transformers import AutoModelForCausalLM

    src = sglang(version)
    record = tmp_path / "requests.jsonl"
    url = start_server(0, "--emulate-sglang", version, "--record-requests", str(record))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    expected = {n: tensor_sha256(t) for n, t in model.state_dict().items()}

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = RolloutClient(url, s)
            assert (await c.server_info())["version"] == version
            out = await c.generate([1, 22, 3], SamplingRequest(max_new_tokens=3, temperature=1.0, top_p=0.9), "r-1")
            assert len(out.logprobs) == len(out.output_ids) == 3
            await c.abort("r-unknown")
            sender = WeightSender([c], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                  bucket_bytes=32 * 1024)
            await sender.connect()
            await sender.send([(n, p.detach()) for n, p in model.named_parameters()], version="5")
            assert (await c.weight_checksums())["checksums"] == expected
            assert await c.weight_version() == "5"
            await sender.close()

    asyncio.run(scenario())
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    routes = src.routes()
    for call in calls:
        assert "POST" in routes.get(call["path"], ()), f"SGLang {version} has no POST {call['path']}"
        check_body(src, call["path"], call["body"])
    assert all("GET" in routes[path] for path in CLIENT_GETS)
    paths = [c["path"] for c in calls]
    sync = [p for p in paths if p not in ("/generate", "/abort_request", "/init_weights_update_group",
                                         "/destroy_weights_update_group")]
    updates = sync.count("/update_weights_from_distributed")
    assert updates > 1  # several buckets
    assert sync == sync_calls("/begin_weight_update" in routes, updates)
    announced = [c["body"]["weight_version"] for c in calls if c["path"] == "/update_weights_from_distributed"]
    assert announced == [None] * (updates - 1) + ["5"]  # the new version comes with the last bucket only
    assert paths[-1] == "/destroy_weights_update_group"


# -- what the built-in server answers when it emulates a release ------------------------------------

async def exchange(s: aiohttp.ClientSession, url: str, method: str, path: str, body=None) -> tuple[int, str, frozenset, object]:
    """(status, kind, keys, parsed body) of one request, classified as tests/sglang_http.py
    classifies SGLang's replies: empty, text or json."""
    async with s.request(method, url + path, json=body) as resp:
        raw = await resp.read()
        if not raw:
            return resp.status, "empty", frozenset(), None
        if resp.content_type == "application/json":
            data = json.loads(raw)
            return resp.status, "json", frozenset(data) if isinstance(data, dict) else frozenset(), data
        return resp.status, "text", frozenset(), raw.decode()


# Info replies: SGLang's keys vary with the model and its arguments; the emulator's must be among them.
INFO = ("/model_info", "/server_info")


def assert_sglang_replies(src, path: str, status: int, kind: str, keys: frozenset, method: str = "POST") -> None:
    """The reply is one SGLang's handler for `path` can give: same status and kind, and for JSON
    the same keys (for the info routes, keys among SGLang's)."""
    shapes = src.reply_shapes(path, method) if len(src.routes()[path]) > 1 else src.reply_shapes(path)
    for r in shapes:
        same_keys = keys <= r.keys if path in INFO else keys == r.keys
        if r.status == status and r.kind == kind and (kind != "json" or same_keys):
            return
    raise AssertionError(f"{path}: ({status}, {kind}, {sorted(keys)}) is not among SGLang {src.version}'s replies {shapes}")


@pytest.mark.process
@pytest.mark.parametrize("version", SUPPORTED)
def test_emulated_replies_are_sglangs(sglang, start_server, version):
    src = sglang(version)
    url = start_server(0, "--emulate-sglang", version)
    has_sessions = "/begin_weight_update" in src.routes()
    refusal = src.update_refused_outside_session()
    cases = [
        ("GET", "/health", None, 200), ("GET", "/model_info", None, 200), ("GET", "/server_info", None, 200),
        ("POST", "/pause_generation", {"mode": "abort"}, 200), ("POST", "/continue_generation", {}, 200),
        ("POST", "/flush_cache", None, 200), ("POST", "/abort_request", {"rid": "nobody", "abort_all": False}, 200),
        ("POST", "/update_weight_version", {"new_version": "7", "abort_all_requests": False}, 200),
        ("POST", "/destroy_weights_update_group", {"group_name": "weight_update_group"}, 400),
    ]
    if has_sessions:
        cases += [("POST", "/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                                 "shapes": [[32]]}, 400),
                  ("POST", "/begin_weight_update", {}, 200), ("POST", "/begin_weight_update", {}, 400),
                  ("POST", "/end_weight_update", {}, 200), ("POST", "/end_weight_update", {}, 400)]

    async def scenario():
        async with aiohttp.ClientSession() as s:
            model_info = (await exchange(s, url, "GET", "/model_info"))[3]
            assert model_info["weight_version"] == ast.literal_eval(src.server_args_default("weight_version"))
            replies = [await exchange(s, url, m, p, b) for m, p, b, _ in cases]
            for (method, path, _, want), (status, kind, keys, data) in zip(cases, replies, strict=True):
                assert status == want, (path, status, data)
                assert_sglang_replies(src, path, status, kind, keys, method)
                if path == "/update_weights_from_distributed":  # refused at once, nothing received
                    assert data["message"] == refusal.message and refusal.before_receive
            info = (await exchange(s, url, "GET", "/server_info"))[3]
            assert info["version"] == version and set(info) - {"version"} <= src.server_args_fields()
            assert (await exchange(s, url, "GET", "/model_info"))[3]["weight_version"] == "7"
            if not has_sessions:
                assert (await exchange(s, url, "POST", "/begin_weight_update", {}))[0] == 404

    asyncio.run(scenario())


@pytest.mark.parametrize("version", SUPPORTED)
def test_emulated_routes_are_sglangs(sglang, version):
    src = sglang(version)
    routes = src.routes()
    args = parser().parse_args(["--model-path", "unused", "--emulate-sglang", version])
    served = BuiltinServer(args).routes()
    for method, path, _ in served:
        if path.startswith("/rlctl/") or path in INCLUDED_ROUTERS:
            continue
        assert method in routes.get(path, ()), f"the emulator serves {method} {path}, which SGLang {version} has not"
    assert ("/begin_weight_update" in routes) == any(p == "/begin_weight_update" for _, p, _ in served)


@pytest.mark.parametrize("version", SUPPORTED)
def test_group_layout_is_sglangs(sglang, version):
    """SGLang's TP worker r joins at rank_offset + r; rlctl gives each server as many ranks as its TP size."""
    assert sglang(version).weight_update_rank() == "rank_offset + self.tp_rank"
    assert group_layout([2, 2]) == (5, [1, 3])
    assert group_layout([4] * 8) == (33, [1, 5, 9, 13, 17, 21, 25, 29])  # the shipped Qwen3 recipe: 8 servers of TP 4
    assert group_layout([1, 2, 1]) == (5, [1, 2, 4])


@pytest.mark.process
def test_sglang_reply_shapes_are_taken(start_server):
    """The client takes both of SGLang's control shapes and refuses on HTTP 400 or success: false."""
    url = start_server(0, "--emulate-sglang", "0.5.23")

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = RolloutClient(url, s)
            await c.pause_generation("abort")  # {"message", "status": "ok"}: no success key
            await c.continue_generation()
            await c.begin_weight_update()
            with pytest.raises(RunError, match=r"refused \(HTTP 400\): a weight-update session is already open"):
                await c.begin_weight_update()
            await c.end_weight_update()

    asyncio.run(scenario())



# -- the flattened bucket, byte for byte against SGLang's FlattenedTensorBucket ---------------------

def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    kinds = [torch.bfloat16, torch.float32, torch.int8, torch.float16, torch.float32, torch.int64, torch.bfloat16]
    shapes = [(3, 5), (7,), (3,), (2, 3), (1,), (2,), (5, 1)]
    return [(f"t{i}", (torch.randn(s, generator=g) * 50).to(k)) for i, (k, s) in enumerate(zip(kinds, shapes, strict=True))]


@pytest.mark.parametrize("version", SUPPORTED)
def test_flattened_bucket_is_sglangs_byte_for_byte(sglang, version):
    bucket_cls = sglang(version).flattened_tensor_bucket()
    tensors = dict(mixed_tensors())
    metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]
    for bucket_bytes in (1 << 20, 40):  # one bucket of everything, and several small ones
        for bucket in plan_buckets(metas, bucket_bytes):
            named = [(m.name, tensors[m.name]) for m in bucket]
            ours = flatten_bucket([t for _, t in named])
            theirs = bucket_cls(named_tensors=named)
            assert torch.equal(ours, theirs.get_flattened_tensor())  # same bytes, same order, no padding
            received = bucket_cls(flattened_tensor=ours.clone(), metadata=theirs.get_metadata()).reconstruct_tensors()
            ours_back = unflatten_bucket(ours, [(m.name, tensors[m.name].dtype, m.shape) for m in bucket])
            for (name, a), (name_b, b) in zip(received, ours_back, strict=True):
                assert name == name_b and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                assert torch.equal(a.view(torch.uint8), tensors[name].view(torch.uint8))
            if hasattr(bucket_cls, "empty"):  # 0.5.23's receiver allocates from the announcement and checks alignment
                bucket_cls.empty([m.name for m in bucket], [m.dtype for m in bucket], [list(m.shape) for m in bucket], "cpu")


def test_an_unaligned_bucket_is_refused_as_sglang_refuses_it(sglang):
    bucket_cls = sglang("0.5.23").flattened_tensor_bucket()
    named = [("a", torch.ones(3, dtype=torch.int8)), ("b", torch.ones(2, dtype=torch.float32))]  # b at byte 3
    with pytest.raises(ValueError, match="Unaligned received tensor b"):
        bucket_cls.empty(["a", "b"], ["int8", "float32"], [[3], [2]], "cpu")
    with pytest.raises(ValueError, match="unaligned"):
        flatten_bucket([t for _, t in named])
    with pytest.raises(ValueError, match="Unaligned received tensor b"):
        list(unflatten_bucket(torch.zeros(11, dtype=torch.uint8), [("a", torch.int8, (3,)), ("b", torch.float32, (2,))]))


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_door_opens_what_sglang_opens(sglang, version):
    """The paths SGLang answers without its api key (utils/auth.py: path.startswith(...)) are
    the ones rlctl's servers answer without the run's token; both refuse with {"error": ...}."""
    from rlctl.process.auth import OPEN_PREFIXES

    tree = sglang(version).module("sglang/srt/utils/auth.py")
    opened = {call.args[0].value for call in ast.walk(tree) if isinstance(call, ast.Call)
              and isinstance(call.func, ast.Attribute) and call.func.attr == "startswith"
              and isinstance(call.func.value, ast.Name) and call.func.value.id == "path"
              and isinstance(call.args[0], ast.Constant)}
    assert opened and opened <= set(OPEN_PREFIXES), opened  # 0.5.15 has no /ready yet
    if version != "0.5.15.post1":
        assert opened == set(OPEN_PREFIXES)
    bodies = [set(ast.literal_eval(k) for k in node.keys) for node in ast.walk(tree) if isinstance(node, ast.Dict)
              and node.keys and all(isinstance(k, ast.Constant) for k in node.keys)]
    assert {"error"} in bodies
