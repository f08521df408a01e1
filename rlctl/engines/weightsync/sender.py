"""Trainer rank 0's side of a weight sync: a stream of buckets to every rollout server.

The order of one sync follows slime/miles against SGLang: pause_generation -> flush_cache ->
begin_weight_update -> for each bucket (announce it to every server over HTTP, send it, collect
the replies) -> end_weight_update -> continue_generation. begin/end go only to servers that have
them (SGLang >= 0.5.21, the built-in server). The last bucket's announce carries the new weight
version (SGLang sets it once the update succeeds); a sync with no bucket sends
update_weight_version instead.

Three ways to send a bucket (`backend`):
- gloo: a broadcast in the weight-sync group from host memory (GPU weights are staged there);
- nccl: a broadcast straight from GPU memory;
- ipc: no group; the bucket's buffer is handed over in place, one IPC handle per bucket (ipc.py),
  by /update_weights_from_tensor, to servers on the trainer's own GPU (or host, for CPU servers).
  Colocated on several devices, each server gets them from the ranks on its own devices
  (`from_ranks`: ipc_ranks.py); rank 0 still makes every HTTP call.

A group's store, which rank 0 hosts, is sealed once every server has joined and closed as soon as
no rank needs it: at once for gloo, after the first bucket for NCCL (store.py).

The sync is a pipeline. The weights are read one tensor at a time on the `producer` executor (the
trainer's engine thread: a Megatron engine gathers each tensor's shards as it is asked for it),
cast to the servers' dtype and packed into one of two reused buffers (buckets.BucketMaker) while
the previous bucket is on the wire; the announce of a bucket goes out as soon as it is packed.
Peak extra memory is two buckets, whatever the model's size. Announces to one server are never
in flight together: HTTP requests on different connections may be served in either order, and a
server that took bucket i+1's announce first would receive bucket i's bytes as bucket i+1's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable

from rlctl.engines.weightsync.buckets import Bucket, BucketMaker, dtype_from_name, dtype_name, unflatten_bucket
from rlctl.engines.weightsync.ipc import FLATTENED_BUCKET
from rlctl.engines.weightsync.group import (
    DEFAULT_GROUP_NAME,
    close_store,
    destroy_process_group,
    group_layout,
    in_daemon_thread,
    init_custom_process_group,
    seal_store,
)
from rlctl.engines.weightsync.ipc_ranks import RankShares, ShareSpec, payloads_by_server
from rlctl.models.hf_config import declared_dtype, read_config

if TYPE_CHECKING:
    import torch

CLOSE_TIMEOUT_S = 10.0
BACKENDS = ("gloo", "nccl", "ipc")


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    buckets: int
    tensors: int


def server_dtype(info: dict[str, Any]) -> str | None:
    """The dtype a server holds its weights in, from its /server_info: its `dtype` argument, or
    for "auto" what SGLang's _get_and_verify_dtype makes of the model's config.json (the
    config's dtype; float32 becomes float16, bfloat16 for Gemma). None when it cannot be told."""
    names = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}
    dtype = names.get(str(info.get("dtype", "")).lower(), str(info.get("dtype", "")).lower())
    if dtype in ("float32", "float16", "bfloat16"):
        return dtype
    if dtype != "auto":
        return None
    config = read_config(str(info.get("model_path", "")))
    if config is None:
        return None
    declared = declared_dtype(config)
    if declared != "float32":
        return declared if declared in ("float16", "bfloat16") else None
    return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"


