"""The built-in server answering as vLLM's OpenAI server in dev mode (--emulate-vllm VERSION).

The routes, request fields and reply shapes are those of vLLM 0.33.0 / 0.34.0 that rlctl's vLLM
adapter uses (rlctl/engines/rollout/vllm/client.py; tests/test_vllm_contract.py derives them from
vLLM's source): /v1/completions with token-id prompts, per-token log-probs and weight-version
spans; /pause?mode=, /resume, /is_paused, /abort_requests; sleep mode (vllm_sleep.py); the
weight-transfer routes, received
the way vLLM's NCCL backend receives (packed chunks, vllm/group.py packed_chunks) but over gloo on
the host (vllm/group.py TransferGroup). As in vLLM, the dev routes exist only when the server starts
with VLLM_SERVER_DEV_MODE=1; without it they answer 404. The door is the one a run's vLLM servers
have (vllm/auth.py): every route but /health, OPTIONS included, asks for the token.

Differences that remain: one process generates (a TP size only changes the ranks the server takes
in the group, and the emulation takes TP 1), and replies carry no text field worth reading.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from typing import Any

from aiohttp import web

from rlctl.engines.rollout.builtin.engine import Request, SamplingParams, future_callback
from rlctl.engines.rollout.builtin.state import ServerState

log = logging.getLogger("rlctl.rollout")

PAUSE_MODES = ("abort", "wait", "keep")
"""vLLM's PauseMode (vllm/v1/engine/__init__.py)."""


def dev_mode() -> bool:
    """vLLM's envs.VLLM_SERVER_DEV_MODE: bool(int(os.getenv("VLLM_SERVER_DEV_MODE", "0")))."""
    try:
        return bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0")))
    except ValueError:
        return False


def vllm_door(token: str | None):
    """The door of a server emulating vLLM: TokenDoor (rlctl/engines/rollout/vllm/auth.py), the one
    a run puts in front of its real vLLM servers, decides, so the emulation refuses what they
    refuse: every route but /health, whatever the method (OPTIONS included), without the token or
    with a wrong one, 401 {"error": "Unauthorized"} as vLLM answers. No handler runs for a refused
    request. Without a token (a server started by hand) the door is open, as vLLM's without a key."""
    from rlctl.engines.rollout.vllm.auth import TokenDoor

    door = TokenDoor(None, token) if token else None

    @web.middleware
    async def check(request: web.Request, handler):
        given = request.headers.get("Authorization")
        headers = [(b"authorization", given.encode("latin-1", "replace"))] if given is not None else []
        if door is not None and not door.allowed({"path": request.path, "method": request.method, "headers": headers}):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def error_response(message: str, status: int, kind: str) -> web.Response:
    """vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


def unprocessable(field: str, where: str = "body") -> web.Response:
    """FastAPI's answer to a request missing a required field: 422 with `detail`."""
    return web.json_response({"detail": [{"type": "missing", "loc": [where, field], "msg": "Field required"}]},
                             status=422)


def sampling_of(body: dict[str, Any]) -> SamplingParams:
    """A CompletionRequest's sampling fields as the engine takes them (TypeError/ValueError -> 400)."""
    top_k = body.get("top_k") or 0
    return SamplingParams.from_json({
        "max_new_tokens": body.get("max_tokens", 16) if body.get("max_tokens") is not None else 16,
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "top_k": -1 if top_k in (0, -1) else top_k,
        "stop_token_ids": body.get("stop_token_ids") or [],
        "ignore_eos": bool(body.get("ignore_eos", False)),
    })


def completion_reply(req: Request, body: dict[str, Any], request_id: str, current_version: str) -> dict[str, Any]:
    """One finished request as vLLM's CompletionResponse (one choice)."""
    reason = (req.finish_reason or {}).get("type")
    matched = (req.finish_reason or {}).get("matched")
    choice: dict[str, Any] = {
        "index": 0, "text": "", "logprobs": None, "finish_reason": reason,
        "stop_reason": matched if matched in req.params.stop_token_ids else None,
        "token_ids": list(req.output_ids) if body.get("return_token_ids") else None,
        "prompt_token_ids": list(req.input_ids) if body.get("return_token_ids") else None,
        "prompt_logprobs": None, "routed_experts": None, "weight_versions": None,
    }
    if body.get("logprobs") is not None:
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        tokens = [f"token_id:{t}" if as_ids else str(t) for t in req.output_ids]
        choice["logprobs"] = {"text_offset": [0] * len(tokens), "token_logprobs": list(req.output_logprobs),
                              "tokens": tokens,
                              "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, req.output_logprobs, strict=False)]}
    if body.get("return_weight_versions"):
        n = len(req.output_ids)
        choice["weight_versions"] = [{"version": req.weight_version or current_version, "start": 0, "end": n}] if n else []
    usage = {"prompt_tokens": len(req.input_ids), "completion_tokens": len(req.output_ids),
             "total_tokens": len(req.input_ids) + len(req.output_ids), "prompt_tokens_details": None}
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or "", "choices": [choice], "usage": usage, "system_fingerprint": None}


