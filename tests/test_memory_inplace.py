"""Releasing tensors, on the CPU: in place (rlctl/engines/train/megatron_memory.py's InPlace), the
mechanism a Megatron trainer's pool moves use on its GPU, where every parameter, gradient and
bucket is a view of a few buffers that must stay the same tensor objects; and a Stash
(rlctl/engines/memory.py), the bytes a released part keeps in host memory or a private file."""

from __future__ import annotations

import os

import pytest
import torch

from rlctl.engines.memory import PrivateDir, Stash
from rlctl.engines.train.megatron_memory import InPlace
from rlctl.errors import RunError


def test_tensors_released_in_place_come_back_bit_for_bit_with_their_views(tmp_path):
    torch.manual_seed(0)
    params = torch.randn(1000, dtype=torch.bfloat16)
    grads = torch.randn(1000, dtype=torch.float32)
    views = [params[:600].view(20, 30), params[600:], grads[100:200]]  # what a DDP buffer hands out
    same_storage = grads[:10]  # a second tensor over a storage already listed: moved once
    before = [v.clone() for v in views]
    part = InPlace(lambda: [params, grads, same_storage], "weights")
    assert part.nbytes() == 1000 * 2 + 1000 * 4

    moved = part.release(PrivateDir(str(tmp_path)))
    assert moved == 6000 and part.nbytes() == 6000
    assert params.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0  # the memory is gone

    assert part.resume() == 6000 and part.resume() == 0  # a second resume moves nothing
    assert params.untyped_storage().nbytes() == 2000 and grads.untyped_storage().nbytes() == 4000
    for v, b in zip(views, before, strict=True):  # the same view objects see the same bytes
        assert torch.equal(v, b)
    views[0].add_(1)  # still views: a write through one is seen through the buffer
    assert torch.equal(params[:600].view(20, 30), before[0] + 1)


def test_a_stash_gives_back_every_byte_from_host_memory_or_a_file(tmp_path):
    """Both ways out: host memory (a GPU's bytes go there; forced here on CPU tensors) and a
    private file; item sizes 1 to 8, a 0-d and an empty tensor, none aligned to the next."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g).bfloat16(), torch.tensor(3.5), torch.arange(5, dtype=torch.int8),
               torch.randn(2, 3, generator=g).double(), torch.empty(0), torch.tensor([True, False, True])]
    where = PrivateDir(str(tmp_path))
    for to_file in (False, True):
        stash = Stash.take(tensors, where, "t", to_file=to_file)
        assert (stash.path is not None, stash.nbytes) == (to_file, 30 + 4 + 5 + 48 + 0 + 3)
        for a, b in zip(tensors, stash.restore(), strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    # The host buffer is kept for the next release of the name: reused when large enough, else replaced.
    buffer = where.host["t"].data_ptr()
    for scale, same in ((2.0, True), (None, False)):
        again = [t * scale if t.is_floating_point() else t for t in tensors] if scale else [*tensors, torch.ones(7)]
        stash = Stash.take(again, where, "t", to_file=False)
        assert (stash.host.data_ptr() == buffer) is same
        for a, b in zip(again, stash.restore(), strict=True):
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    stash = Stash.take(tensors, where, "t", to_file=True)
    os.truncate(stash.path, stash.nbytes - 1)
    with pytest.raises(RunError, match="ends after 2 of 3 bytes"):
        stash.restore()
    assert stash.path.exists()  # kept: nothing is lost by a failed restore
    where.cleanup()
    assert list(tmp_path.iterdir()) == []
