"""The weight-sync group: trainer rank 0 broadcasts Hugging Face-named tensors to every server.

The group is made exactly as SGLang makes it (docs/sglang.md): a TCP rendezvous at
tcp://master_address:master_port, the store wrapped in PrefixStore(group_name), then a new
process group of world_size on it. The trainer is rank 0 and hosts the store; server i joins as
rank_offset + tp_rank. Because both sides build the group the same way, rlctl's sender works
against real SGLang servers and SGLang-style senders work against rlctl's built-in server. The
store rank 0 hosts listens on master_address only (tcp_store), where torch's own rendezvous
would listen on every address of the host; the others connect as SGLang's recipe has them.

A sync sends the weights in buckets. Each bucket is announced to every server over HTTP
(names, dtypes, shapes), then broadcast either tensor by tensor or, with load_format
"flattened_bucket", as one uint8 tensor holding all tensors' bytes back to back.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Iterable, Iterator

if TYPE_CHECKING:
    import torch

DEFAULT_GROUP_NAME = "weight_update_group"
CLOSE_TIMEOUT_S = 10.0


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16', the form SGLang's update request carries."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    name = name.removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise ValueError(f"unsupported dtype '{name}'")
    return getattr(torch, name)


def init_custom_process_group(
    *,
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 300.0,
):
    """Join a process group that is independent of any default group (SGLang's recipe)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:  # the host of the store: on the master address only
        store = tcp_store(init_method, rank, world_size, timeout)
    else:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def tcp_store(init_method: str, rank: int, world_size: int, timeout: datetime.timedelta):
    """The store of a tcp://HOST:PORT rendezvous, as torch's rendezvous makes it, except that rank
    0 hosts it on HOST's address only: torch binds its store to every address of the host, so a
    socket bound here is handed to it (TCPStore's master_listen_fd). Other ranks connect."""
    from urllib.parse import urlsplit

    import torch.distributed as dist

    from rlctl.door import listening_socket

    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"{init_method!r} is not a tcp://HOST:PORT rendezvous")
    if rank != 0:
        return dist.TCPStore(url.hostname, url.port, world_size, False, timeout)
    fd = listening_socket(url.hostname, url.port).detach()  # the store owns and closes it
    return dist.TCPStore(url.hostname, url.port, world_size, True, timeout, master_listen_fd=fd)


def destroy_process_group(pg) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(pg)


_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
             "uint8": 1, "int8": 1, "bool": 1}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]


