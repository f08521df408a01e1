"""The trainer as a service: rank 0 answers the controller over HTTP and leads the other ranks.

    POST /accumulate     {"samples": [...]}   forward and backward on part of a train batch
    POST /train          {"samples": [...]}   these samples plus all accumulated since the last
                                              step: one optimizer step on that train batch
    POST /init_weight_sync {servers, master_address, master_port, backend, bucket_mb}
    POST /sync_weights   {"version": "3"}     broadcast the working copy to every rollout server
    POST /save_checkpoint, /load_checkpoint {"dir": D}   the trainer's part of a checkpoint
    GET  /health, /info, /weight_checksums;  POST /shutdown

Given the run's token, every route but /health asks for `Authorization: Bearer <token>` (401
without it, 403 with a wrong one; rlctl/door.py), and the service's own clients of the rollout
servers send it too.

Rank 0 forwards each train command to the other ranks with broadcast_object_list, then every
rank runs it. Weight sync is rank 0's alone: every data-parallel replica takes the same optimizer
step on the same reduced gradients (the torch engine's one gradient all-reduce per step,
Megatron's DDP), so the replicas stay identical; with Megatron TP, the other ranks of rank 0's
TP group join the gathers that rebuild full tensors. One worker thread runs all engine work, so
a train batch and a weight sync never overlap.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
from aiohttp import web

from rlctl.door import token_middleware
from rlctl.engines.train.base import TrainEngine, TrainSample
from rlctl.engines.weightsync import DEFAULT_GROUP_NAME, WeightSender, as_served, tensor_sha256
from rlctl.errors import RunError

log = logging.getLogger("rlctl.trainer")


def follower_loop(engine: TrainEngine) -> None:
    """Ranks > 0: run whatever rank 0 broadcasts until told to stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        command, payload = box[0]
        if command == "stop":
            return
        if command == "train":
            engine.train_batch(payload)
        elif command == "accumulate":
            engine.accumulate(payload)
        elif command == "weights":
            for _ in engine.hf_weights():  # take part in the all-gathers that rebuild full tensors
                pass  # and keep none of them
        elif command == "save_checkpoint":
            engine.save_checkpoint(payload)
        elif command == "load_checkpoint":
            engine.load_checkpoint(payload)


