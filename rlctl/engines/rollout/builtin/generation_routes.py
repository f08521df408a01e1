"""The built-in server's generation routes: /generate and the controls around it (abort, pause,
continue, flush_cache), with SGLang's request fields and reply shapes (docs/sglang.md)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from rlctl.engines.rollout.builtin.engine import Request, SamplingParams, future_callback
from rlctl.engines.rollout.builtin.state import RELEASED, ServerState, error, status_ok

PAUSE_MODES = ("abort", "retract", "in_place")


def parse_input_ids(body: dict[str, Any], tokenizer: Any) -> tuple[list[list[int]], bool]:
    """The prompts of a /generate body as token ids, and whether the body was a batch.

    Raises TypeError/ValueError/KeyError (-> HTTP 400) as SGLang rejects a malformed body."""
    if "input_ids" in body and body["input_ids"] is not None:
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            batch = ids
            is_batch = True
        else:
            batch, is_batch = [ids], False
        for seq in batch:
            if not isinstance(seq, list) or not seq or not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
                raise TypeError("input_ids must be a non-empty list of integers (or a list of such lists)")
        return batch, is_batch
    if "text" in body:
        if tokenizer is None:
            raise ValueError("this server has no tokenizer; send input_ids")
        texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("text must be a string or a list of strings")
        return [tokenizer(t)["input_ids"] for t in texts], isinstance(body["text"], list)
    raise KeyError("either input_ids or text is required")


def generate_reply(req: Request, current_version: str, tokenizer: Any) -> dict[str, Any]:
    """One finished request as SGLang answers it: output_ids, meta_info and, with a tokenizer, text."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "weight_version": req.weight_version or current_version,
        "e2e_latency": time.monotonic() - req.created,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids, strict=False)]
    out: dict[str, Any] = {"output_ids": req.output_ids, "meta_info": meta}
    if tokenizer is not None:
        out["text"] = tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
    return out


class GenerationRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def generate(self, request: web.Request) -> web.Response:
        engine = self.state.engine
        if engine is None:
            return web.Response(status=503, text="loading")
        try:
            body = await request.json()
            batch_ids, is_batch = parse_input_ids(body, self.state.tokenizer)
            params = SamplingParams.from_json(body.get("sampling_params") or {})
            return_logprob = body.get("return_logprob", False)
            if not isinstance(return_logprob, bool):
                raise TypeError("return_logprob must be a boolean")
            rid = body.get("rid") or uuid.uuid4().hex
        except (TypeError, ValueError, KeyError) as e:
            return error(str(e))
        if engine.held:  # memory released (memory_routes.py): SGLang's error reply, nothing queued
            return error(f"generation refused: {RELEASED}")

        loop = asyncio.get_running_loop()
        rids = rid if isinstance(rid, list) else [rid if not is_batch else f"{rid}-{i}" for i in range(len(batch_ids))]
        futures = []
        for ids, r in zip(batch_ids, rids, strict=False):
            fut = loop.create_future()
            engine.submit(Request(str(r), ids, params, return_logprob, future_callback(loop, fut)))
            futures.append(fut)
        try:
            done = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # client went away: stop spending compute on it
            for r in rids:
                engine.abort(str(r))
            raise
        results = [generate_reply(req, engine.weight_version, self.state.tokenizer) for req in done]
        return web.json_response(results if is_batch else results[0])

    async def abort_request(self, request: web.Request) -> web.Response:
        if self.state.engine is not None:
            body = await request.json()
            self.state.engine.abort(body.get("rid"), bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await request.json()
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:  # SGLang's body is validated against Literal[...] by FastAPI: 422
            return web.json_response({"detail": [{"loc": ["body", "mode"], "msg": f"not one of {PAUSE_MODES}"}]},
                                     status=422)
        if self.state.engine is not None:
            self.state.engine.pause(mode)
        return status_ok("Generation paused successfully.")

    async def continue_generation(self, request: web.Request) -> web.Response:
        if self.state.engine is not None:
            self.state.engine.resume()
        return status_ok("Generation continued successfully.")

    async def flush_cache(self, request: web.Request) -> web.Response:
        # The cache holds only running requests (see engine.py); like SGLang, refuse while requests run.
        if self.state.engine is not None and not self.state.engine.idle:
            return web.Response(status=400, text="cannot flush while requests are running")
        return web.Response(status=200, text="Cache flushed.")
