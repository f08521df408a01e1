"""Buckets: how a sync's tensors are grouped, laid out on the wire, and received.

A bucket is announced to every server (names, dtypes, shapes) and then arrives either tensor by
tensor or, with load_format "flattened_bucket", as one uint8 tensor holding all its tensors'
bytes back to back (SGLang's FlattenedTensorBucket layout: no padding).

BucketMaker is the sending side's producer: it pulls (name, tensor) pairs from the trainer's
weights one at a time (a Megatron engine gathers each tensor's TP shards as it is asked for it),
casts them to the servers' dtype and packs them into one of two reusable buffers, so that the
next bucket is made while the previous one is on the wire and no full copy of the model exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
             "uint8": 1, "int8": 1, "bool": 1}


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16', the form SGLang's update request carries."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    name = name.removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise ValueError(f"unsupported dtype '{name}'")
    return getattr(torch, name)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]


def size_groups(items: Iterable[T], nbytes: Callable[[T], int], bucket_bytes: int) -> Iterator[tuple[list[T], bool]]:
    """Consecutive items in groups of at most bucket_bytes (a larger item goes alone), each with
    whether it is the last. Lazy: a group is given once the first item of the next one is read."""
    group: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if group and size + n > bucket_bytes:
            yield group, False
            group, size = [], 0
        group.append(item)
        size += n
    if group:
        yield group, True


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Group tensors into buckets of at most bucket_bytes (a larger tensor goes alone).

    Within a bucket the tensors are ordered by descending itemsize (stable otherwise). SGLang's
    flattened bucket packs tensors back to back with no padding and refuses a tensor whose byte
    offset is not a multiple of its itemsize; with itemsizes powers of two and the larger ones
    first, every offset is aligned, whatever dtypes the model mixes."""
    return [sorted(b, key=lambda m: -m.itemsize) for b, _ in size_groups(metas, lambda m: m.nbytes, bucket_bytes)]


def flatten_bucket(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """All tensors' bytes back to back in one uint8 tensor, as SGLang's FlattenedTensorBucket
    packs them: no padding. Written into `out` (a buffer at least that large; the prefix used is
    returned) or a new tensor. A tensor whose offset is not a multiple of its itemsize is refused
    here, as the receiver would refuse it (plan_buckets orders tensors so that none is)."""
    import torch

    total = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(total, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu") if out is None else out[:total]
    offset = 0
    for t in tensors:
        if offset % t.element_size():
            raise ValueError(f"unaligned tensor in a flattened bucket: byte offset {offset}, dtype {t.dtype}; "
                             "order the bucket by descending itemsize")
        n = t.numel() * t.element_size()
        flat[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += n
    return flat


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
                   device: str = "cpu", into: dict[str, torch.Tensor] | None = None,
                   scratch: list | None = None, target: torch.Tensor | None = None) -> list[tuple[str, torch.Tensor | None]]:
    """The receiving side of one announced bucket: receive the broadcast from rank 0 and return
    (name, tensor) pairs in the announced order, with no copy: a flattened bucket as views of the
    buffer it arrived in (scratch[0], kept and reused from one bucket to the next when a
    one-element list is given: the views are then valid until the next call); tensor by tensor,
    each straight into `into[name]` (a server's own parameter) where dtype, shape and device
    match, returned as (name, None). A bucket that cannot be laid out (an unaligned offset) is
    refused before anything is received, as SGLang does. `target`: where a flattened bucket's
    bytes belong as they are (a slice of a server's parameters laid out back to back, the
    bucket's tensors in the same order): it is received there, and every pair is (name, None)."""
    import torch
    import torch.distributed as dist

    where = torch.device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)  # this thread's current device: NCCL works on it
    kinds = [dtype_from_name(d) for d in dtypes]
    sizes = [tuple(int(x) for x in s) for s in shapes]
    if load_format == "flattened_bucket":
        metas = list(zip(names, kinds, sizes, strict=True))
        n = flattened_size(metas)
        if target is not None and target.numel() == n and target.dtype == torch.uint8 and target.device.type == where.type:
            list(unflatten_bucket(target, metas))  # refuses an unaligned offset, before the broadcast
            dist.broadcast(target, src=0, group=group)
            return [(name, None) for name in names]
        kept = scratch[0] if scratch else None
        if kept is None or kept.numel() < n or kept.device != where:
            kept = torch.empty(n, dtype=torch.uint8, device=where)
            if scratch is not None:
                scratch[:] = [kept]
        flat = kept[:n]
        views = list(unflatten_bucket(flat, metas))  # raises on an unaligned offset, before the broadcast
        dist.broadcast(flat, src=0, group=group)
        return list(views)
    out: list[tuple[str, torch.Tensor | None]] = []
    pending = []
    for n, d, s in zip(names, kinds, sizes, strict=True):
        t = (into or {}).get(n)
        fits = t is not None and t.dtype == d and tuple(t.shape) == s and t.is_contiguous() and t.device.type == where.type
        t = t if fits else torch.empty(s, dtype=d, device=device)
        pending.append(dist.broadcast(t, src=0, group=group, async_op=True))
        out.append((n, None if fits else t))
    for work in pending:
        work.wait()
    return out


def tensor_sha256(t: torch.Tensor) -> str:
    """Digest of a tensor's bytes: equal digests mean bit-for-bit equal weights."""
    import hashlib

    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def as_served(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor as a server of this dtype holds it (floating-point weights cast on load)."""
    t = t.detach()
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def wire_tensor(t: torch.Tensor, server_dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor as it goes to a server of this dtype: cast there before it leaves when that is
    fewer bytes (a bf16 server is sent bf16, not the trainer's fp32: half the bytes, and the very
    values its load would have cast to); otherwise as it is, and the server casts on load."""
    t = t.detach()
    if server_dtype is not None and t.is_floating_point() and server_dtype.itemsize < t.element_size():
        t = t.to(server_dtype)
    return t


def back_to_back(tensors: list[torch.Tensor], staging: str | None) -> torch.Tensor | None:
    """The bytes of these tensors as one uint8 view, when they already lie back to back in one
    storage in this order (and on the staging device): the flattened bucket, with no copy."""
    import torch

    first = tensors[0]
    storage = first.untyped_storage()
    if staging is not None and first.device != torch.device(staging):
        return None
    start = offset = first.storage_offset() * first.element_size()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.storage_offset() * t.element_size() != offset):
            return None
        offset += t.numel() * t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (offset - start,))


