"""rlctl's built-in rollout server: the SGLang HTTP protocol subset (contracts/sglang.md) on CPU.

    python -m rlctl.engines.rollout.builtin.server --model-path DIR --port 30000

It listens at once and answers 503 on /health until the model is loaded, as SGLang does. Weight
updates arrive the way SGLang receives them: /init_weights_update_group joins a process group
made by TCP rendezvous + PrefixStore(group_name); each /update_weights_from_distributed receives
one bucket by broadcast from rank 0. Like SGLang >= 0.5.21, updates are refused outside a
/begin_weight_update ... /end_weight_update session, so a sender that forgets it fails here too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any

from aiohttp import web

from rlctl.engines.rollout.builtin.engine import Engine, Request, SamplingParams, future_callback
from rlctl.engines.rollout.protocol import UPDATE_SESSION_SINCE, parse_version

log = logging.getLogger("rlctl.rollout")

SERVER_VERSION = "rlctl-builtin 1"


def ok(message: str = "") -> web.Response:
    return web.json_response({"success": True, "message": message})


def fail(message: str, status: int = 400) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=status)


class BuiltinServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine: Engine | None = None
        self.tokenizer = None
        self.weight_group = None
        self.weight_group_name: str | None = None
        self.in_update_session = False
        self.weight_device = None
        self.loading_error: str | None = None
        # Weight loads are one at a time, in arrival order, like SGLang's tokenizer manager lock.
        self.update_lock = asyncio.Lock()

    # -- start-up ------------------------------------------------------------------------------

    def load_model(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self.args.threads)
        torch.manual_seed(self.args.seed)
        model = AutoModelForCausalLM.from_pretrained(self.args.model_path, dtype=getattr(torch, self.args.dtype))
        if self.args.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.args.device))  # NCCL weight groups use the current device
        model.to(self.args.device).eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.args.model_path)
        except (OSError, ValueError):
            self.tokenizer = None  # token ids only, like --skip-tokenizer-init
        eos = model.config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.engine = Engine(
            model, eos_ids, pad, self.args.max_running_requests, self.args.seed,
            max_context=model.config.max_position_embeddings, weight_version=self.args.weight_version,
        )
        self.engine.start()
        log.info("model %s loaded: %d parameters", self.args.model_path, sum(p.numel() for p in model.parameters()))

    async def on_startup(self, app: web.Application) -> None:
        async def load() -> None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.load_model)
            except Exception as e:  # noqa: BLE001 - fatal: say why in one line, exit non-zero
                self.loading_error = f"{e.__class__.__name__}: {e}".splitlines()[0]
                log.error("model load failed: %s", self.loading_error)
                print(f"error: cannot load the model from {self.args.model_path}: {self.loading_error}", flush=True)
                os._exit(1)
        app["loader"] = asyncio.create_task(load())

    async def on_cleanup(self, app: web.Application) -> None:
        if self.engine is not None:
            self.engine.stop()

    def ready(self) -> bool:
        return self.engine is not None

    # -- health and info -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready():
            return web.Response(status=503, text=self.loading_error or "loading")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        if not self.ready():
            return web.Response(status=503)
        assert self.engine is not None
        return web.json_response({
            "model_path": self.args.model_path,
            "tokenizer_path": self.args.model_path,
            "is_generation": True,
            "weight_version": self.engine.weight_version,
        })

    async def server_info(self, request: web.Request) -> web.Response:
        if self.args.emulate_sglang:  # answer as that SGLang version does: no rlctl-only keys
            return web.json_response({"version": self.args.emulate_sglang, "model_path": self.args.model_path,
                                      "tp_size": 1, "dp_size": 1, "random_seed": self.args.seed,
                                      "max_running_requests": self.args.max_running_requests})
        return web.json_response({
            "version": SERVER_VERSION,
            "model_path": self.args.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "max_running_requests": self.args.max_running_requests,
            "random_seed": self.args.seed,
            # rlctl's client asks this to decide on /begin_weight_update (SGLang >= 0.5.21 needs it).
            "weight_update_session": True,
        })

    async def loads(self, request: web.Request) -> web.Response:
        if not self.ready():
            return web.Response(status=503)
        assert self.engine is not None
        return web.json_response(self.engine.load())

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        if not self.ready():
            return web.Response(status=503, text="loading")
        assert self.engine is not None
        try:
            body = await request.json()
            batch_ids, is_batch = self._input_ids(body)
            params = SamplingParams.from_json(body.get("sampling_params") or {})
            return_logprob = body.get("return_logprob", False)
            if not isinstance(return_logprob, bool):
                raise TypeError("return_logprob must be a boolean")
            rid = body.get("rid") or uuid.uuid4().hex
        except (TypeError, ValueError, KeyError) as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)

        loop = asyncio.get_running_loop()
        rids = rid if isinstance(rid, list) else [rid if not is_batch else f"{rid}-{i}" for i in range(len(batch_ids))]
        futures = []
        for ids, r in zip(batch_ids, rids, strict=False):
            fut = loop.create_future()
            self.engine.submit(Request(str(r), ids, params, return_logprob, future_callback(loop, fut)))
            futures.append(fut)
        try:
            done = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # client went away: stop spending compute on it
            for r in rids:
                self.engine.abort(str(r))
            raise
        results = [self._result(req) for req in done]
        return web.json_response(results if is_batch else results[0])

    def _input_ids(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
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
            if self.tokenizer is None:
                raise ValueError("this server has no tokenizer; send input_ids")
            texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            if not all(isinstance(t, str) for t in texts):
                raise TypeError("text must be a string or a list of strings")
            return [self.tokenizer(t)["input_ids"] for t in texts], isinstance(body["text"], list)
        raise KeyError("either input_ids or text is required")

    def _result(self, req: Request) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": req.weight_version or (self.engine.weight_version if self.engine else ""),
            "e2e_latency": time.monotonic() - req.created,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids, strict=False)]
        out: dict[str, Any] = {"output_ids": req.output_ids, "meta_info": meta}
        if self.tokenizer is not None:
            out["text"] = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
        return out

    async def abort_request(self, request: web.Request) -> web.Response:
        if self.engine is not None:
            body = await request.json()
            self.engine.abort(body.get("rid"), bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await request.json()
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return fail(f"unknown pause mode {mode!r}")
        if self.engine is not None:
            self.engine.pause(mode)
        return ok(f"paused ({mode})")

    async def continue_generation(self, request: web.Request) -> web.Response:
        if self.engine is not None:
            self.engine.resume()
        return ok("continued")

    async def flush_cache(self, request: web.Request) -> web.Response:
        # The cache holds only running requests (see engine.py); like SGLang, refuse while requests run.
        if self.engine is not None and not self.engine.idle:
            return web.Response(status=400, text="cannot flush while requests are running")
        return web.Response(status=200, text="Cache flushed.")

    # -- weight sync ---------------------------------------------------------------------------

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        from rlctl.engines.weightsync import DEFAULT_GROUP_NAME, init_custom_process_group

        body = await request.json()
        try:
            address, port = body["master_address"], int(body["master_port"])
            rank = int(body.get("rank_offset", 1))  # tp_size is 1: our one rank is rank_offset + 0
            world_size = int(body["world_size"])
            group_name = body.get("group_name", DEFAULT_GROUP_NAME)
            backend = body.get("backend", "nccl")
        except (KeyError, TypeError, ValueError) as e:
            return fail(f"bad request: {e}")
        on_gpu = self.engine is not None and self.engine.device.type == "cuda"
        if backend == "nccl" and not on_gpu:
            backend = "gloo"  # a CPU server; the sender picks gloo too when either side has no GPU
        self.weight_device = self.engine.device if backend == "nccl" and self.engine is not None else None
        if self.weight_group is not None:
            return fail(f"weight update group {self.weight_group_name!r} already exists; destroy it first")
        try:
            self.weight_group = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: init_custom_process_group(
                    backend=backend, init_method=f"tcp://{address}:{port}", world_size=world_size,
                    rank=rank, group_name=group_name,
                ),
            )
        except Exception as e:  # noqa: BLE001 - reported to the sender as SGLang does
            return fail(f"failed to join weight update group: {e}")
        self.weight_group_name = group_name
        log.info("joined weight update group %s as rank %d of %d", group_name, rank, world_size)
        return ok(f"joined {group_name} as rank {rank}")

    def _sessions_required(self) -> bool:
        """SGLang >= 0.5.21 refuses weight updates outside a session; older versions have none."""
        if not self.args.emulate_sglang:
            return True
        v = parse_version(self.args.emulate_sglang)
        return v is not None and v >= UPDATE_SESSION_SINCE

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        self.in_update_session = True
        return ok("weight update session begun")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        self.in_update_session = False
        return ok("weight update session ended")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        from rlctl.engines.weightsync import dtype_from_name

        body = await request.json()
        if self.weight_group is None:
            return fail("no weight update group; call /init_weights_update_group first")
        try:
            names = list(body["names"])
            dtypes = [dtype_from_name(d) for d in body["dtypes"]]
            shapes = [tuple(int(x) for x in s) for s in body["shapes"]]
            load_format = body.get("load_format")
            if not (len(names) == len(dtypes) == len(shapes)):
                raise ValueError("names, dtypes and shapes differ in length")
            if load_format not in (None, "flattened_bucket"):
                raise ValueError(f"unsupported load_format {load_format!r}")
        except (KeyError, TypeError, ValueError) as e:
            return fail(f"bad request: {e}")
        if not self.in_update_session and self._sessions_required():
            # The sender is about to broadcast; we must not leave it hanging in the collective,
            # so receive (and discard) the bucket, then refuse.
            await self._receive(names, dtypes, shapes, load_format)
            return fail("weight updates must happen between /begin_weight_update and /end_weight_update")
        async with self.update_lock:
            tensors = await self._receive(names, dtypes, shapes, load_format)
            assert self.engine is not None
            unknown = await asyncio.get_running_loop().run_in_executor(None, self._load, tensors)
            if unknown:
                return fail(f"unknown parameter names: {unknown[:5]}")
            version = body.get("weight_version")
            if version is not None:
                self.engine.weight_version = str(version)
        if body.get("abort_all_requests"):
            self.engine.abort(None, abort_all=True)
        return ok(f"updated {len(names)} tensors")

    async def _receive(self, names, dtypes, shapes, load_format):
        import torch
        import torch.distributed as dist

        from rlctl.engines.weightsync import flattened_size, unflatten_bucket

        group = self.weight_group
        device = self.weight_device or "cpu"  # NCCL receives straight into GPU memory, gloo into host memory

        def recv():
            if load_format == "flattened_bucket":
                metas = list(zip(names, dtypes, shapes, strict=False))
                flat = torch.empty(flattened_size(metas), dtype=torch.uint8, device=device)
                dist.broadcast(flat, src=0, group=group)
                return [(n, t.clone()) for n, t in unflatten_bucket(flat, metas)]
            out = []
            for n, d, s in zip(names, dtypes, shapes, strict=False):
                t = torch.empty(s, dtype=d, device=device)
                dist.broadcast(t, src=0, group=group)
                out.append((n, t))
            return out

        return await asyncio.get_running_loop().run_in_executor(None, recv)

    def _load(self, tensors) -> list[str]:
        import torch

        assert self.engine is not None
        state = self.engine.model.state_dict()
        unknown = [n for n, _ in tensors if n not in state]
        if unknown:
            return unknown
        with self.engine.model_lock, torch.no_grad():
            for name, t in tensors:
                state[name].copy_(t)
        return []

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "new_version" not in body:
            return fail("new_version is required")
        assert self.engine is not None
        if body.get("abort_all_requests"):
            self.engine.abort(None, abort_all=True)
        self.engine.weight_version = str(body["new_version"])
        return ok(f"weight version {self.engine.weight_version}")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        from rlctl.engines.weightsync import destroy_process_group

        if self.weight_group is None:
            return fail("no weight update group")
        group, self.weight_group, self.weight_group_name = self.weight_group, None, None
        await asyncio.get_running_loop().run_in_executor(None, destroy_process_group, group)
        return ok("destroyed")

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert self.engine is not None
        state = self.engine.model.state_dict()
        name = body.get("name")
        if name not in state:
            return fail(f"unknown parameter {name!r}")
        flat = state[name].detach().float().reshape(-1)
        truncate = body.get("truncate_size", 100)
        return web.json_response(flat[:truncate].tolist())

    async def weight_checksums(self, request: web.Request) -> web.Response:
        """rlctl-only: sha256 of every parameter's bytes, to check a sync bit for bit."""
        from rlctl.engines.weightsync import tensor_sha256

        assert self.engine is not None
        with self.engine.model_lock:
            sums = {n: tensor_sha256(t) for n, t in self.engine.model.state_dict().items()}
        return web.json_response({"weight_version": self.engine.weight_version, "checksums": sums})

    @web.middleware
    async def _record(self, request: web.Request, handler):
        """--record-requests: what a client sent, for checking it against SGLang's field lists."""
        if request.method == "POST":
            raw = await request.read()  # aiohttp keeps it: the handler reads it again
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            with open(self.args.record_requests, "a") as f:
                f.write(json.dumps({"path": request.path, "body": body}) + "\n")
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._record] if self.args.record_requests else [])
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/ready", self.health)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        if self._sessions_required():  # like SGLang before 0.5.21, an emulated old server has no such routes
            r.add_post("/begin_weight_update", self.begin_weight_update)
            r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/get_weights_by_name", self.get_weights_by_name)
        r.add_get("/rlctl/weight_checksums", self.weight_checksums)
        app.on_startup.append(self.on_startup)
        app.on_cleanup.append(self.on_cleanup)
        return app


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="rlctl built-in rollout server (SGLang protocol subset)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--random-seed", dest="seed", type=int, default=0)
    p.add_argument("--max-running-requests", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--weight-version", default="0")
    p.add_argument("--emulate-sglang", default="", metavar="VERSION",
                   help="answer /server_info and weight-update sessions as this SGLang version does (adapter tests)")
    p.add_argument("--record-requests", default="", metavar="FILE",
                   help="append every POST's path and JSON body to FILE (adapter contract tests)")
    return p


def serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    web.run_app(BuiltinServer(args).app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    serve(parser().parse_args())