class TrainerService:
    def __init__(self, engine: TrainEngine, world_size: int, token: str | None = None) -> None:
        self.engine = engine
        self.world_size = world_size
        self.token = token
        """The run's token: asked of every request but /health, and sent to the rollout servers."""
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.sender: WeightSender | None = None
        self.session = None
        self.groups_formed = 0

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    def _train(self, samples: list[TrainSample]) -> dict[str, float]:
        if self.world_size > 1:
            dist.broadcast_object_list([("train", samples)], src=0)
        return self.engine.train_batch(samples)

    def _accumulate(self, samples: list[TrainSample]) -> dict[str, float]:
        if self.world_size > 1:
            dist.broadcast_object_list([("accumulate", samples)], src=0)
        return self.engine.accumulate(samples)

    def _weights(self):
        """Full HF-named weights, one tensor at a time: iterate it on the engine thread. An
        engine whose weights are sharded across ranks (Megatron with TP > 1) needs every rank in
        the gathers: rank 0 tells the others to join, and they gather as this is iterated."""
        if self.world_size > 1 and getattr(self.engine, "collective_export", False):
            dist.broadcast_object_list([("weights", None)], src=0)
        return iter(self.engine.hf_weights())

    def _checkpoint(self, command: str, path: str) -> dict[str, float]:
        """save_checkpoint or load_checkpoint on every rank (each writes or reads its part)."""
        if self.world_size > 1:
            dist.broadcast_object_list([(command, path)], src=0)
        return getattr(self.engine, command)(path)

    def _stop_followers(self) -> None:
        if self.world_size > 1:
            dist.broadcast_object_list([("stop", None)], src=0)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def info(self, request: web.Request) -> web.Response:
        n = await self._run(lambda: sum(t.numel() for _, t in self._weights()))
        return web.json_response({"version": self.engine.version, "ranks": self.world_size, "parameters": n})

    async def train(self, request: web.Request) -> web.Response:
        body = await request.json()
        samples = [TrainSample.from_json(s) for s in body["samples"]]
        stats = await self._run(self._train, samples)
        return web.json_response(stats)

    async def accumulate(self, request: web.Request) -> web.Response:
        body = await request.json()
        samples = [TrainSample.from_json(s) for s in body["samples"]]
        return web.json_response(await self._run(self._accumulate, samples))

    async def init_weight_sync(self, request: web.Request) -> web.Response:
        import aiohttp

        from rlctl.engines.rollout.client import RolloutClient

        body = await request.json()
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        clients = [RolloutClient(url, self.session, self.token) for url in body["servers"]]
        group = {}
        if self.sender is not None:  # formed anew (failover: a server lost or back): leave the old group
            old, self.sender = self.sender, None
            await old.close()
            # A new name each time: a group whose broadcast broke keeps its name in this process.
            self.groups_formed += 1
            group["group_name"] = f"{DEFAULT_GROUP_NAME}-{self.groups_formed}"
        self.sender = WeightSender(
            clients, master_address=body["master_address"], master_port=int(body["master_port"]),
            backend=body.get("backend", "gloo"), bucket_bytes=int(float(body["bucket_mb"]) * 2**20), **group,
        )
        try:
            await self.sender.connect()
        except RunError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        log.info("weight sync to %d server(s) by %s in buckets of %s MiB; servers hold %s", len(clients),
                 self.sender.backend, body["bucket_mb"], self.sender.server_dtype or "their own dtypes")
        return web.json_response({"success": True, "servers": len(clients), "world_size": self.sender.world_size})

    async def sync_weights(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.sender is None:
            return web.json_response({"success": False, "message": "call /init_weight_sync first"}, status=400)
        # The weights are read on the engine thread (no train batch runs meanwhile), bucket by bucket.
        weights = await self._run(self._weights)
        try:
            stats = await self.sender.send(weights, str(body["version"]), pause_mode=body.get("pause_mode", "abort"),
                                           producer=self.worker)
        except RunError as e:  # a server refused or the broadcast failed: the controller reports why
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "seconds": stats.seconds, "bytes": stats.bytes,
                                  "buckets": stats.buckets, "tensors": stats.tensors})

    async def save_checkpoint(self, request: web.Request) -> web.Response:
        """{"dir": D}: write the trainer's part of a checkpoint into D (rlctl/engines/train/ckpt_files.py)."""
        body = await request.json()
        start = asyncio.get_running_loop().time()
        stats = await self._run(self._checkpoint, "save_checkpoint", str(body["dir"]))
        return web.json_response({"success": True, "seconds": asyncio.get_running_loop().time() - start, **stats})

    async def load_checkpoint(self, request: web.Request) -> web.Response:
        """{"dir": D}: continue from the checkpoint in D; replies with its weight version."""
        body = await request.json()
        try:
            stats = await self._run(self._checkpoint, "load_checkpoint", str(body["dir"]))
        except RunError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, **stats})

    async def weight_checksums(self, request: web.Request) -> web.Response:
        # As the servers hold them: in their dtype.
        held = self.sender.server_dtype if self.sender is not None else None
        sums = await self._run(lambda: {n: tensor_sha256(as_served(t, held)) for n, t in self._weights()})
        return web.json_response({"version": self.engine.version, "checksums": sums})

    async def shutdown(self, request: web.Request) -> web.Response:
        asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
        return web.json_response({"success": True})

    async def on_cleanup(self, app: web.Application) -> None:
        if self.sender is not None:
            try:
                await asyncio.wait_for(self.sender.close(), 10)
            except (TimeoutError, Exception) as e:  # noqa: BLE001 - best effort at exit
                log.warning("weight group teardown: %s", e)
        if self.session is not None:
            await self.session.close()
        await self._run(self._stop_followers)
        self.worker.shutdown(wait=True)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[token_middleware(self.token)])
        app.router.add_get("/health", self.health)
        app.router.add_get("/info", self.info)
        app.router.add_post("/accumulate", self.accumulate)
        app.router.add_post("/train", self.train)
        app.router.add_post("/init_weight_sync", self.init_weight_sync)
        app.router.add_post("/sync_weights", self.sync_weights)
        app.router.add_get("/weight_checksums", self.weight_checksums)
        app.router.add_post("/save_checkpoint", self.save_checkpoint)
        app.router.add_post("/load_checkpoint", self.load_checkpoint)
        app.router.add_post("/shutdown", self.shutdown)
        app.on_cleanup.append(self.on_cleanup)
        return app
