"""The trainer as a service: rank 0 answers the controller over HTTP and leads the other ranks.

    POST /accumulate     {"samples": [...]}   forward and backward on part of a train batch
    POST /train          {"samples": [...]}   these samples plus all accumulated since the last
                                              step: one optimizer step on that train batch
    POST /init_weight_sync {servers, master_address, master_port, backend, bucket_mb}
                                              (master_port 0: one free now on this host)
    POST /sync_weights   {"version": "3"}     broadcast the working copy to every rollout server (and
                                              keep it as that version's behaviour weights)
    POST /save_checkpoint, /load_checkpoint {"dir": D}   the trainer's part of a checkpoint (D: a
                                              directory of the run's own checkpoints/ only)
    POST /save_policy    {"dir": D}           the policy alone as D/hf: a completed run's final policy
    POST /release_memory_occupation {"tags": ["weights", "optimizer"] | null}
    POST /resume_memory_occupation  {"tags": ...}   give the device memory back, take it again
    GET  /health, /info, /weight_checksums;  POST /shutdown

Releasing memory is for a pool that multiplexes several runs' models on one device: `weights`
(parameters and gradients) and `optimizer` (its state) go to host memory and come back bit for
bit (the engine's release_memory; null = both). The reply is {"released": [tags moved now],
"bytes", "seconds"} (or "resumed"); a tag already where it was asked to go is left alone. While a
tag is released, the commands that need it are refused with HTTP 400 (train and checkpoints need
both, accumulate and weight reads the weights); /info gives the footprint under `memory`.

Given the run's token, every route but /health asks for `Authorization: Bearer <key>`, the key
of this start of the trainer (401 without it, 403 with a wrong one; rlctl/process/auth.py role_key), and
the service's own clients of the rollout servers send each server its own key, derived here
from the token and the role and key_id the controller names.

The checkpoint routes touch the run's own checkpoints only: /save_checkpoint writes only into
RUN/checkpoints/.tmp-step-NNNNNN-PID (/save_policy only into RUN/checkpoints/.tmp-final-PID) and
/load_checkpoint reads only RUN/checkpoints/step-NNNNNN,
with symbolic links and `..` resolved (rlctl/run/checkpoint.py: confined_checkpoint_dir); any other
path is refused with 403, naming the path and the rule. /load_checkpoint first checks the
checkpoint against its manifest (rlctl/run/manifest.py: 400 and the first file that differs).

Rank 0 forwards each train command (and memory release or resume) to the other ranks with
broadcast_object_list, then every rank runs it; a command refused for released memory is refused
on rank 0 before any other rank hears of it. Weight sync is rank 0's alone: every data-parallel
replica takes the same optimizer step on the same reduced gradients (the torch engine's one
gradient all-reduce per step, Megatron's DDP), so the replicas stay identical; with Megatron TP,
the other ranks of rank 0's TP group join the gathers that rebuild full tensors. Colocated on
several devices, every rank packs the buckets for the server on its own device and rank 0 sends
them (rlctl/engines/weightsync/ipc_ranks.py). One worker
thread runs all engine work, so a train batch and a weight sync never overlap, and memory is not
moved while a sync reads the weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
from aiohttp import web

from rlctl.run.checkpoint import CheckpointPathRefused, confined_checkpoint_dir
from rlctl.run.manifest import check_manifest
from rlctl.process.auth import role_key, token_middleware
from rlctl.engines.train.base import TrainEngine, TrainSample
from rlctl.engines.weightsync import DEFAULT_GROUP_NAME, WeightSender, as_served, tensor_sha256
from rlctl.engines.weightsync.ipc_ranks import SHARE_COMMAND, follow_share
from rlctl.errors import RunError

log = logging.getLogger("rlctl.trainer")

# The commands every rank runs: the engine method each calls, and the memory tags it needs resident.
COMMANDS = {
    "train": ("train_batch", ("weights", "optimizer")),
    "accumulate": ("accumulate", ("weights",)),
    "save_checkpoint": ("save_checkpoint", ("weights", "optimizer")),
    "save_policy": ("save_policy", ("weights",)),
    "load_checkpoint": ("load_checkpoint", ("weights", "optimizer")),
    "release_memory": ("release_memory", ()),
    "resume_memory": ("resume_memory", ()),
    "mark_behaviour": ("mark_behaviour", ("weights",)),
}


PEAK_MEASURED = ("train", "accumulate")
"""Commands whose reply carries `peak_gib`: rank 0's most GPU memory allocated while it ran."""