class WeightSender:
    """Sends the trainer's weights to every rollout server of the run.

    A server that refuses a bucket answers before it receives anything (SGLang refuses an update
    outside a session that way): the sync then fails at once with the server's message, and a
    group whose broadcast no longer completes is not used again."""

    def __init__(self, clients: list, *, master_address: str, master_port: int, backend: str,
                 bucket_bytes: int, group_name: str = DEFAULT_GROUP_NAME, flattened: bool = True,
                 run_token: str | None = None, from_ranks: list[list[int]] | None = None,
                 trainer_ranks: int = 1) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown weight-sync backend {backend!r}; one of {', '.join(BACKENDS)}")
        self.clients = clients
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.flattened = flattened or backend == "ipc"  # IPC hands over one buffer per bucket
        """Buckets as one flattened uint8 tensor each (SGLang's load_format "flattened_bucket":
        one broadcast per bucket; a slice of the trainer's parameters as they lie, when they lie
        back to back: weightsync/flat.py), or tensor by tensor (one broadcast per tensor)."""
        self.ipc_load_format = FLATTENED_BUCKET if flattened or from_ranks is not None else None
        """IPC: every bucket is packed into one buffer and handed over as one flattened bucket
        (one IPC handle; ipc.dumps_bucket), or with flattened=False as a list of (name, tensor)
        views of that buffer (load_format null; a handle per tensor, as SGLang senders may send)."""
        self.group = None
        self.broken = False
        self.session_needed: list[bool] = []
        self.open_sessions: list = []
        """Servers whose update session this sync opened and has not closed yet."""
        self.world_size = 0
        self.rank_offsets: list[int] = []
        self.tp_sizes: list[int] = []
        self.buffers: list = [None, None]
        """BucketMaker's two pack buffers, kept from one sync to the next."""
        self.server_dtype: torch.dtype | None = None
        """The dtype every server holds its weights in (None: they differ, or cannot be told);
        wider floating-point weights are cast to it before they leave (buckets.wire_tensor)."""
        self.run_token = run_token
        """The run's token (None outside a run): IPC buffers carry a tag made with it, by which
        the built-in server knows them for this run's (ipc.py)."""
        self.from_ranks = from_ranks
        """IPC only, colocated: for each server, the trainer ranks on its devices, one per TP rank,
        which hand it their own copy of each bucket (ipc_ranks.py). None: rank 0 hands over all."""
        self.trainer_ranks = trainer_ranks
        self.shares: RankShares | None = None

    async def connect(self) -> None:
        """Ask every server what it is (TP size: how many ranks it takes; dtype) and, for a
        broadcast, create the group: every server is asked to join while we join."""
        infos = await asyncio.gather(*(c.server_info() for c in self.clients))
        self.tp_sizes = [int(i.get("tp_size", 1)) for i in infos]
        dtypes = {server_dtype(i) for i in infos}
        if len(dtypes) == 1 and None not in dtypes:
            self.server_dtype = dtype_from_name(dtypes.pop())
        if self.backend != "ipc":
            await self._join()
        self.session_needed = list(await asyncio.gather(*(c.needs_update_session() for c in self.clients)))
        if self.from_ranks is not None:
            self._check_from_ranks()

    def _check_from_ranks(self) -> None:
        from rlctl.errors import RunError

        if self.backend != "ipc":
            raise RunError("weights come from every trainer rank only over ipc")
        if len(self.from_ranks) != len(self.clients):
            raise RunError(f"{len(self.from_ranks)} lists of trainer ranks for {len(self.clients)} server(s)")
        for client, ranks, tp in zip(self.clients, self.from_ranks, self.tp_sizes, strict=True):
            if len(ranks) != tp or not all(0 <= r < self.trainer_ranks for r in ranks):
                raise RunError(f"server {client.url} has {tp} TP rank(s), and trainer ranks {ranks} of "
                               f"{self.trainer_ranks} are to hand it its weights: one rank per TP rank")

    @property
    def share_spec(self) -> ShareSpec | None:
        """What the other trainer ranks need to pack the buckets rank 0 does, when they hand
        their servers the weights themselves (None: they do not)."""
        if self.from_ranks is None:
            return None
        return ShareSpec(self.bucket_bytes, self.flattened, dtype_name(self.server_dtype) if self.server_dtype else None)

    async def _join(self) -> None:
        loop = asyncio.get_running_loop()
        self.world_size, self.rank_offsets = group_layout(self.tp_sizes)
        joins = [asyncio.create_task(self._ask_to_join(c, offset))
                 for c, offset in zip(self.clients, self.rank_offsets, strict=True)]
        try:
            self.group = await loop.run_in_executor(None, self._join_group)
        except BaseException:  # our side failed: the servers' answers no longer matter
            for j in joins:
                j.cancel()
            await asyncio.gather(*joins, return_exceptions=True)
            raise
        try:
            await asyncio.gather(*joins)
        except BaseException:
            self._close_store()  # a group that did not form needs its store no more
            raise
        self._formed()

    def _formed(self) -> None:
        """Every server has joined: the group's store takes no new connection, and closes now,
        unless NCCL still needs it: it makes its communicator at the first broadcast (store.py)."""
        seal_store(self.group)
        if self.backend != "nccl":
            self._close_store()

    def _close_store(self) -> None:
        close_store(self.group)

    async def _ask_to_join(self, client, rank_offset: int) -> None:
        """One server's part of forming the group (it joins while we do)."""
        await client.init_weights_update_group(
            master_address=self.master_address, master_port=self.master_port, rank_offset=rank_offset,
            world_size=self.world_size, group_name=self.group_name, backend=self.backend)

    def _join_group(self):
        """Our end of the group, as rank 0 (blocking: it waits for every server's ranks)."""
        return init_custom_process_group(
            backend=self.backend, init_method=f"tcp://{self.master_address}:{self.master_port}",
            world_size=self.world_size, rank=0, group_name=self.group_name)

    def _maker(self, weights: Iterable[tuple[str, torch.Tensor]]) -> BucketMaker:
        staging = "cpu" if self.backend == "gloo" else None  # None: where the weights are
        if self.backend != "ipc":
            return BucketMaker(weights, self.bucket_bytes, self.flattened, self.server_dtype,
                               staging=staging, buffers=self.buffers)
        from rlctl.engines.weightsync import ipc

        key = ipc.ipc_key(self.run_token)
        maker = BucketMaker(weights, self.bucket_bytes, self.flattened, self.server_dtype, staging=staging,
                            share=True, buffers=self.buffers, trailer=ipc.TAG_BYTES,
                            seal=lambda buf: ipc.tag_buffer(buf, key))
        self.shares = RankShares(maker, self.trainer_ranks) if self.from_ranks is not None else None
        return maker

    def _next(self, maker: BucketMaker) -> Bucket | None:
        """The next bucket, and for IPC its payloads: one per TP rank of every server (each
        pickle is opened once: torch counts the references a CUDA IPC handle has)."""
        from rlctl.engines.weightsync import ipc

        if self.shares is not None:
            bucket, pickles = self.shares.next()
            if bucket is not None:
                bucket.ipc = payloads_by_server(pickles, self.from_ranks or [])
            return bucket
        bucket = maker.next()
        if bucket is not None and self.backend == "ipc":
            assert bucket.flat is not None
            metas = [(m.name, dtype_from_name(m.dtype), m.shape) for m in bucket.metas]
            if self.ipc_load_format == FLATTENED_BUCKET:
                bucket.ipc = [[ipc.dumps_bucket(bucket.flat, metas) for _ in range(tp)] for tp in self.tp_sizes]
            else:
                views = list(unflatten_bucket(bucket.flat, metas))
                bucket.ipc = [[ipc.dumps(views) for _ in range(tp)] for tp in self.tp_sizes]
        return bucket

    async def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: str, pause_mode: str = "abort",
                   producer=None) -> SyncStats:
        """Send `weights` (read lazily, on the `producer` executor: None = asyncio's default) to
        every server as weight version `version`."""
        from rlctl.errors import RunError

        start = time.monotonic()
        loop = asyncio.get_running_loop()
        maker = self._maker(weights)
        upcoming: asyncio.Future | None = None
        everyone = self.clients
        in_session = [c for c, need in zip(self.clients, self.session_needed, strict=False) if need]
        nbytes = buckets = tensors = 0
        try:
            if (self.group is None and self.backend != "ipc") or self.broken:
                raise RunError("the weight-sync group is not connected (or a failed sync broke it)")
            upcoming = loop.run_in_executor(producer, self._next, maker)
            await self._begin(everyone, in_session, pause_mode)
            while upcoming is not None and (bucket := await upcoming) is not None:
                upcoming = None if bucket.last else loop.run_in_executor(producer, self._next, maker)
                await self._send_bucket(bucket, version if bucket.last else None)
                nbytes += sum(m.nbytes for m in bucket.metas)
                buckets, tensors = buckets + 1, tensors + len(bucket.metas)
        except BaseException:
            # Let the producer finish, then read the weights to the end on it: other trainer
            # ranks reading them too (Megatron TP) wait in gathers until rank 0 has read every
            # tensor, even of a sync refused before its first bucket.
            if upcoming is not None:
                await asyncio.gather(upcoming, return_exceptions=True)
            drain = self.shares.drain if self.shares is not None else maker.drain
            await asyncio.gather(loop.run_in_executor(producer, drain), return_exceptions=True)
            await self._abandon()
            raise
        await self._finish(everyone, in_session, version, buckets)
        return SyncStats(time.monotonic() - start, nbytes, buckets, tensors)

    async def _begin(self, everyone: list, in_session: list, pause_mode: str) -> None:
        await asyncio.gather(*(c.pause_generation(pause_mode) for c in everyone))
        await asyncio.gather(*(c.flush_cache() for c in everyone))
        opened = await asyncio.gather(*(c.begin_weight_update() for c in in_session), return_exceptions=True)
        self.open_sessions = [c for c, r in zip(in_session, opened, strict=True) if not isinstance(r, BaseException)]
        for r in opened:
            if isinstance(r, BaseException):
                raise r

    async def _finish(self, everyone: list, in_session: list, version: str, buckets: int) -> None:
        if buckets == 0:
            await asyncio.gather(*(c.update_weight_version(version) for c in everyone))
        await asyncio.gather(*(c.end_weight_update() for c in in_session))
        self.open_sessions = []
        await asyncio.gather(*(c.continue_generation() for c in everyone))

    async def _abandon(self) -> None:
        """After a failed sync, close the update sessions it opened: a server keeps its session
        open otherwise, and refuses the next sync's begin_weight_update (SGLang does: a second
        begin fails with "a weight-update session is already open"). The servers stay paused:
        their weights may be half new, and only a whole sync may let them generate again. A
        server that does not answer is left as it is; it is lost, or it will be."""
        opened, self.open_sessions = self.open_sessions, []
        if opened:
            ends = asyncio.gather(*(c.end_weight_update() for c in opened), return_exceptions=True)
            try:
                await asyncio.wait_for(ends, CLOSE_TIMEOUT_S)
            except TimeoutError:
                pass

    async def _send_bucket(self, bucket: Bucket, version: str | None) -> None:
        """Announce one bucket to every server, send it, and wait for every reply; the first
        refusal (or a failed broadcast) ends the sync with its message."""
        from rlctl.errors import RunError

        if self.backend == "ipc":
            await asyncio.gather(*(c.update_weights_from_tensor(payloads, weight_version=version,
                                                                load_format=self.ipc_load_format)
                                   for c, payloads in zip(self.clients, bucket.ipc or [], strict=True)))
            return
        replies = [asyncio.create_task(self._announce(c, bucket, version)) for c in self.clients]
        broadcast = in_daemon_thread(self._broadcast, bucket.payload)
        done, _ = await asyncio.wait([broadcast, *replies], return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if failed:
            self.broken = True
            for t in replies:
                t.cancel()
            if not broadcast.done():  # it fails later, when the group goes; nobody awaits it any more
                broadcast.add_done_callback(lambda f: f.cancelled() or f.exception())
            error = failed[0].exception()
            if failed[0] is broadcast:
                raise RunError(f"weight broadcast to the servers failed: {error}") from error
            raise error
        self._close_store()  # every rank has its NCCL communicator now (a no-op once closed)

    async def _announce(self, client, bucket: Bucket, version: str | None) -> None:
        await client.update_weights_from_distributed(
            names=[m.name for m in bucket.metas], dtypes=[m.dtype for m in bucket.metas],
            shapes=[list(m.shape) for m in bucket.metas], group_name=self.group_name,
            weight_version=version, flattened=self.flattened)

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Every tensor of the bucket, queued at once; returns when the last has left."""
        import torch
        import torch.distributed as dist

        if tensors and tensors[0].is_cuda:
            torch.cuda.set_device(tensors[0].device)  # this thread's current device, which NCCL uses
        works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]
        for w in works:
            w.wait()
        if tensors and tensors[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the buffer may be packed again after this

    async def close(self) -> None:
        if self.group is None:
            return
        group, self.group = self.group, None
        # A lost server may not answer: its peers' groups are destroyed all the same.
        destroys = asyncio.gather(*(c.destroy_weights_update_group(self.group_name) for c in self.clients),
                                  return_exceptions=True)
        try:
            await asyncio.wait_for(destroys, CLOSE_TIMEOUT_S)
        except TimeoutError:
            pass
        if not self.broken:
            destroy_process_group(group)
            return
        # A broadcast may still be blocked in a broken group: destroy it off this thread, and
        # give up waiting after a while (the process's exit ends it then). Destroyed, its name is
        # free again for the next group.
        try:
            await asyncio.wait_for(in_daemon_thread(destroy_process_group, group), CLOSE_TIMEOUT_S)
        except (TimeoutError, RuntimeError, ValueError):
            pass
