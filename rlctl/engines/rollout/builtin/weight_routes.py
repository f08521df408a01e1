"""The built-in server's side of the weight sync, received the way SGLang receives it (docs/sglang.md).

/init_weights_update_group joins a process group made by TCP rendezvous + PrefixStore(group_name)
with every TP rank of the server (rank_offset + tp_rank; rlctl/engines/rollout/builtin/tp_ranks.py);
each /update_weights_from_distributed announces one bucket (names, dtypes, shapes) that then
arrives by broadcast from rank 0, tensor by tensor or as one flattened uint8 tensor. Like SGLang
>= 0.5.21, updates outside a /begin_weight_update ... /end_weight_update session are refused, and
refused before anything is received, so a sender that forgets the session fails here too. Replies
and refusal messages are SGLang 0.5.23's.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

from aiohttp import web

from rlctl.engines.rollout.builtin.state import RELEASED, ServerState, fail, ok

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rlctl.rollout")

LOAD_FORMATS = (None, "flattened_bucket")
OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
                   "end_weight_update()")


class WeightRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.weight_group = None
        self.weight_group_name: str | None = None
        self.in_update_session = False
        self.weight_device = None
        self.scratch: list = []
        """The buffer flattened buckets arrive in, kept from one bucket to the next (receive_bucket)."""
        self.ipc_key: bytes | None = None
        """The key of the run's IPC tags (weightsync/ipc.py), from --api-key-file's token once read."""
        # Weight loads are one at a time, in arrival order, like SGLang's tokenizer manager lock.
        self.update_lock = asyncio.Lock()

    async def _in_executor(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        from rlctl.engines.weightsync import DEFAULT_GROUP_NAME, init_custom_process_group

        body = await request.json()
        try:
            group = dict(init_method=f"tcp://{body['master_address']}:{int(body['master_port'])}",
                         world_size=int(body["world_size"]), group_name=body.get("group_name", DEFAULT_GROUP_NAME),
                         backend=body.get("backend", "nccl"))
            rank_offset = int(body["rank_offset"])
        except (KeyError, TypeError, ValueError) as e:
            return fail(f"bad request: {e}")
        foreign = self.state.foreign_master(body["master_address"], int(body["master_port"]))
        if foreign:  # only the run's own trainer sends weights, from the port it announced
            return fail(f"Failed to initialize custom process group: {foreign}.")
        engine = self.state.engine
        on_gpu = engine is not None and engine.device.type == "cuda"
        if group["backend"] == "nccl" and not on_gpu:
            group["backend"] = "gloo"  # a CPU server; the sender picks gloo too when either side has no GPU
        self.weight_device = engine.device if group["backend"] == "nccl" and engine is not None else None
        if self.weight_group is not None:
            return fail(f"weight update group {self.weight_group_name!r} already exists; destroy it first")
        tp = self.state.tp_ranks
        joins = [self._in_executor(lambda: init_custom_process_group(rank=rank_offset, **group))]
        if tp is not None:
            joins.append(self._in_executor(lambda: tp.join(rank_offset=rank_offset, **group)))
        results = await asyncio.gather(*joins, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            return fail(f"Failed to initialize custom process group: {errors[0]}.")
        self.weight_group, self.weight_group_name = results[0], group["group_name"]
        log.info("joined weight update group %s as ranks %d..%d of %d", group["group_name"], rank_offset,
                 rank_offset + self.state.tp_size - 1, group["world_size"])
        return ok("Succeeded to initialize custom process group.")

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        if self.in_update_session:
            return fail("a weight-update session is already open; call end_weight_update() first")
        self.in_update_session = True
        return ok("Success")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        if not self.in_update_session:
            return fail("no weight-update session is open; call begin_weight_update() first")
        self.in_update_session = False
        return ok("Success")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.state.sessions_required() and not self.in_update_session:
            return fail(OUTSIDE_SESSION)  # before any receive, as SGLang: the sender must notice
        if self.weight_group is None:
            return fail("Failed to receive weights: no weight update group; call /init_weights_update_group first")
        try:
            bucket = dict(names=list(body["names"]), dtypes=[str(d) for d in body["dtypes"]],
                          shapes=[[int(x) for x in s] for s in body["shapes"]], load_format=body.get("load_format"))
            if not (len(bucket["names"]) == len(bucket["dtypes"]) == len(bucket["shapes"])):
                raise ValueError("names, dtypes and shapes differ in length")
            if bucket["load_format"] not in LOAD_FORMATS:
                raise ValueError(f"unsupported load_format {bucket['load_format']!r}")
        except (KeyError, TypeError, ValueError) as e:
            return fail(f"bad request: {e}")
        engine = self.state.engine
        assert engine is not None
        async with self.update_lock:  # a release waits for this lock too (memory_routes.py)
            if self.state.weights_released():  # before any receive: the sender sees the refusal
                return fail(f"Failed to update weights: {RELEASED}")
            state = engine.model.state_dict()
            unknown = [n for n in bucket["names"] if n not in state]
            try:  # received all the same (the sender is broadcasting), into the parameters if all are known
                tensors = await self._receive(bucket, None if unknown else state)
            except Exception as e:  # noqa: BLE001 - SGLang's reply for a failed receive
                return fail(f"Failed to receive weights: {e}")
            if unknown:
                return fail(f"unknown parameter names: {unknown[:5]}")
            if any(t is not None for _, t in tensors):  # all received in place: nothing to copy
                await self._in_executor(self._copy, [(state[n], t) for n, t in tensors if t is not None])
            if body.get("weight_version") is not None:
                engine.weight_version = str(body["weight_version"])
        if body.get("abort_all_requests"):
            engine.abort(None, abort_all=True)
        return ok("Succeeded to update parameter online.")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """One bucket handed over in place (rlctl/engines/weightsync/ipc.py): the tensors are the
        sender's memory, mapped here, and are copied into the parameters before the reply, after
        which the sender may reuse that memory. Served by TP-1 servers (the payload of TP rank 0).
        Only this run's trainer's buffers are opened, and only tensors that fit the model's
        parameters are taken (weightsync/ipc_open.py); anything else is refused, 400."""
        from rlctl.engines.weightsync import ipc_open
        from rlctl.engines.weightsync.ipc import FLATTENED_BUCKET

        body = await request.json()
        if self.state.sessions_required() and not self.in_update_session:
            return fail(OUTSIDE_SESSION.replace("distributed", "tensor"))
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) != self.state.tp_size:
            return fail(f"bad request: serialized_named_tensors must hold one payload per TP rank ({self.state.tp_size})")
        load_format = body.get("load_format")
        if self.state.tp_size != 1 or load_format not in (None, "direct", FLATTENED_BUCKET):
            return fail("update_weights_from_tensor: the built-in server takes TP 1 and load_format null or "
                        f"{FLATTENED_BUCKET!r}")
        engine = self.state.engine
        assert engine is not None
        async with self.update_lock:
            if self.state.weights_released():
                return fail(f"Failed to update weights from tensor: {RELEASED}")
            state = engine.model.state_dict()
            try:
                key = self._ipc_key()
                named = await self._in_executor(lambda: ipc_open.loads(
                    payloads[0], key=key, params=state, flattened=load_format == FLATTENED_BUCKET))
            except Exception as e:  # noqa: BLE001 - an unreadable or refused payload is the sender's error
                return fail(f"Failed to update weights from tensor: {e}")
            await self._in_executor(self._copy, self._as_one_slice(named) or [(state[n], t) for n, t in named])
            if body.get("weight_version") is not None:
                engine.weight_version = str(body["weight_version"])
        return ok("Success")

    def _ipc_key(self) -> bytes:
        if self.ipc_key is None:
            from rlctl.process.auth import read_token_file
            from rlctl.engines.weightsync.ipc import ipc_key

            path = self.state.args.api_key_file
            self.ipc_key = ipc_key(read_token_file(path) if path else None)
        return self.ipc_key

    def _as_one_slice(self, named: list) -> list | None:
        """Tensors that lie back to back in the sender's memory, and whose places in this
        server's flat parameters (weightsync/flat.py) do too, as one (place, source) pair: one
        copy of the whole span."""
        from rlctl.engines.weightsync import dtype_name
        from rlctl.engines.weightsync.buckets import back_to_back

        flat = self.state.flat
        source = back_to_back([t for _, t in named], None) if flat is not None and named else None
        if source is None:
            return None
        target = flat.slice_for([n for n, _ in named], [dtype_name(t.dtype) for _, t in named],
                                [t.numel() * t.element_size() for _, t in named])
        if target is None or target.device != source.device:
            return None
        return [(target, source)]

    async def _receive(self, bucket: dict, into: dict | None) -> list[tuple[str, torch.Tensor | None]]:
        """One bucket off the broadcast on every TP rank; rank 0's tensors are returned. Rank 0
        receives tensor-by-tensor buckets straight into the model's parameters (`into`), holding
        the model lock so that no decode step runs meanwhile (generation is paused for a sync)."""
        from rlctl.engines.weightsync import dtype_from_name, receive_bucket

        device = str(self.weight_device or "cpu")  # NCCL receives straight into GPU memory, gloo into host memory
        group = self.weight_group
        engine = self.state.engine
        assert engine is not None

        flat = self.state.flat
        target = None
        if into is not None and flat is not None and bucket["load_format"] == "flattened_bucket":
            sizes = [math.prod(s) * dtype_from_name(d).itemsize for s, d in zip(bucket["shapes"], bucket["dtypes"], strict=True)]
            target = flat.slice_for(bucket["names"], bucket["dtypes"], sizes)

        def rank0():
            with engine.model_lock:
                return receive_bucket(group, device=device, into=into, scratch=self.scratch, target=target, **bucket)
        receives = [self._in_executor(rank0)]
        tp = self.state.tp_ranks
        if tp is not None:
            receives.append(self._in_executor(lambda: tp.call("receive", device=device, **bucket)))
        results = await asyncio.gather(*receives, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results[0]

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each source into its place in the model, between decode steps; returns once the
        copies are done (the sources may be reused after that)."""
        import torch

        engine = self.state.engine
        assert engine is not None
        with engine.model_lock, torch.no_grad():
            for place, source in pairs:
                place.copy_(source)
            if engine.device.type == "cuda":
                torch.cuda.current_stream(engine.device).synchronize()

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "new_version" not in body:
            return fail("new_version is required")
        engine = self.state.engine
        assert engine is not None
        if body.get("abort_all_requests"):
            engine.abort(None, abort_all=True)
        engine.weight_version = str(body["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {engine.weight_version}",
                                  "new_version": engine.weight_version})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        from rlctl.engines.weightsync import destroy_process_group

        if self.weight_group is None:
            return fail("The group to be destroyed does not exist.")
        group, self.weight_group, self.weight_group_name = self.weight_group, None, None
        self.scratch = []
        await self._in_executor(destroy_process_group, group)
        if self.state.tp_ranks is not None:
            await self._in_executor(lambda: self.state.tp_ranks.call("destroy"))
        return ok("Succeeded to destroy custom process group.")

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await request.json()
        engine = self.state.engine
        assert engine is not None
        if self.state.weights_released():
            return fail(f"Failed to get weights: {RELEASED}")
        state = engine.model.state_dict()
        name = body.get("name")
        if name not in state:
            return fail(f"unknown parameter {name!r}")
        flat = state[name].detach().float().reshape(-1)
        truncate = body.get("truncate_size", 100)
        return web.json_response(flat[:truncate].tolist())

    async def weight_checksums(self, request: web.Request) -> web.Response:
        """rlctl-only: sha256 of every parameter's bytes on rank 0 (and of what the other TP ranks
        received), to check a sync bit for bit."""
        from rlctl.engines.weightsync import tensor_sha256

        engine = self.state.engine
        assert engine is not None

        def checksums() -> dict[str, str] | None:
            with engine.model_lock:  # a release holds it while the weights leave
                if self.state.weights_released():
                    return None
                return {n: tensor_sha256(t) for n, t in engine.model.state_dict().items()}
        sums = await self._in_executor(checksums)
        if sums is None:
            return fail(RELEASED)
        tp = self.state.tp_ranks
        others = await self._in_executor(lambda: tp.call("checksums")) if tp is not None else []
        # tp_ranks: what TP ranks 1.. received (each whole tensor of every sync so far)
        return web.json_response({"weight_version": engine.weight_version, "checksums": sums, "tp_ranks": others})
