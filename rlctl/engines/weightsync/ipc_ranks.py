"""Colocated on several devices: every trainer rank hands its own server the weights.

A CUDA IPC handle opens only in a process that sees its GPU, and a colocated server sees only
the GPUs it shares with trainer ranks: trainer rank s * tp + j and TP rank j of server s sit on
one GPU (rlctl/process/devices.py places both from the same list). So no one rank can hand
every server the weights. Instead every rank packs the same bucket on its own device and pickles
it as a flattened bucket (ipc.dumps_bucket); the pickles are gathered to rank 0, which sends server s the
pickles of its ranks, one per TP rank, in the list SGLang's /update_weights_from_tensor takes.
Every rank holds the full tensors as it reads them: a torch trainer's ranks are replicas, and a
Megatron trainer's TP ranks gather each tensor whole (megatron_engine.py hf_weights).

Per bucket, every rank does the same, in the same order: rank 0 broadcasts "go" or "stop"; on
go each packs its next bucket and its pickle is gathered to rank 0; on stop each reads the rest
of its weights and keeps none (a failed sync's drain: the gathers of a Megatron trainer need
every rank to the end). Rank 0 asks for bucket i+2 only once every server has answered for
bucket i (sender.py), so its "go" for bucket i+2 is also what frees the others' buffer of
bucket i to be packed again. The followers' pack buffers live from one sync to the next, as
rank 0's do, until the trainer releases its memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlctl.engines.weightsync import ipc
from rlctl.errors import RunError
from rlctl.engines.weightsync.buckets import Bucket, BucketMaker, dtype_from_name

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

SHARE_COMMAND = "share_weights"
"""What rank 0 broadcasts to the other ranks (rlctl/engines/train/service.py follower_loop)."""
GO, STOP = "go", "stop"


@dataclass(frozen=True)
class ShareSpec:
    """What makes every rank's buckets the same as rank 0's: the sender's bucket settings."""

    bucket_bytes: int
    flattened: bool
    server_dtype: str | None


def tagged_maker(weights: Iterable[tuple[str, torch.Tensor]], spec: ShareSpec, key: bytes,
                 buffers: list) -> BucketMaker:
    """A maker of buckets to hand over in place: packed into shared buffers that end in the tag
    the run's token makes (ipc.py)."""
    dtype = dtype_from_name(spec.server_dtype) if spec.server_dtype else None
    return BucketMaker(weights, spec.bucket_bytes, spec.flattened, dtype, staging=None, share=True,
                       buffers=buffers, trailer=ipc.TAG_BYTES, seal=lambda buf: ipc.tag_buffer(buf, key))


def pickle_of(bucket: Bucket | None) -> str | None:
    """This rank's payload of a bucket: its packed buffer as a flattened bucket (ipc.dumps_bucket)."""
    if bucket is None:
        return None
    assert bucket.flat is not None
    return ipc.dumps_bucket(bucket.flat, [(m.name, dtype_from_name(m.dtype), m.shape) for m in bucket.metas])


def _broadcast(flag: str | None) -> str:
    import torch.distributed as dist

    box = [flag]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(payload: str | None, world_size: int) -> list[str | None] | None:
    import torch.distributed as dist

    if dist.get_rank() != 0:
        dist.gather_object(payload, None, dst=0)
        return None
    out: list[str | None] = [None] * world_size
    dist.gather_object(payload, out, dst=0)
    return out


class RankShares:
    """Rank 0's side: each call of `next` is one bucket, packed by every rank at once."""

    def __init__(self, maker: BucketMaker, world_size: int) -> None:
        self.maker = maker
        self.world_size = world_size
        self.done = False
        """Every rank has packed its last bucket (they are back in their command loop)."""

    def next(self) -> tuple[Bucket | None, list[str | None]]:
        """The next bucket and every rank's pickle of it (by rank)."""
        _broadcast(GO)
        bucket = self.maker.next()
        pickles = _gather(pickle_of(bucket), self.world_size) or []
        if bucket is None or bucket.last:
            self.done = True
        return bucket, pickles

    def drain(self) -> None:
        """A failed sync: the other ranks (while they are still in it) and this one read the rest
        of the weights and keep none."""
        if not self.done:
            _broadcast(STOP)
            self.done = True
        self.maker.drain()


def follow_share(weights: Iterable[tuple[str, torch.Tensor]], spec: ShareSpec, key: bytes, buffers: list,
                 world_size: int) -> None:
    """A rank > 0's side of one sync, until its last bucket or rank 0's stop."""
    maker = tagged_maker(weights, spec, key, buffers)
    while True:
        if _broadcast(None) == STOP:
            maker.drain()
            return
        bucket = maker.next()
        _gather(pickle_of(bucket), world_size)
        if bucket is None or bucket.last:
            return


def payloads_by_server(pickles: list[str | None], from_ranks: list[list[int]]) -> list[list[str]]:
    """Server s's payloads, one per TP rank, from the ranks on its GPUs (`from_ranks[s]`)."""
    out = []
    for ranks in from_ranks:
        mine = [pickles[r] for r in ranks]
        if any(p is None for p in mine):
            raise RunError(f"trainer ranks {ranks} packed no bucket where rank 0 did: their weights differ")
        out.append(mine)
    return out
