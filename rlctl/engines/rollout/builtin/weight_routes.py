"""The built-in server's side of the weight sync, received the way SGLang receives it (docs/sglang.md).

/init_weights_update_group joins a process group made by TCP rendezvous + PrefixStore(group_name);
each /update_weights_from_distributed announces one bucket (names, dtypes, shapes) that then
arrives by broadcast from rank 0, tensor by tensor or as one flattened uint8 tensor. Like SGLang
>= 0.5.21, updates are refused outside a /begin_weight_update ... /end_weight_update session, so
a sender that forgets it fails here too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from rlctl.engines.rollout.builtin.state import ServerState, fail, ok

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rlctl.rollout")

LOAD_FORMATS = (None, "flattened_bucket")


class WeightRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.weight_group = None
        self.weight_group_name: str | None = None
        self.in_update_session = False
        self.weight_device = None
        # Weight loads are one at a time, in arrival order, like SGLang's tokenizer manager lock.
        self.update_lock = asyncio.Lock()

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
        engine = self.state.engine
        on_gpu = engine is not None and engine.device.type == "cuda"
        if backend == "nccl" and not on_gpu:
            backend = "gloo"  # a CPU server; the sender picks gloo too when either side has no GPU
        self.weight_device = engine.device if backend == "nccl" and engine is not None else None
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
            if load_format not in LOAD_FORMATS:
                raise ValueError(f"unsupported load_format {load_format!r}")
        except (KeyError, TypeError, ValueError) as e:
            return fail(f"bad request: {e}")
        if not self.in_update_session and self.state.sessions_required():
            # The sender is about to broadcast; we must not leave it hanging in the collective,
            # so receive (and discard) the bucket, then refuse.
            await self._receive(names, dtypes, shapes, load_format)
            return fail("weight updates must happen between /begin_weight_update and /end_weight_update")
        async with self.update_lock:
            tensors = await self._receive(names, dtypes, shapes, load_format)
            engine = self.state.engine
            assert engine is not None
            unknown = await asyncio.get_running_loop().run_in_executor(None, self._load, tensors)
            if unknown:
                return fail(f"unknown parameter names: {unknown[:5]}")
            version = body.get("weight_version")
            if version is not None:
                engine.weight_version = str(version)
        if body.get("abort_all_requests"):
            engine.abort(None, abort_all=True)
        return ok(f"updated {len(names)} tensors")

    async def _receive(self, names: list[str], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]],
                       load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        """One bucket off the broadcast, in the announced order, as (name, tensor) pairs."""
        import torch
        import torch.distributed as dist

        from rlctl.engines.weightsync import flattened_size, unflatten_bucket

        group = self.weight_group
        device = self.weight_device or "cpu"  # NCCL receives straight into GPU memory, gloo into host memory

        def recv() -> list[tuple[str, torch.Tensor]]:
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

    def _load(self, tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy the tensors into the model between decode steps; the unknown names, if any (then none is copied)."""
        import torch

        engine = self.state.engine
        assert engine is not None
        state = engine.model.state_dict()
        unknown = [n for n, _ in tensors if n not in state]
        if unknown:
            return unknown
        with engine.model_lock, torch.no_grad():
            for name, t in tensors:
                state[name].copy_(t)
        return []

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "new_version" not in body:
            return fail("new_version is required")
        engine = self.state.engine
        assert engine is not None
        if body.get("abort_all_requests"):
            engine.abort(None, abort_all=True)
        engine.weight_version = str(body["new_version"])
        return ok(f"weight version {engine.weight_version}")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        from rlctl.engines.weightsync import destroy_process_group

        if self.weight_group is None:
            return fail("no weight update group")
        group, self.weight_group, self.weight_group_name = self.weight_group, None, None
        await asyncio.get_running_loop().run_in_executor(None, destroy_process_group, group)
        return ok("destroyed")

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await request.json()
        engine = self.state.engine
        assert engine is not None
        state = engine.model.state_dict()
        name = body.get("name")
        if name not in state:
            return fail(f"unknown parameter {name!r}")
        flat = state[name].detach().float().reshape(-1)
        truncate = body.get("truncate_size", 100)
        return web.json_response(flat[:truncate].tolist())

    async def weight_checksums(self, request: web.Request) -> web.Response:
        """rlctl-only: sha256 of every parameter's bytes, to check a sync bit for bit."""
        from rlctl.engines.weightsync import tensor_sha256

        engine = self.state.engine
        assert engine is not None
        with engine.model_lock:
            sums = {n: tensor_sha256(t) for n, t in engine.model.state_dict().items()}
        return web.json_response({"weight_version": engine.weight_version, "checksums": sums})
