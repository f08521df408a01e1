"""VllmClient driven over HTTP against a stand-in server that answers with the reply keys of vLLM's
own handlers (tests/vllm_source.py reads the wheel of each supported release): the routes and
methods it calls, the bodies and query parameters it sends, what it reads from the replies, and
the engine request id it aborts. The stand-in listens on loopback, so this module is in the
process tier; what is read from vLLM's source alone is tests/test_vllm_contract.py."""

from __future__ import annotations

import ast
import asyncio
import functools
from urllib.parse import parse_qs

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

import vllm_source
from rlctl.engines.rollout.vllm.client import VllmClient, completion_body, engine_request_id
from test_vllm_contract import (
    BODY_PARAMS,
    CLIENT_ROUTES,
    INIT_INFO,
    INIT_INFO_KEYS,
    NCCL,
    SAMPLING,
    calls,
    fits,
)
from vllm_source import PROTOCOL, RL_ROUTER, SERVING, SUPPORTED, literal_values, render

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def vllm():
    """vllm(version) -> the Source of that version's wheel (MissingWheel, failing the test, only under CI)."""
    return vllm_source.source


# A value for each key vLLM's replies have: a key the client reads but vLLM lacks is missing here too.
PLACEHOLDERS = {"status": "ok", "is_paused": False, "aborted": 1, "weight_version": "3", "world_size": 2,
                "message": "done", "success": True, "new_version": "4"}


CHOICE = {"index": 0, "text": "", "token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.5, -0.25]},
          "finish_reason": "stop", "stop_reason": None, "weight_versions": [{"version": "3", "start": 0, "end": 2}]}


def vllm_replies(src: vllm_source.Source, version: str) -> dict:
    """The stand-in server's replies: each route's 200 JSON keys as vLLM's handler gives them."""
    replies = {}
    for method, path in CLIENT_ROUTES - {("POST", "/v1/completions"), ("GET", "/health")}:
        keys = {k for r in src.reply_shapes(path, method) if r.status == 200 and r.kind == "json" for k in r.keys}
        replies[(method, path)] = {k: version if k == "version" else PLACEHOLDERS.get(k) for k in keys}
    fields = src.class_fields(PROTOCOL, "CompletionResponseChoice")
    usage = src.class_fields(PROTOCOL, "UsageInfo")
    replies[("POST", "/v1/completions")] = {"choices": [{k: v for k, v in CHOICE.items() if k in fields}],
                                            "usage": {k: 2 for k in usage if k == "prompt_tokens"}}
    return replies


@functools.cache
def drive_client(version: str) -> tuple[list, dict]:
    """Every VllmClient call, once, against an HTTP server that answers with vLLM's reply keys:
    ([(method, path, query, body) it sent], {what it read})."""
    replies, sent = vllm_replies(vllm_source.source(version), version), []

    async def handle(request: web.Request) -> web.Response:
        body = await request.json() if request.body_exists else None
        sent.append((request.method, request.path, parse_qs(request.query_string), body))
        data = replies.get((request.method, request.path))
        return web.Response() if data is None else web.json_response(data)

    async def run() -> dict:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", handle)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            client = VllmClient(str(server.make_url("")), session, "tok")
            read = {"info": await client.server_info(), "weight_version": await client.weight_version(),
                    "is_paused": await client.is_paused()}
            await client.wait_healthy(5)
            read["output"] = await client.generate([1, 2], SAMPLING, "r")
            await client.abort("r")
            await client.abort(abort_all=True)
            await client.pause_generation()
            await client.continue_generation()
            await client.init_weight_transfer_engine({k: 1 for k in INIT_INFO_KEYS})
            await client.start_weight_update()
            await client.update_weights(names=["w"], dtype_names=["bfloat16"], shapes=[[2, 2]])
            await client.finish_weight_update("4")
            await client.shutdown_weight_transfer_engine()
            await client.update_weight_version("4")
            return read
    read = asyncio.run(run())
    return sent, read