def group_layout(tp_sizes: list[int]) -> tuple[int, list[int]]:
    """The weight-sync group for servers of these TP sizes: (world size, each server's rank_offset).

    The trainer is rank 0. SGLang's TP worker r of a server joins as rank_offset + r, so a server
    of TP t takes t ranks: with TP sizes t_0..t_{n-1} the world is 1 + sum(t_i) and server i's
    offset is 1 + t_0 + ... + t_{i-1}."""
    offsets, next_rank = [], 1
    for t in tp_sizes:
        if t < 1:
            raise ValueError(f"a server reports tp_size {t}")
        offsets.append(next_rank)
        next_rank += t
    return next_rank, offsets


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Group tensors into buckets of at most bucket_bytes (a larger tensor goes alone).

    Within a bucket the tensors are ordered by descending itemsize (stable otherwise). SGLang's
    flattened bucket packs tensors back to back with no padding and refuses a tensor whose byte
    offset is not a multiple of its itemsize; with itemsizes powers of two and the larger ones
    first, every offset is aligned, whatever dtypes the model mixes."""
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for m in metas:
        if current and size + m.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(m)
        size += m.nbytes
    if current:
        buckets.append(current)
    return [sorted(b, key=lambda m: -m.itemsize) for b in buckets]


def flatten_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All tensors' bytes back to back in one uint8 tensor, as SGLang's FlattenedTensorBucket
    packs them: no padding. A tensor whose offset is not a multiple of its itemsize is refused
    here, as the receiver would refuse it (plan_buckets orders tensors so that none is)."""
    import torch

    parts, offset = [], 0
    for t in tensors:
        if offset % t.element_size():
            raise ValueError(f"unaligned tensor in a flattened bucket: byte offset {offset}, dtype {t.dtype}; "
                             "order the bucket by descending itemsize")
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        parts.append(raw)
        offset += raw.numel()
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unflatten_bucket(flat: torch.Tensor, metas: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The receiving side: each tensor starts where the previous one ends (SGLang's layout)."""
    offset = 0
    for name, dtype, shape in metas:
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        n = math.prod(shape) * dtype.itemsize
        yield name, flat[offset : offset + n].view(dtype).view(shape)
        offset += n


def flattened_size(metas: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in metas)


def receive_bucket(group, *, names: list[str], dtypes: list[str], shapes: list[list[int]], load_format: str | None,
                   device: str = "cpu", into: dict[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor | None]]:
    """The receiving side of one announced bucket: receive the broadcast from rank 0 and return
    (name, tensor) pairs in the announced order, with no copy: a flattened bucket as views of the
    fresh buffer it arrived in; tensor by tensor, each straight into `into[name]` (a server's own
    parameter) where dtype, shape and device match, returned as (name, None). A bucket that
    cannot be laid out (an unaligned offset) is refused before anything is received, as SGLang does."""
    import torch
    import torch.distributed as dist

    kinds = [dtype_from_name(d) for d in dtypes]
    sizes = [tuple(int(x) for x in s) for s in shapes]
    if load_format == "flattened_bucket":
        metas = list(zip(names, kinds, sizes, strict=True))
        flat = torch.empty(flattened_size(metas), dtype=torch.uint8, device=device)
        views = list(unflatten_bucket(flat, metas))  # raises on an unaligned offset, before the broadcast
        dist.broadcast(flat, src=0, group=group)
        return list(views)
    out: list[tuple[str, torch.Tensor | None]] = []
    where = torch.device(device)
    for n, d, s in zip(names, kinds, sizes, strict=True):
        t = (into or {}).get(n)
        fits = t is not None and t.dtype == d and tuple(t.shape) == s and t.is_contiguous() and t.device.type == where.type
        t = t if fits else torch.empty(s, dtype=d, device=device)
        dist.broadcast(t, src=0, group=group)
        out.append((n, None if fits else t))
    return out


def tensor_sha256(t: torch.Tensor) -> str:
    """Digest of a tensor's bytes: equal digests mean bit-for-bit equal weights."""
    import hashlib

    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    buckets: int
    tensors: int


def in_daemon_thread(fn, *args):
    """Run a blocking collective on a daemon thread; an asyncio future of its result.

    A collective whose peers never come (a server that refused the bucket) blocks until the
    group's timeout; on a daemon thread it cannot keep the process from exiting meanwhile."""
    import asyncio
    import threading

    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop has closed: nobody waits for this broadcast any more

    threading.Thread(target=run, daemon=True, name="weight-broadcast").start()
    return fut


class WeightSender:
    """Trainer rank 0's side of the weight-sync group, speaking to every rollout server.

    The order of one sync follows slime/miles against SGLang: pause_generation -> flush_cache ->
    begin_weight_update -> for each bucket (announce it to every server over HTTP, broadcast it,
    collect the replies) -> update_weight_version -> end_weight_update -> continue_generation.
    begin/end are sent only to servers that have them (SGLang >= 0.5.21, the built-in server).
    A server that refuses a bucket answers before it receives anything (SGLang refuses an update
    outside a session that way): the sync then fails at once with the server's message, and the
    group, whose broadcast no longer completes, is not used again.
    """

    def __init__(self, clients: list, *, master_address: str, master_port: int, backend: str,
                 bucket_bytes: int, group_name: str = DEFAULT_GROUP_NAME, flattened: bool = True) -> None:
        self.clients = clients
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.flattened = flattened
        self.group = None
        self.broken = False
        self.session_needed: list[bool] = []
        self.world_size = 0
        self.rank_offsets: list[int] = []

    async def connect(self) -> None:
        """Create the group: every server is asked to join while we join, or nobody returns.
        Each server's TP size (its /server_info) sets how many ranks it takes."""
        import asyncio

        loop = asyncio.get_running_loop()
        infos = await asyncio.gather(*(c.server_info() for c in self.clients))
        self.world_size, self.rank_offsets = group_layout([int(i.get("tp_size", 1)) for i in infos])
        joins = [
            asyncio.create_task(c.init_weights_update_group(
                master_address=self.master_address, master_port=self.master_port, rank_offset=offset,
                world_size=self.world_size, group_name=self.group_name, backend=self.backend))
            for c, offset in zip(self.clients, self.rank_offsets, strict=True)
        ]
        try:
            self.group = await loop.run_in_executor(None, lambda: init_custom_process_group(
                backend=self.backend, init_method=f"tcp://{self.master_address}:{self.master_port}",
                world_size=self.world_size, rank=0, group_name=self.group_name))
        except BaseException:  # our side failed: the servers' answers no longer matter
            for j in joins:
                j.cancel()
            await asyncio.gather(*joins, return_exceptions=True)
            raise
        await asyncio.gather(*joins)
        self.session_needed = list(await asyncio.gather(*(c.needs_update_session() for c in self.clients)))

    async def send(self, named_tensors: list[tuple[str, torch.Tensor]], version: str,
                   pause_mode: str = "abort") -> SyncStats:
        import asyncio
        import time

        from rlctl.errors import RunError

        if self.group is None or self.broken:
            raise RunError("the weight-sync group is not connected (or a failed sync broke it)")
        start = time.monotonic()
        everyone = self.clients
        in_session = [c for c, need in zip(self.clients, self.session_needed, strict=False) if need]
        await asyncio.gather(*(c.pause_generation(pause_mode) for c in everyone))
        await asyncio.gather(*(c.flush_cache() for c in everyone))
        await asyncio.gather(*(c.begin_weight_update() for c in in_session))
        by_name = dict(named_tensors)
        metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
                 for n, t in named_tensors]
        buckets = plan_buckets(metas, self.bucket_bytes)
        for bucket in buckets:
            await self._send_bucket(bucket, [by_name[m.name] for m in bucket], version)
        await asyncio.gather(*(c.update_weight_version(version) for c in everyone))
        await asyncio.gather(*(c.end_weight_update() for c in in_session))
        await asyncio.gather(*(c.continue_generation() for c in everyone))
        return SyncStats(time.monotonic() - start, sum(m.nbytes for m in metas), len(buckets), len(metas))

    async def _send_bucket(self, bucket: list[TensorMeta], tensors: list[torch.Tensor], version: str) -> None:
        """Announce one bucket to every server, broadcast it, and wait for every reply; the
        first refusal (or a failed broadcast) ends the sync with its message."""
        import asyncio

        from rlctl.errors import RunError

        replies = [
            asyncio.create_task(c.update_weights_from_distributed(
                names=[m.name for m in bucket], dtypes=[m.dtype for m in bucket],
                shapes=[list(m.shape) for m in bucket], group_name=self.group_name,
                weight_version=version, flattened=self.flattened))
            for c in self.clients
        ]
        broadcast = in_daemon_thread(self._broadcast, tensors)
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

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        if self.flattened:
            tensors = [flatten_bucket(tensors)]
        for t in tensors:
            if self.backend == "gloo":
                t = t.cpu()  # CPU staging: gloo moves host memory
            dist.broadcast(t.detach().contiguous(), src=0, group=self.group)

    async def close(self) -> None:
        import asyncio

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
