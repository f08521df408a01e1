"""rollout.engine=sglang, checked without SGLang (it needs CUDA): the launch command, and every
request the adapter sends, recorded by a built-in server that answers as SGLang 0.5.15 or 0.5.23
and compared with SGLang's field lists (docs/sglang.md), and with SGLang's own request structs
where sglang is importable."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json

import aiohttp
import pytest
import torch

from conftest import QUICKSTART, free_port, rlctl
from rlctl.engines.rollout.client import RolloutClient, SamplingRequest
from rlctl.engines.rollout.sglang import launch_command, speaks
from rlctl.engines.weightsync import WeightSender, tensor_sha256
from rlctl.errors import RunError
from rlctl.recipe import SGLangConfig, load_recipe

# Request fields of SGLang 0.5.15 .. 0.5.23 (docs/sglang.md). A key outside these is a key a real
# server rejects or ignores.
FIELDS = {
    "/generate": {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len", "rid", "stream"},
    "/abort_request": {"rid", "abort_all"},
    "/pause_generation": {"mode"},
    "/continue_generation": set(),
    "/flush_cache": set(),
    "/begin_weight_update": set(),
    "/end_weight_update": set(),
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                                         "weight_version", "load_format"},
    "/update_weight_version": {"new_version", "abort_all_requests"},
    "/destroy_weights_update_group": {"group_name"},
}
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
                   "skip_special_tokens", "no_stop_trim", "n", "sampling_seed"}
DTYPES = {"float32", "bfloat16", "float16"}


def test_launch_command():
    cfg = SGLangConfig(tp_size=2, mem_fraction_static=0.7, api_key="k3y", extra_args=["--attention-backend", "fa3"])
    assert launch_command("/venv/bin/python", "/models/Qwen3-1.7B", cfg, host="0.0.0.0", port=30001, seed=7) == [
        "/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/Qwen3-1.7B", "--tp-size", "2",
        "--host", "0.0.0.0", "--port", "30001", "--mem-fraction-static", "0.7", "--dtype", "bfloat16",
        "--random-seed", "7", "--skip-tokenizer-init", "--api-key", "k3y", "--attention-backend", "fa3"]


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
])
def test_bad_sglang_settings_name_the_key(tmp_path, override, key):
    res = rlctl("launch", str(QUICKSTART), override, f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert res.returncode == 2 and f": {key}: " in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_sglang_recipe_is_accepted():
    r = load_recipe(QUICKSTART, ["rollout.engine=sglang", "rollout.device=cuda", "train.device=cuda"])
    assert r.rollout.engine == "sglang" and r.rollout.sglang.skip_tokenizer_init


def check_body(path: str, body) -> None:
    assert path in FIELDS, f"the adapter called {path}, which is not in SGLang's API"
    assert isinstance(body, dict), (path, body)
    assert set(body) <= FIELDS[path], f"{path}: fields {set(body) - FIELDS[path]} are not SGLang's"
    if path == "/generate":
        assert set(body["sampling_params"]) <= SAMPLING_FIELDS, body["sampling_params"]
        assert all(isinstance(t, int) for t in body["input_ids"]) and isinstance(body["return_logprob"], bool)
        assert body["logprob_start_len"] == -1 and isinstance(body["rid"], str)
    if path == "/update_weights_from_distributed":
        assert len(body["names"]) == len(body["dtypes"]) == len(body["shapes"])
        assert set(body["dtypes"]) <= DTYPES
        assert all(isinstance(d, int) for shape in body["shapes"] for d in shape)
        assert body["load_format"] in (None, "flattened_bucket")
        assert body["weight_version"] is None or isinstance(body["weight_version"], str)
    if path == "/init_weights_update_group":
        assert isinstance(body["master_port"], int) and body["backend"] in ("nccl", "gloo")
    if path == "/pause_generation":
        assert body["mode"] in ("abort", "retract", "in_place")


@pytest.mark.parametrize("version", ["0.5.15", "0.5.23"])
def test_every_request_matches_the_contract(start_server, tiny_model_dir, tmp_path, version):
    from transformers import AutoModelForCausalLM

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
            info = await c.server_info()
            assert info["version"] == version and await c.needs_update_session() == (speaks(version) == "session")
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
    for call in calls:
        check_body(call["path"], call["body"])
    paths = [c["path"] for c in calls]
    sync = [p for p in paths if p not in ("/generate", "/abort_request", "/init_weights_update_group",
                                         "/destroy_weights_update_group")]
    updates = sync.count("/update_weights_from_distributed")
    assert updates > 1  # several buckets
    session = ["/begin_weight_update"] if version >= "0.5.21" else []
    assert sync == ["/pause_generation", "/flush_cache", *session, *["/update_weights_from_distributed"] * updates,
                    "/update_weight_version", *[p.replace("begin", "end") for p in session], "/continue_generation"]
    assert paths[-1] == "/destroy_weights_update_group"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed (it needs CUDA)")
def test_fields_exist_in_sglang_io_structs():
    from sglang.srt.managers import io_struct

    structs = {
        "/generate": io_struct.GenerateReqInput,
        "/init_weights_update_group": io_struct.InitWeightsUpdateGroupReqInput,
        "/update_weights_from_distributed": io_struct.UpdateWeightsFromDistributedReqInput,
        "/destroy_weights_update_group": io_struct.DestroyWeightsUpdateGroupReqInput,
        "/update_weight_version": io_struct.UpdateWeightVersionReqInput,
    }
    for path, cls in structs.items():
        names = {f.name for f in dataclasses.fields(cls)}
        used = FIELDS[path] - {"text", "stream"}
        assert used <= names, f"{path}: {used - names} not in {cls.__name__}"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_local_sglang_run_without_sglang_is_a_one_line_error(tmp_path):
    res = rlctl("launch", str(QUICKSTART), "rollout.engine=sglang", "rollout.device=cuda", f"run.output_dir={tmp_path}",
                cwd=tmp_path)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.engine=sglang needs sglang" in lines[0], res.stderr
    assert not list(tmp_path.iterdir())  # nothing started, no run directory