def sent_body(version: str, path: str) -> dict:
    return next(body for _, p, _, body in drive_client(version)[0] if p == path)


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_routes_the_client_uses_exist_with_their_methods(vllm, version):
    used = {(method, path) for method, path, _, _ in drive_client(version)[0]}
    assert used == CLIENT_ROUTES  # a route the client starts using needs its checks here
    routes = vllm(version).routes()
    assert not {(m, p) for m, p in CLIENT_ROUTES if m not in routes.get(p, ())}


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_completion_body_is_fields_of_completion_request(vllm, version):
    fields = vllm(version).class_fields(PROTOCOL, "CompletionRequest")
    body = completion_body([1, 2], SAMPLING, "r", "qwen")
    assert body == sent_body(version, "/v1/completions") | {"model": "qwen"}
    assert {"return_weight_versions", "return_token_ids", "return_tokens_as_token_ids", "request_id", "logprobs"} <= set(body)
    assert not set(body) - set(fields)  # vLLM takes unknown keys silently (extra="allow")
    assert not {k: fields[k].annotation for k, v in body.items() if not fits(v, fields[k].annotation)}
    assert fields["logprobs"].annotation.startswith("int")


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_weight_routes_take_their_bodies_as_embedded_keys(vllm, version):
    src = vllm(version)
    for path, names in BODY_PARAMS.items():
        params = src.params(path, "POST")
        assert {n for n, p in params.items() if p.where == "Body"} == names
        assert all(params[n].embed for n in names)
        assert set(sent_body(version, path)) == names


@pytest.mark.parametrize("version", SUPPORTED)
def test_pause_takes_mode_abort_as_a_query_parameter(vllm, version):
    src = vllm(version)
    mode = src.params("/pause", "POST")["mode"]
    assert (mode.where, mode.type) == ("Query", "PauseMode")
    assert "abort" in literal_values(src.assignment(RL_ROUTER, "PauseMode"))
    queries = [q for _, p, q, _ in drive_client(version)[0] if p == "/pause"]
    assert queries == [{"mode": ["abort"]}]


@pytest.mark.parametrize("version", SUPPORTED)
def test_update_and_init_info_are_nccl_engine_fields(vllm, version):
    src = vllm(version)
    nccl = src.definition(NCCL, "NCCLWeightTransferEngine", ast.ClassDef)[1]
    classes = {ast.unparse(s.targets[0]): ast.unparse(s.value) for s in nccl.body if isinstance(s, ast.Assign)}
    assert classes["update_info_cls"] == "NCCLWeightTransferUpdateInfo"
    assert classes["init_info_cls"] == "NCCLWeightTransferInitInfo"
    update = src.class_fields(NCCL, "NCCLWeightTransferUpdateInfo")
    assert set(sent_body(version, "/update_weights")["update_info"]) == {"names", "dtype_names", "shapes"} <= set(update)
    init = src.class_fields(INIT_INFO, "NCCLWeightTransferInitInfo")
    assert set(INIT_INFO_KEYS) <= set(init)  # vLLM builds it with NCCLWeightTransferInitInfo(**init_info)
    assert {name for name, f in init.items() if f.default is None} <= set(INIT_INFO_KEYS)


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_client_reads_vllms_replies(vllm, version):
    src = vllm(version)

    def fields(name: str, rel: str = PROTOCOL) -> set[str]:
        return set(src.class_fields(rel, name))
    assert {"token_ids", "logprobs", "finish_reason", "stop_reason", "weight_versions"} <= fields("CompletionResponseChoice")
    assert {"choices", "usage"} <= fields("CompletionResponse")
    assert "token_logprobs" in fields("CompletionLogProbs")
    assert fields("WeightVersionSpan", "vllm/outputs.py") == {"version", "start", "end"}
    assert "prompt_tokens" in fields("UsageInfo")
    read = drive_client(version)[1]  # the client, answered with these fields and the handlers' keys
    assert read["info"] == {"version": version, "tp_size": 2}
    assert (read["weight_version"], read["is_paused"]) == ("3", False)
    out = read["output"]
    assert (out.output_ids, out.logprobs, out.weight_version, out.prompt_tokens) == ([7, 8], [-0.5, -0.25], "3", 2)
    assert out.finish_reason == {"type": "stop"}


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_engine_runs_a_prompt_under_the_id_the_client_aborts(vllm, version):
    src = vllm(version)
    create = src.function(SERVING, "_create_completion")
    ids = {ast.unparse(n.targets[0]): n.value for n in ast.walk(create) if isinstance(n, ast.Assign)
           and ast.unparse(n.targets[0]) in ("request_id", "request_id_item")}
    (base,) = [v.value for v in ids["request_id"].values if isinstance(v, ast.FormattedValue)]
    assert ast.unparse(base) == "self._base_request_id(raw_request, request.request_id)"  # the body's id, no header
    request_id = render(ids["request_id"], {ast.unparse(base): "r"})
    assert engine_request_id("r") == render(ids["request_id_item"], {"request_id": request_id, "i": "0"})
    generate = calls(create, "self.engine_client.generate")
    assert [ast.unparse(c.args[2]) for c in generate] == ["request_id_item"]
    assert sent_body(version, "/abort_requests") == {"request_ids": [engine_request_id("r")]}
