"""Parameters laid out in one buffer, so that a flattened bucket is a slice of it on both sides.

A flattened bucket (SGLang's load_format "flattened_bucket") is the bytes of its tensors back to
back. When a model's parameters are themselves views of one buffer, in the order of
named_parameters() (the order trainers send them in: rlctl/engines/train), a bucket whose
tensors are consecutive there is exactly a slice of that buffer. The trainer then sends that
slice as it is (BucketMaker packs nothing), and the built-in server receives it straight into
its parameters (receive_bucket's target): one broadcast per bucket and no copy on either side.
Any other bucket (another order, a cast, another dtype) is packed, received and copied as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class FlatParams:
    buffer: torch.Tensor | None
    """uint8, every parameter's bytes back to back; None while detach()ed (memory released)."""
    spans: dict[str, tuple[int, int]]
    """state_dict name -> (byte offset, bytes); tied names share one span."""
    dtype: torch.dtype
    owners: list[tuple[Any, int, int, tuple[int, ...]]] = field(default_factory=list)
    """(parameter, byte offset, bytes, shape) of each parameter once: what detach() and attach() re-point."""

    def slice_for(self, names: list[str], dtypes: list[str], sizes: list[int]) -> torch.Tensor | None:
        """The part of the buffer a flattened bucket of these tensors fills exactly, or None."""
        from rlctl.engines.weightsync.buckets import dtype_name

        if not names or any(d.removeprefix("torch.") != dtype_name(self.dtype) for d in dtypes):
            return None
        start = offset = self.spans.get(names[0], (-1, 0))[0]
        for name, n in zip(names, sizes, strict=True):
            if self.spans.get(name) != (offset, n):
                return None
            offset += n
        return self.buffer[start:offset] if self.buffer is not None else None

    def detach(self) -> torch.Tensor:
        """Take the buffer out of the model and return it: every parameter then points at an
        empty tensor, so that dropping the returned buffer frees the memory (rlctl/engines/memory.py)."""
        import torch

        assert self.buffer is not None, "detached already"
        buffer, self.buffer = self.buffer, None
        empty = torch.empty(0, dtype=self.dtype, device=buffer.device)
        for p, _, _, _ in self.owners:
            p.data = empty
        return buffer

    def attach(self, buffer: torch.Tensor) -> None:
        """Point every parameter (tied names with it: one Parameter) at its span of `buffer`, a
        uint8 tensor of the detached one's size."""
        assert buffer.dtype.itemsize == 1 and buffer.numel() == sum(n for _, _, n, _ in self.owners)
        for p, offset, n, shape in self.owners:
            p.data = buffer[offset:offset + n].view(self.dtype).view(shape)
        self.buffer = buffer


def flatten_parameters(model) -> FlatParams | None:
    """Make every parameter of `model` a view of one new buffer (values kept); None, leaving the
    model as it is, when its parameters are not all of one dtype and device."""
    import torch

    params = list(model.named_parameters())  # a tied parameter once, under its first name
    if not params or len({(p.dtype, p.device) for _, p in params}) != 1:
        return None
    dtype, device = params[0][1].dtype, params[0][1].device
    total = sum(p.numel() * p.element_size() for _, p in params)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    spans: dict[str, tuple[int, int]] = {}
    by_tensor: dict[int, tuple[int, int]] = {}
    owners = []
    offset = 0
    with torch.no_grad():
        for name, p in params:
            n = p.numel() * p.element_size()
            view = buffer[offset:offset + n].view(dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
            spans[name] = by_tensor[id(p)] = (offset, n)
            owners.append((p, offset, n, tuple(p.shape)))
            offset += n
        for name, t in model.state_dict(keep_vars=True).items():  # tied names: the same parameter
            if name not in spans and id(t) in by_tensor:
                spans[name] = by_tensor[id(t)]
    return FlatParams(buffer, spans, dtype, owners)