@dataclass
class Bucket:
    """One bucket as it goes out: its tensors' metadata in wire order and what is broadcast (the
    tensors themselves, or one flattened uint8 tensor). `last`: no bucket follows in this sync."""

    metas: list[TensorMeta]
    payload: list[torch.Tensor]
    last: bool
    flat: torch.Tensor | None = None
    ipc: list[list[str]] | None = None
    """For IPC: per server, one pickled flattened bucket of `flat` per TP rank (ipc.dumps_bucket)."""


@dataclass
class BucketMaker:
    """Makes a sync's buckets one at a time from a stream of (name, tensor) pairs.

    `staging` is the device the bytes leave from (cpu for gloo; None: where the weights are, for
    NCCL or IPC).
    Flattened buckets are packed into one of two buffers in turn, grown to the largest bucket and
    reused: bucket i+1 is packed into the one bucket i is not in. The caller must be done with
    bucket i before asking for bucket i+2. A bucket whose tensors already lie back to back (a
    slice of parameters laid out by weightsync/flat.py) is sent as it is, unpacked."""

    weights: Iterable[tuple[str, torch.Tensor]]
    bucket_bytes: int
    flattened: bool
    server_dtype: torch.dtype | None = None
    """Floating-point weights wider than this are cast to it before they leave (wire_tensor)."""
    staging: str | None = "cpu"
    share: bool = False
    """The buffers are handed to other processes (ipc.py moves CPU ones into shared memory, once):
    every bucket is packed into one, never sent from where the weights lie."""
    trailer: int = 0
    """Bytes each pack buffer has past the largest bucket, for `seal` to write (ipc.py's tag)."""
    seal: Callable[[torch.Tensor], None] | None = None
    """Called on each pack buffer as it is made, trailer included."""
    buffers: list = field(default_factory=lambda: [None, None])
    """The two pack buffers: pass the same list to every sync's maker and they are allocated once
    for the run (a fresh CPU buffer is page-faulted in anew by every sync that writes it)."""
    _groups: Iterator | None = None
    _turn: int = 0
    _device: str = "cpu"

    def next(self) -> Bucket | None:
        """The next bucket, or None when the weights are all sent. Blocking: run it where the
        weights may be read (the trainer's engine thread)."""
        items, last = next(self._stream(), ([], True))
        if not items:
            return None
        items.sort(key=lambda item: -item[1].element_size())  # aligned offsets (plan_buckets)
        metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in items]
        size = sum(m.nbytes for m in metas)
        self._device = str(items[0][1].device)
        if not self.flattened:
            return Bucket(metas, [t.to(self.staging) if self.staging else t for _, t in items], last)
        flat = None if self.share else back_to_back([t for _, t in items], self.staging)
        if flat is not None:  # already laid out as the bucket is (weightsync/flat.py): sent as it is
            return Bucket(metas, [flat], last, flat)
        flat = flatten_bucket([t for _, t in items], self._buffer(size))
        if flat.is_cuda:
            import torch

            torch.cuda.current_stream(flat.device).synchronize()  # packed before anyone reads it
        return Bucket(metas, [flat], last, flat)

    def drain(self) -> None:
        """Read the rest of the weights, keeping none: a sync that failed half-way still takes
        its part in every gather other trainer ranks make as they read the same weights."""
        for _ in self._stream():
            pass

    def _stream(self) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
        """The weights, cast for the wire, in groups up to the bucket size (size_groups)."""
        if self._groups is None:
            cast = ((name, wire_tensor(t, self.server_dtype)) for name, t in self.weights)
            self._groups = size_groups(cast, lambda item: item[1].numel() * item[1].element_size(), self.bucket_bytes)
        return self._groups

    def _buffer(self, size: int) -> torch.Tensor:
        import torch

        device = torch.device(self.staging or self._device)
        buf = self.buffers[self._turn]
        if buf is None or buf.numel() < size + self.trailer or buf.device != device:  # grown to the largest bucket, once
            pin = device.type == "cpu" and not self.share and torch.cuda.is_available()  # fast copies from a GPU
            buf = torch.empty(size + self.trailer, dtype=torch.uint8, device=device, pin_memory=pin)
            if self.seal is not None:
                self.seal(buf)
            self.buffers[self._turn] = buf
        self._turn ^= 1
        return buf
