"""The weight-sync group: trainer rank 0 broadcasts Hugging Face-named tensors to every server.

The group is made exactly as SGLang makes it (docs/sglang.md): a TCP rendezvous at
tcp://master_address:master_port, the store wrapped in PrefixStore(group_name), then a new
process group of world_size on it. The trainer is rank 0 and hosts the store; server i joins as
rank_offset + tp_rank. Because both sides build the group the same way, rlctl's sender works
against real SGLang servers and SGLang-style senders work against rlctl's built-in server.

A sync sends the weights in buckets. Each bucket is announced to every server over HTTP
(names, dtypes, shapes), then broadcast either tensor by tensor or, with load_format
"flattened_bucket", as one uint8 tensor holding all tensors' bytes back to back.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Iterable, Iterator

if TYPE_CHECKING:
    import torch

DEFAULT_GROUP_NAME = "weight_update_group"

_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "int8", "bool")


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16', the form SGLang's update request carries."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    name = name.removeprefix("torch.")
    if name not in _DTYPE_NAMES:
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
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(pg) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(pg)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Group tensors, in order, into buckets of at most bucket_bytes (a larger tensor goes alone)."""
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
    return buckets


def flatten_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All tensors' bytes back to back in one uint8 tensor (each offset a multiple of its itemsize).

    Offsets only need padding when dtypes of different sizes mix; padding keeps every slice
    viewable as its dtype on the receiving side.
    """
    import torch

    parts, offset = [], 0
    for t in tensors:
        pad = (-offset) % t.element_size()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
            offset += pad
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        parts.append(raw)
        offset += raw.numel()
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unflatten_bucket(flat: torch.Tensor, metas: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Iterator[tuple[str, torch.Tensor]]:
    import math

    offset = 0
    for name, dtype, shape in metas:
        itemsize = dtype.itemsize
        offset += (-offset) % itemsize
        n = math.prod(shape) * itemsize
        yield name, flat[offset : offset + n].view(dtype).view(shape)
        offset += n


def flattened_size(metas: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    import math

    offset = 0
    for _, dtype, shape in metas:
        offset += (-offset) % dtype.itemsize
        offset += math.prod(shape) * dtype.itemsize
    return offset


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


class WeightSender:
    """Trainer rank 0's side of the weight-sync group, speaking to every rollout server.

    The order of one sync follows slime/miles against SGLang: pause_generation -> flush_cache ->
    begin_weight_update -> for each bucket (announce it to every server over HTTP, broadcast it,
    collect the replies) -> update_weight_version -> end_weight_update -> continue_generation.
    begin/end are sent only to servers that need them (SGLang >= 0.5.21, the built-in server).
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
        self.session_needed: list[bool] = []

    async def connect(self) -> None:
        """Create the group: every server is asked to join while we join, or nobody returns."""
        import asyncio

        loop = asyncio.get_running_loop()
        world_size = 1 + len(self.clients)
        joins = [
            asyncio.create_task(c.init_weights_update_group(
                master_address=self.master_address, master_port=self.master_port, rank_offset=1 + i,
                world_size=world_size, group_name=self.group_name, backend=self.backend))
            for i, c in enumerate(self.clients)
        ]
        self.group = await loop.run_in_executor(None, lambda: init_custom_process_group(
            backend=self.backend, init_method=f"tcp://{self.master_address}:{self.master_port}",
            world_size=world_size, rank=0, group_name=self.group_name))
        await asyncio.gather(*joins)
        self.session_needed = list(await asyncio.gather(*(c.needs_update_session() for c in self.clients)))

    async def send(self, named_tensors: list[tuple[str, torch.Tensor]], version: str,
                   pause_mode: str = "abort") -> SyncStats:
        import asyncio
        import time

        assert self.group is not None, "connect() first"
        loop = asyncio.get_running_loop()
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
        total = 0
        for bucket in buckets:
            replies = [
                asyncio.create_task(c.update_weights_from_distributed(
                    names=[m.name for m in bucket], dtypes=[m.dtype for m in bucket],
                    shapes=[list(m.shape) for m in bucket], group_name=self.group_name,
                    weight_version=version, flattened=self.flattened))
                for c in everyone
            ]
            tensors = [by_name[m.name] for m in bucket]
            if self.flattened:
                await loop.run_in_executor(None, self._broadcast, [flatten_bucket(tensors)])
            else:
                await loop.run_in_executor(None, self._broadcast, tensors)
            await asyncio.gather(*replies)
            total += sum(m.nbytes for m in bucket)
        await asyncio.gather(*(c.update_weight_version(version) for c in everyone))
        await asyncio.gather(*(c.end_weight_update() for c in in_session))
        await asyncio.gather(*(c.continue_generation() for c in everyone))
        return SyncStats(time.monotonic() - start, total, len(buckets), len(metas))

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        for t in tensors:
            if self.backend == "gloo":
                t = t.cpu()  # CPU staging: gloo moves host memory
            dist.broadcast(t.detach().contiguous(), src=0, group=self.group)

    async def close(self) -> None:
        import asyncio

        if self.group is None:
            return
        await asyncio.gather(*(c.destroy_weights_update_group(self.group_name) for c in self.clients),
                             return_exceptions=True)
        destroy_process_group(self.group)
        self.group = None
