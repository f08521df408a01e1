"""A Megatron trainer's memory on its GPU, for a pool that multiplexes several runs' models on one
device (rlctl/engines/memory.py has the mechanics): what this rank holds, and moving it to host
memory and back, bit for bit.

    weights    the DDP buffers: parameters (params_dtype) and their fp32 gradients (main_grad)
    optimizer  the distributed optimizer's fp32 main parameters (bf16) and Adam's moments

Megatron keeps views of these buffers everywhere (each parameter, its main_grad, every bucket,
the optimizer's shards), so they are released in place (InPlace): the bytes leave, the storages
shrink to nothing and grow back, and every view is still the same tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlctl.engines.memory import MemoryTags, PrivateDir, Stash
from rlctl.errors import RunError


class InPlace:
    """Tensors released in place: their bytes go to host memory and their storages shrink to
    nothing, then grow back and take the bytes again, so that every view of them stays the same
    tensor object. For an engine that keeps views everywhere (Megatron's DDP buffers: each
    parameter, its main_grad and every bucket are views of one buffer; its distributed optimizer's
    shards). `tensors` is asked at each release (an optimizer makes its state at its first step)."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], name: str) -> None:
        self.tensors = tensors
        self.name = name
        self.storages: list = []
        self.stash: Stash | None = None

    def _storages(self) -> list:
        unique = {}
        for t in self.tensors():
            storage = t.untyped_storage()
            if storage.nbytes():
                unique.setdefault(storage.data_ptr(), storage)
        return list(unique.values())

    def nbytes(self) -> int:
        return self.stash.nbytes if self.stash is not None else sum(s.nbytes() for s in self._storages())

    def release(self, where: PrivateDir) -> int:
        self.storages = self._storages()
        self.stash = Stash.take([_storage_bytes(s) for s in self.storages], where, self.name, to_file=False)
        for storage in self.storages:
            storage.resize_(0)
        return self.stash.nbytes

    def resume(self) -> int:
        if self.stash is None:
            return 0
        for storage, n in zip(self.storages, self.stash.sizes, strict=True):
            storage.resize_(n)
        self.stash.restore(into=[_storage_bytes(s) for s in self.storages])  # kept if this fails: tried again
        moved, self.stash, self.storages = self.stash.nbytes, None, []
        return moved


def _storage_bytes(storage) -> torch.Tensor:
    """A uint8 tensor over the whole of an untyped storage."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class MegatronMemory:
    """The footprint on this rank (its TP shard, its share of the distributed optimizer), and
    its release and resume under the tags `weights` and `optimizer`."""

    model: Any
    ddp: Any
    optimizer: Any
    world_size: int

    def memory(self) -> dict[str, Any]:
        tags = self._memory_tags()
        return {"weights_bytes": tags.nbytes("weights"), "optimizer_bytes": tags.nbytes("optimizer"),
                "resident": tags.resident()}

    def _memory_tags(self) -> MemoryTags:
        if getattr(self, "_tags", None) is None:
            self._tags = MemoryTags({"weights": [InPlace(self._buffers, "weights")],
                                     "optimizer": [InPlace(self._optimizer_tensors, "optimizer")]},
                                    torch.device("cuda", torch.cuda.current_device()))
        return self._tags

    def _buffers(self) -> list[torch.Tensor]:
        buffers = list(self.ddp.buffers) + list(getattr(self.ddp, "expert_parallel_buffers", []))
        return [t for b in buffers for t in (b.param_data, b.grad_data) if t is not None]

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """Main parameters and every state tensor on the GPU, less what shares a DDP buffer (fp32
        main parameters are views of the parameters themselves)."""
        shared = {t.untyped_storage().data_ptr() for t in self._buffers()}
        out = []
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = opt.optimizer
            out += [p for group in inner.param_groups for p in group["params"]]
            out += [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
        return [t for t in out if t.is_cuda and t.untyped_storage().data_ptr() not in shared]

    def memory_resident(self) -> dict[str, bool]:
        return self._memory_tags().resident()

    def check_memory_tags(self, tags: list[str] | None) -> None:
        try:
            self._memory_tags().select(tags)
        except ValueError as e:
            raise RunError(str(e)) from None

    def release_memory(self, tags: list[str] | None) -> dict[str, Any]:
        moved = self._memory_tags().release(tags)
        if self.world_size > 1:
            dist.barrier()
        return {"released": moved.tags, "bytes": moved.bytes, "seconds": moved.seconds}

    def resume_memory(self, tags: list[str] | None) -> dict[str, Any]:
        moved = self._memory_tags().resume(tags)
        if self.world_size > 1:
            dist.barrier()
        return {"resumed": moved.tags, "bytes": moved.bytes, "seconds": moved.seconds}