SCHEDULER_GAUGES = {
    "vllm:num_requests_running": ("num_running_reqs", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("num_waiting_reqs", "Number of requests waiting to be processed."),
}
"""The two of vLLM's Prometheus gauges the emulation serves on /metrics (name -> the engine's load
key, vLLM's documentation string); tests/test_vllm_contract.py reads them from vLLM's loggers.py."""


class VllmRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.refusing = False
        """Paused in abort or wait mode: new requests get 503 until /resume, as vLLM does."""
        self.paused = False
        self.group = None
        self.buffer_bytes = 0
        self.update_lock = asyncio.Lock()

    def table(self, health, sleep: Any = None) -> list[tuple[str, str, Any]]:
        """Its routes; `sleep`: the sleep-mode routes (vllm_sleep.py), dev routes too."""
        routes = [("GET", "/health", health), ("GET", "/version", self.version), ("GET", "/metrics", self.metrics),
                  ("POST", "/v1/completions", self.completions)]
        if dev_mode():
            routes += [("POST", "/pause", self.pause), ("POST", "/resume", self.resume),
                       ("GET", "/is_paused", self.is_paused), ("POST", "/abort_requests", self.abort_requests),
                       ("POST", "/init_weight_transfer_engine", self.init_weight_transfer_engine),
                       ("POST", "/shutdown_weight_transfer_engine", self.shutdown_weight_transfer_engine),
                       ("POST", "/start_weight_update", self.start_weight_update),
                       ("POST", "/update_weights", self.update_weights),
                       ("POST", "/finish_weight_update", self.finish_weight_update),
                       ("POST", "/update_weight_version", self.update_weight_version),
                       ("GET", "/weight_info", self.weight_info), ("GET", "/get_world_size", self.get_world_size)]
            routes += sleep.table() if sleep is not None else []
        return routes

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.state.args.emulate_vllm})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text, as vLLM mounts it on /metrics in every mode: of its many series, the two
        scheduler gauges (vllm/v1/metrics/loggers.py: vllm:num_requests_running, _waiting)."""
        engine = self.state.engine
        load = engine.load() if engine is not None else {"num_running_reqs": 0, "num_waiting_reqs": 0}
        labels = f'engine="0",model_name="{self.state.args.model_path}"'
        text = "".join(f"# HELP {name} {doc}\n# TYPE {name} gauge\n{name}{{{labels}}} {float(load[key])}\n"
                       for name, (key, doc) in SCHEDULER_GAUGES.items())
        return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- generation ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.Response:
        engine = self.state.engine
        if engine is None:
            return error_response("the engine is loading", 503, "ServiceUnavailableError")
        try:
            body = await request.json()
            prompt = body.get("prompt")
            if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)):
                raise TypeError("prompt must be a non-empty list of token ids (this server has no text prompts)")
            params = sampling_of(body)
            rid = str(body.get("request_id") or uuid.uuid4().hex)
        except (TypeError, ValueError) as e:
            return error_response(str(e), 400, "BadRequestError")
        if self.refusing:
            return error_response("Generation is paused; please retry", 503, "ServiceUnavailableError")
        request_id = f"cmpl-{rid}"
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        engine.submit(Request(f"{request_id}-0", prompt, params, body.get("logprobs") is not None,
                              future_callback(loop, fut)))
        try:
            req = await fut
        except asyncio.CancelledError:
            engine.abort(f"{request_id}-0")
            raise
        return web.json_response(completion_reply(req, body, request_id, engine.weight_version))

    async def abort_requests(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not isinstance(body, dict):
            return web.json_response({"detail": "Request body must be a JSON object"}, status=400)
        engine = self.state.engine
        ids = body.get("request_ids")
        if engine is None:
            return web.json_response({"status": "aborted", "aborted": 0})
        if ids:
            for rid in ids:
                engine.abort(str(rid))
            return web.json_response({"status": "aborted", "aborted": len(ids)})
        return web.json_response({"status": "aborted", "aborted": engine.abort(None, abort_all=True)})

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return web.json_response({"detail": [{"type": "literal_error", "loc": ["query", "mode"],
                                                  "msg": f"Input should be one of {PAUSE_MODES}"}]}, status=422)
        await self.pause_scheduler(mode)
        return web.json_response({"status": "paused"})

    async def pause_scheduler(self, mode: str) -> None:
        """vLLM's pause_scheduler: abort drops the requests, wait lets them finish first, keep
        holds them where they are; abort and wait refuse new requests until the resume."""
        engine = self.state.engine
        self.refusing = mode in ("abort", "wait")
        if engine is not None:
            if mode == "wait":
                while not engine.idle:
                    await asyncio.sleep(0.01)
            engine.pause("abort" if mode == "abort" else "in_place")
        self.paused = True

    def resume_scheduler(self) -> None:
        if self.state.engine is not None:
            self.state.engine.resume()
        self.paused = self.refusing = False

    async def resume(self, request: web.Request) -> web.Response:
        self.resume_scheduler()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    # -- weight transfer -------------------------------------------------------------------------

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        from rlctl.engines.rollout.vllm.group import INIT_INFO_KEYS, TransferGroup

        body = await request.json()
        info = body.get("init_info") if isinstance(body, dict) else None
        if not isinstance(info, dict):
            return unprocessable("init_info")
        unknown = set(info) - set(INIT_INFO_KEYS) - {"nccl_unique_id_b64", "use_load_plan", "metadata"}
        if unknown or not info.get("packed", False):
            return error_response(f"the emulation takes packed NCCL init_info only; unexpected {sorted(unknown)}",
                                  500, "InternalServerError")
        foreign = self.state.foreign_master(info.get("master_address"), info.get("master_port"))
        if foreign:  # only the run's own trainer sends weights, from the port it announced: refused before any connect
            return error_response(foreign, 400, "BadRequestError")
        rank = int(info["rank_offset"])  # + dp_rank * TP * PP + rank: one worker, rank 0 of dp 0
        try:
            group = await asyncio.get_running_loop().run_in_executor(None, lambda: TransferGroup.join(
                "gloo", master_address=info["master_address"], master_port=int(info["master_port"]), rank=rank,
                world_size=int(info["world_size"])))
        except Exception as e:  # noqa: BLE001 - vLLM's handler lets it out: a 500
            return error_response(f"weight transfer init failed: {e}", 500, "InternalServerError")
        self.group, self.buffer_bytes = group, int(info["packed_buffer_size_bytes"])
        log.info("joined vLLM's weight-transfer group as rank %d of %s", rank, info["world_size"])
        return web.json_response({"message": "Weight transfer initialized"})

    async def shutdown_weight_transfer_engine(self, request: web.Request) -> web.Response:
        group, self.group = self.group, None
        if group is not None:
            group.close()
        return web.json_response({"message": "Weight transfer shut down"})

    async def start_weight_update(self, request: web.Request) -> web.Response:
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await request.json()
        info = body.get("update_info") if isinstance(body, dict) else None
        if not isinstance(info, dict):
            return unprocessable("update_info")
        names, dtypes, shapes = info.get("names", []), info.get("dtype_names", []), info.get("shapes", [])
        if not (len(names) == len(dtypes) == len(shapes)):
            return error_response("`dtype_names` and `shapes` should be of the same size as `names`", 500,
                                  "InternalServerError")
        if self.group is None:
            return error_response("NCCL weight transfer not initialized. Call init_transfer_engine() first.", 500,
                                  "InternalServerError")
        engine = self.state.engine
        assert engine is not None
        async with self.update_lock:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._receive, names, dtypes, shapes)
            except Exception as e:  # noqa: BLE001 - a failed receive is vLLM's 500
                return error_response(f"weight update failed: {e}", 500, "InternalServerError")
        return web.json_response({"message": "Weights updated"})

    def _receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """vLLM's packed consumer: chunks cut by packed_chunks, each one uint8 broadcast, its
        tensors' bytes back to back; each tensor is loaded into the parameter of its name."""
        import torch

        from rlctl.engines.rollout.vllm.group import packed_chunks

        kinds = [getattr(torch, d) for d in dtypes]
        sizes = [math.prod(s) * k.itemsize for s, k in zip(shapes, kinds, strict=True)]
        engine = self.state.engine
        params = engine.model.state_dict()
        unknown = [n for n in names if n not in params]
        for chunk in packed_chunks(sizes, self.buffer_bytes):
            packed = torch.empty(sum(sizes[i] for i in chunk), dtype=torch.uint8)
            self.group.broadcast(packed)  # received whatever follows: the sender is broadcasting
            if unknown:
                continue
            views = packed.split([sizes[i] for i in chunk])
            with engine.model_lock, torch.no_grad():
                for i, raw in zip(chunk, views, strict=True):
                    params[names[i]].copy_(raw.view(kinds[i]).view(shapes[i]))
        if unknown:
            raise KeyError(f"unknown parameter names: {unknown[:5]}")

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = await request.json() if raw else {}
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is not None and self.state.engine is not None:
            self.state.engine.weight_version = str(version)
        return web.json_response({"message": "Weight update finished"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not isinstance(body, dict) or "new_version" not in body:
            return unprocessable("new_version")
        if self.state.engine is not None:
            self.state.engine.weight_version = str(body["new_version"])
        return web.json_response({"success": True, "new_version": body["new_version"]})

    async def weight_info(self, request: web.Request) -> web.Response:
        engine = self.state.engine
        return web.json_response({"weight_version": engine.weight_version if engine is not None else "default"})

    async def get_world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": self.state.tp_size})
