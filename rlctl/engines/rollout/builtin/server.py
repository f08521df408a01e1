"""rlctl's built-in rollout server: the SGLang HTTP protocol subset (docs/sglang.md) on CPU or GPU,
or with --emulate-vllm vLLM's (vllm_routes.py).

    python -m rlctl.engines.rollout.builtin.server --model-path DIR --port 30000

It listens at once and answers 503 on /health until the model is loaded, as SGLang does. This
module is the process: its flags, loading the model, health and info, and the route table. The
routes live beside it by concern: generation_routes.py (/generate and its controls),
weight_routes.py (the weight-update group and sessions), memory_routes.py (releasing and
resuming the model's memory); engine.py is the generation loop.

With `--api-key-file FILE` (every rlctl run gives its token file) every route but /health asks for
`Authorization: Bearer <token>`, or with `--key-scope ROLE/KEY_ID` too for this process's own key
derived from that token (what an rlctl run does: rlctl/process/auth.py role_key), 401 without it and 403
with a wrong one, and
`--weight-group-master HOST[:PORT]` names the only trainer address (and port) it joins a weight group at.
Without them the server is open, as SGLang is without --api-key: for ad-hoc use on one's own host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable

from aiohttp import web

from rlctl.process.auth import read_token_file, role_key, token_middleware
from rlctl.engines.rollout.builtin.engine import Engine
from rlctl.engines.rollout.builtin.generation_routes import GenerationRoutes
from rlctl.engines.rollout.builtin.memory_routes import MemoryRoutes
from rlctl.engines.rollout.builtin.state import ServerState
from rlctl.engines.rollout.builtin.vllm_routes import VllmRoutes, vllm_door
from rlctl.engines.rollout.builtin.vllm_sleep import VllmSleep
from rlctl.engines.rollout.builtin.weight_routes import WeightRoutes
from rlctl.engines.rollout.protocol import HEALTH_GENERATION_ENV, HEALTH_TIMEOUT_ENV, HEALTH_TIMEOUT_S
from rlctl.engines.weightsync.flat import flatten_parameters

log = logging.getLogger("rlctl.rollout")

SERVER_VERSION = "rlctl-builtin 1"


def load_model(state: ServerState) -> None:
    """Load the model and tokenizer named by the flags and start the engine (blocking)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = state.args
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=getattr(torch, args.dtype))
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))  # NCCL weight groups use the current device
    model.to(args.device).eval()
    state.flat = flatten_parameters(model)  # flattened buckets then land in place (weightsync/flat.py)
    try:
        state.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    except (OSError, ValueError):
        state.tokenizer = None  # token ids only, like --skip-tokenizer-init
    eos = model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    engine = Engine(
        model, eos_ids, pad, args.max_running_requests, args.seed,
        max_context=model.config.max_position_embeddings, weight_version=args.weight_version,
    )
    if args.tp_size > 1:
        from rlctl.engines.rollout.builtin.tp_ranks import TpRanks

        state.tp_ranks = TpRanks(args.tp_size, args.threads)
    engine.start()
    state.engine = engine
    log.info("model %s loaded: %d parameters", args.model_path, sum(p.numel() for p in model.parameters()))


def generates(path: str) -> bool:
    """Does SGLang's health check on `path` generate? /health_generate always; /health unless
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false (its EnvBool's spellings)."""
    if path == "/health_generate":
        return True
    return path == "/health" and os.environ.get(HEALTH_GENERATION_ENV, "true").strip().lower() not in (
        "false", "0", "no", "n")


class BuiltinServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = ServerState(args)
        self.generation = GenerationRoutes(self.state)
        self.weights = WeightRoutes(self.state)
        self.memory = MemoryRoutes(self.state, self.weights)
        self.vllm = VllmRoutes(self.state)
        self.sleep = VllmSleep(self.state, self.vllm, self.memory)
        # --api-key-file: every route but /health asks for this token, or with --key-scope for
        # the key derived from it (rlctl/process/auth.py); none = open
        self.token = read_token_file(args.api_key_file) if args.api_key_file else None
        if self.token and args.key_scope:
            role, _, key_id = args.key_scope.rpartition("/")
            self.token = role_key(self.token, role, key_id)

    # -- start-up ------------------------------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        async def load() -> None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, load_model, self.state)
                self.memory.setup()
            except Exception as e:  # noqa: BLE001 - fatal: say why in one line, exit non-zero
                self.state.loading_error = f"{e.__class__.__name__}: {e}".splitlines()[0]
                log.error("model load failed: %s", self.state.loading_error)
                print(f"error: cannot load the model from {self.args.model_path}: {self.state.loading_error}", flush=True)
                os._exit(1)
        app["loader"] = asyncio.create_task(load())

    async def on_cleanup(self, app: web.Application) -> None:
        if self.state.engine is not None:
            self.state.engine.stop()
        if self.state.tp_ranks is not None:
            self.state.tp_ranks.stop()
        if self.state.memory is not None:
            self.state.memory.cleanup()  # the offload directory, and any weights still in it

    # -- health and info -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.state.ready():
            return web.Response(status=503, text=self.state.loading_error or "loading")
        if not self.state.engine.thread.is_alive():  # the HTTP side alone answering is no health
            return web.Response(status=503, text="the generation thread has died; see this server's log")
        if self.args.emulate_vllm:
            return web.Response(status=200)
        if request.path == "/ready":  # SGLang's is_ready: healthy and not paused
            return web.Response(status=503 if self.state.engine.paused else 200)
        if generates(request.path):
            return await self._health_generation()
        return web.Response(status=200)

    async def _health_generation(self) -> web.Response:
        """SGLang's generating health check (rlctl/engines/rollout/protocol.py): a running engine
        answers at its next step; a paused or held one only once some reply of its scheduler comes
        back (a step, or a control call finishing), else 503 after SGLANG_HEALTH_CHECK_TIMEOUT."""
        engine = self.state.engine
        if not (engine.paused or engine.held):
            return web.Response(status=200)
        tic = time.monotonic()
        deadline = tic + int(os.environ.get(HEALTH_TIMEOUT_ENV, HEALTH_TIMEOUT_S))
        while time.monotonic() < deadline:
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))  # SGLang polls once a second
            if max(engine.last_output, self.state.last_reply) > tic or not (engine.paused or engine.held):
                return web.Response(status=200)
        return web.Response(status=503)

    async def model_info(self, request: web.Request) -> web.Response:
        engine = self.state.engine
        if engine is None:
            return web.Response(status=503)
        config = engine.model.config
        return web.json_response({  # SGLang's keys (those of every supported release)
            "model_path": self.args.model_path, "tokenizer_path": self.args.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": engine.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None), "architectures": getattr(config, "architectures", None),
        })

    async def server_info(self, request: web.Request) -> web.Response:
        """Server arguments as SGLang's /server_info gives them (its ServerArgs field names)."""
        a = self.args
        engine = self.state.engine
        info = {"model_path": a.model_path, "tp_size": a.tp_size, "dp_size": 1, "random_seed": a.seed,
                "max_running_requests": a.max_running_requests, "dtype": a.dtype, "skip_tokenizer_init": self.state.tokenizer is None,
                "weight_version": engine.weight_version if engine is not None else a.weight_version}
        if a.emulate_sglang:  # answer as that SGLang version does: no rlctl-only keys
            return web.json_response({**info, "version": a.emulate_sglang})
        # rlctl's client asks weight_update_session to decide on /begin_weight_update.
        return web.json_response({**info, "version": SERVER_VERSION, "weight_update_session": True})

    async def loads(self, request: web.Request) -> web.Response:
        engine = self.state.engine
        if engine is None:
            return web.Response(status=503)
        return web.json_response(engine.load())

    @web.middleware
    async def _replied(self, request: web.Request, handler):
        """Every POST route of SGLang's is answered through its scheduler: what a paused
        server's generating health check takes for a sign of life."""
        try:
            return await handler(request)
        finally:
            if request.method == "POST":
                self.state.last_reply = time.monotonic()

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

    def routes(self) -> list[tuple[str, str, Callable]]:
        """(method, path, handler) of every route, with SGLang's names and aliases."""
        gen, w, m = self.generation, self.weights, self.memory
        if self.args.emulate_vllm:  # vLLM's routes instead (vllm_routes.py), and rlctl's weight check and memory
            return [*self.vllm.table(self.health, self.sleep), ("GET", "/rlctl/weight_checksums", w.weight_checksums),
                    ("GET", "/rlctl/memory", m.memory)]
        table = [("GET", path, self.health) for path in ("/health", "/health_generate")]
        if self.state.sessions_required():  # /ready came with SGLang 0.5.21's sessions (not in 0.5.15)
            table.append(("GET", "/ready", self.health))
        table += [("GET", "/model_info", self.model_info), ("GET", "/get_model_info", self.model_info),
                  ("GET", "/server_info", self.server_info), ("GET", "/get_server_info", self.server_info),
                  ("GET", "/v1/loads", self.loads)]
        table += [("POST", "/generate", gen.generate), ("POST", "/abort_request", gen.abort_request),
                  ("POST", "/pause_generation", gen.pause_generation),
                  ("POST", "/continue_generation", gen.continue_generation),
                  ("POST", "/flush_cache", gen.flush_cache), ("GET", "/flush_cache", gen.flush_cache)]
        table.append(("POST", "/init_weights_update_group", w.init_weights_update_group))
        if self.state.sessions_required():  # like SGLang before 0.5.21, an emulated old server has no such routes
            table += [("POST", "/begin_weight_update", w.begin_weight_update),
                      ("POST", "/end_weight_update", w.end_weight_update)]
        table += [("POST", "/update_weights_from_distributed", w.update_weights_from_distributed),
                  ("POST", "/update_weights_from_tensor", w.update_weights_from_tensor),
                  ("POST", "/update_weight_version", w.update_weight_version),
                  ("POST", "/destroy_weights_update_group", w.destroy_weights_update_group),
                  ("POST", "/get_weights_by_name", w.get_weights_by_name),
                  ("GET", "/rlctl/weight_checksums", w.weight_checksums)]
        table += [(method, path, handler) for path, handler in (("/release_memory_occupation", m.release_memory_occupation),
                                                                ("/resume_memory_occupation", m.resume_memory_occupation))
                  for method in ("GET", "POST")]  # SGLang's api_route(methods=["GET", "POST"])
        table.append(("GET", "/rlctl/memory", m.memory))
        return table

    def app(self) -> web.Application:
        door = vllm_door(self.token) if self.args.emulate_vllm else token_middleware(self.token)  # as vLLM's
        middlewares = [door, self._replied] + ([self._record] if self.args.record_requests else [])
        app = web.Application(client_max_size=1 << 30, middlewares=middlewares)
        for method, path, handler in self.routes():
            add = app.router.add_get if method == "GET" else app.router.add_post  # GET answers HEAD too, as before
            add(path, handler)
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
    p.add_argument("--tp-size", type=int, default=1,
                   help="ranks this server takes in the weight-update group (SGLang's TP workers); generation stays on one")
    p.add_argument("--weight-version", default="default",
                   help="the version stamped on generations until the first weight update (SGLang's default)")
    p.add_argument("--emulate-sglang", default="", metavar="VERSION",
                   help="answer /server_info and weight-update sessions as this SGLang version does (adapter tests)")
    p.add_argument("--emulate-vllm", default="", metavar="VERSION",
                   help="answer as this vLLM release's OpenAI server does (vllm_routes.py; its dev routes "
                        "only with VLLM_SERVER_DEV_MODE=1), instead of SGLang's protocol")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="emulating vLLM: its sleep mode moves memory (vllm_sleep.py), as vLLM's flag of that name")
    p.add_argument("--record-requests", default="", metavar="FILE",
                   help="append every POST's path and JSON body to FILE (adapter contract tests)")
    p.add_argument("--api-key-file", default="", metavar="FILE",
                   help="every route but /health asks for `Authorization: Bearer` + the token in FILE (an rlctl "
                        "run's token file); without it the server is open to anyone who reaches it")
    p.add_argument("--key-scope", default="", metavar="ROLE/KEY_ID",
                   help="ask for the key derived from the --api-key-file token for this process (rlctl/process/auth.py "
                        "role_key) instead of the token itself")
    p.add_argument("--offload-dir", default="", metavar="DIR",
                   help="where a CPU server's released weights wait (a private directory made inside DIR); "
                        "default: the system's temporary directory")
    p.add_argument("--weight-group-master", default="", metavar="HOST[:PORT]",
                   help="join weight-update groups at this master_address (and master_port, when given) only: "
                        "the run's trainer; any other is refused with 400")
    return p


def serve(args: argparse.Namespace, sock: socket.socket | None = None) -> None:
    """`sock`: a socket already listening (an rlctl run binds it before it draws the key), else
    --host and --port."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = BuiltinServer(args)
    except ValueError as e:  # an unreadable --api-key-file
        print(f"error: --api-key-file: {e}; give the run's token file", file=sys.stderr)
        raise SystemExit(2) from None
    where = {"sock": sock} if sock is not None else {"host": args.host, "port": args.port}
    web.run_app(server.app(), print=None, access_log=None, **where)


if __name__ == "__main__":
    serve(parser().parse_args())