def follower_loop(engine: TrainEngine, ipc_key: bytes | None = None) -> None:
    """Ranks > 0: run whatever rank 0 broadcasts until told to stop. `ipc_key`: colocated runs'
    (the run's token's IPC key, ipc.py), with which a rank tags the buckets it hands its server."""
    buffers: list = [None, None]  # the pack buffers of the buckets this rank hands over, kept between syncs
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        command, payload = box[0]
        if command == "stop":
            return
        if command == "weights":
            for _ in engine.hf_weights():  # take part in the all-gathers that rebuild full tensors
                pass  # and keep none of them
        elif command == SHARE_COMMAND:
            if ipc_key is None:
                raise RunError("rank 0 asked this rank to hand its server the weights, and it was started without "
                               "the run's IPC key (colocate.enabled)")
            follow_share(engine.hf_weights(), payload, ipc_key, buffers, dist.get_world_size())
        elif command in COMMANDS:
            if command == "release_memory":
                buffers = [None, None]
            getattr(engine, COMMANDS[command][0])(payload)


def refused(message: str, status: int = 400) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=status)


class TrainerService:
    def __init__(self, engine: TrainEngine, world_size: int, token: str | None = None, key: str | None = None,
                 run_dir: str | Path | None = None) -> None:
        self.run_dir = Path(run_dir).resolve() if run_dir is not None else None
        """The run directory, whose checkpoints/ holds every checkpoint this service writes or reads."""
        self.engine = engine
        self.world_size = world_size
        self.token = token
        """The run's token: never sent; each server's key is derived from it (rlctl/process/auth.py role_key)."""
        self.key = key if key is not None else token
        """What every request but /health must carry: this process's own key."""
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.sender: WeightSender | None = None
        self.session = None
        self.groups_formed = 0
        self.parameters: int | None = None
        """The full model's parameter count, counted once (before any release: /info gives it after)."""
        self.syncing = 0
        """Weight syncs reading the weights now, bucket by bucket, on the engine thread."""

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    def _require(self, what: str, tags: tuple[str, ...]) -> None:
        resident = self.engine.memory_resident()
        out = [t for t in tags if not resident[t]]
        if out:
            raise RunError(f"{what} refused: the trainer's {' and '.join(out)} memory is released; "
                           "POST /resume_memory_occupation first")

    def _command(self, command: str, payload: Any) -> Any:
        """One command on every rank (COMMANDS): rank 0 checks it may run, tells the others, then
        runs it itself. On the engine thread, so commands never overlap."""
        method, needs = COMMANDS[command]
        self._require(command, needs)
        if command == "release_memory":
            self.engine.check_memory_tags(payload)  # refused here, before any rank moves anything
            self._parameter_count()
            if self.sender is not None:
                self.sender.buffers = [None, None]  # its pack buffers (device memory); the next sync makes them again
        elif command == "resume_memory":
            self.engine.check_memory_tags(payload)
        if self.world_size > 1:
            dist.broadcast_object_list([(command, payload)], src=0)
        if command not in PEAK_MEASURED or not str(self._device() or "").startswith("cuda"):
            return getattr(self.engine, method)(payload)
        import torch

        torch.cuda.reset_peak_memory_stats()
        out = getattr(self.engine, method)(payload)
        if isinstance(out, dict):  # what the memory model's trainer bytes are checked against (docs/plan.md)
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return out

    def _weights(self, for_sync: bool = False):
        """Full HF-named weights, one tensor at a time: iterate it on the engine thread. An
        engine whose weights are sharded across ranks (Megatron with TP > 1) needs every rank in
        the gathers: rank 0 tells the others to join, and they gather as this is iterated. For a
        sync whose servers take the weights from every rank (colocated), each rank reads its
        own and hands them over with rank 0 (ipc_ranks.py)."""
        self._require("reading the weights", ("weights",))
        spec = self.sender.share_spec if for_sync and self.sender is not None else None
        if self.world_size > 1 and spec is not None:
            dist.broadcast_object_list([(SHARE_COMMAND, spec)], src=0)
        elif self.world_size > 1 and getattr(self.engine, "collective_export", False):
            dist.broadcast_object_list([("weights", None)], src=0)
        return iter(self.engine.hf_weights())

    def _parameter_count(self) -> int:
        if self.parameters is None:
            self.parameters = sum(t.numel() for _, t in self._weights())
        return self.parameters

    def _stop_followers(self) -> None:
        if self.world_size > 1:
            dist.broadcast_object_list([("stop", None)], src=0)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def info(self, request: web.Request) -> web.Response:
        n, memory = await self._run(lambda: (self._parameter_count(), self.engine.memory()))
        return web.json_response({"version": self.engine.version, "ranks": self.world_size, "parameters": n,
                                  "memory": memory})

    async def _reply(self, command: str, payload: Any) -> web.Response:
        try:
            return web.json_response(await self._run(self._command, command, payload))
        except RunError as e:
            return refused(str(e))

    async def train(self, request: web.Request) -> web.Response:
        body = await request.json()
        return await self._reply("train", [TrainSample.from_json(s) for s in body["samples"]])

    async def accumulate(self, request: web.Request) -> web.Response:
        body = await request.json()
        return await self._reply("accumulate", [TrainSample.from_json(s) for s in body["samples"]])

    async def _memory(self, command: str, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        if not isinstance(body, dict):
            return refused(f"the body is {{\"tags\": [...] | null}}, not {body!r}")
        tags = body.get("tags")
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            return refused(f"tags must be a list of strings or null, not {tags!r}")
        if self.syncing:  # its buckets are read between other work on the engine thread
            return refused("a weight sync is reading the weights; move the memory once it is done")
        return await self._reply(command, tags)

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._memory("release_memory", request)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._memory("resume_memory", request)

    def _key_of(self, server: dict[str, Any]) -> str | None:
        """A server's own key, from the role and key_id the controller names (it never sends keys)."""
        if not self.token:
            return None
        return role_key(self.token, str(server["role"]), str(server["key_id"]))

    async def init_weight_sync(self, request: web.Request) -> web.Response:
        import aiohttp

        from rlctl.engines.rollout.registry import speaker

        body = await request.json()
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        protocol = speaker(body.get("protocol", "sglang"))  # the adapter of the engine whose protocol the servers speak
        clients = [protocol.client(s["url"], self.session, self._key_of(s)) for s in body["servers"]]
        group = {}
        if self.sender is not None:  # formed anew (failover: a server lost or back): leave the old group
            old, self.sender = self.sender, None
            await old.close()
            # A new name each time: a group whose broadcast broke keeps its name in this process.
            self.groups_formed += 1
            group["group_name"] = f"{DEFAULT_GROUP_NAME}-{self.groups_formed}"
        port = int(body["master_port"])
        if not port:  # chosen here, where the group's store listens (the controller may be elsewhere)
            from rlctl.process.auth import listen_address
            from rlctl.process.topology import free_ports

            port = free_ports(1, listen_address(body["master_address"]))[0]
        common = dict(master_address=body["master_address"], master_port=port, backend=body.get("backend", "gloo"),
                      bucket_bytes=int(float(body["bucket_mb"]) * 2**20), run_token=self.token, **group)
        if body.get("from_ranks") is not None:  # colocated: each server's weights from the ranks on its devices
            common.update(from_ranks=body["from_ranks"], trainer_ranks=self.world_size)
        self.sender = protocol.sender(clients, server=body.get("server"), device=self._device(), **common)
        try:
            await self.sender.connect()
        except RunError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        log.info("weight sync to %d server(s) by %s in buckets of %s MiB; servers hold %s", len(clients),
                 self.sender.backend, body["bucket_mb"], self.sender.server_dtype or "their own dtypes")
        if self.sender.from_ranks is not None:
            log.info("each server takes the weights from the trainer ranks on its devices: %s", ", ".join(
                f"{s['role']} <- {ranks}" for s, ranks in zip(body["servers"], self.sender.from_ranks, strict=True)))
        return web.json_response({"success": True, "servers": len(clients), "world_size": self.sender.world_size})

    def _device(self) -> str | None:
        """The trainer's GPU, where a group that vLLM's own code forms (NCCL) sends from."""
        device = getattr(self.engine, "device", None)
        return str(device) if device is not None else None

    async def sync_weights(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.sender is None:
            return web.json_response({"success": False, "message": "call /init_weight_sync first"}, status=400)
        # The weights are read on the engine thread (no train batch runs meanwhile), bucket by bucket.
        self.syncing += 1
        try:
            weights = await self._run(self._weights, True)
            stats = await self.sender.send(weights, str(body["version"]), pause_mode=body.get("pause_mode", "abort"),
                                           producer=self.worker)
            if getattr(self.engine, "behaviour", None) is not None or getattr(self.engine, "critic", None) is not None:
                # Every rank keeps what the servers now hold, for the old log-probs and values of its samples.
                await self._run(self._command, "mark_behaviour", int(body["version"]))
        except RunError as e:  # released weights, a server's refusal or a failed broadcast: the controller reports why
            return refused(str(e))
        finally:
            self.syncing -= 1
        return web.json_response({"success": True, "seconds": stats.seconds, "bytes": stats.bytes,
                                  "buckets": stats.buckets, "tensors": stats.tensors})

    def _checkpoint_dir(self, body: Any, purpose: str) -> Path:
        """The body's "dir", resolved, if the service may use it for `purpose` ("save", "policy" or "load");
        CheckpointPathRefused otherwise (RunError for a body without one)."""
        if self.run_dir is None:
            raise CheckpointPathRefused("this trainer was started without its run directory (python -m rlctl.worker "
                                        "trainer --run-dir DIR), so it writes and reads no checkpoint")
        path = body.get("dir") if isinstance(body, dict) else None
        if not isinstance(path, str):
            raise RunError(f"the body is {{\"dir\": \"<path>\"}}, not {body!r}"[:300])
        return confined_checkpoint_dir(self.run_dir, path, purpose)

    async def _checkpoint_target(self, request: web.Request, purpose: str) -> Path | web.Response:
        """The checkpoint directory a request names, or its refusal: 403 outside the run's own
        checkpoints/, 400 for a body that names none."""
        try:
            return self._checkpoint_dir(await request.json(), purpose)
        except CheckpointPathRefused as e:
            return refused(str(e), status=403)
        except RunError as e:
            return refused(str(e))

    async def save_checkpoint(self, request: web.Request) -> web.Response:
        """{"dir": D}: write the trainer's part of a checkpoint into D (rlctl/engines/train/ckpt_files.py)."""
        return await self._save(request, "save", "save_checkpoint")

    async def save_policy(self, request: web.Request) -> web.Response:
        """{"dir": D}: write the policy alone into D/hf (a completed run's final policy)."""
        return await self._save(request, "policy", "save_policy")

    async def _save(self, request: web.Request, purpose: str, command: str) -> web.Response:
        target = await self._checkpoint_target(request, purpose)
        if isinstance(target, web.Response):
            return target
        start = asyncio.get_running_loop().time()
        try:
            stats = await self._run(self._command, command, str(target))
        except RunError as e:
            return refused(str(e))
        return web.json_response({"success": True, "seconds": asyncio.get_running_loop().time() - start, **stats})

    async def load_checkpoint(self, request: web.Request) -> web.Response:
        """{"dir": D}: continue from the checkpoint in D once it matches its manifest; replies with
        its weight version."""
        target = await self._checkpoint_target(request, "load")
        if isinstance(target, web.Response):
            return target
        try:
            await self._run(check_manifest, target)
            stats = await self._run(self._command, "load_checkpoint", str(target))
        except RunError as e:
            return refused(str(e))
        return web.json_response({"success": True, **stats})

    async def weight_checksums(self, request: web.Request) -> web.Response:
        # As the servers hold them: in their dtype.
        held = self.sender.server_dtype if self.sender is not None else None
        try:
            sums = await self._run(lambda: {n: tensor_sha256(as_served(t, held)) for n, t in self._weights()})
        except RunError as e:
            return refused(str(e))
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
        app = web.Application(client_max_size=1 << 30, middlewares=[token_middleware(self.key)])
        app.router.add_get("/health", self.health)
        app.router.add_get("/info", self.info)
        app.router.add_post("/accumulate", self.accumulate)
        app.router.add_post("/train", self.train)
        app.router.add_post("/init_weight_sync", self.init_weight_sync)
        app.router.add_post("/sync_weights", self.sync_weights)
        app.router.add_get("/weight_checksums", self.weight_checksums)
        app.router.add_post("/save_checkpoint", self.save_checkpoint)
        app.router.add_post("/save_policy", self.save_policy)
        app.router.add_post("/load_checkpoint", self.load_checkpoint)
        app.router.add_post("/release_memory_occupation", self.release_memory_occupation)
        app.router.add_post("/resume_memory_occupation", self.resume_memory_occupation)
        app.router.add_post("/shutdown", self.shutdown)
        app.on_cleanup.append(self.on_cleanup)
        return app
