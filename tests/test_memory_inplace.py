"""Releasing tensors in place (rlctl/engines/train/megatron_memory.py's InPlace), on the CPU: the
mechanism a Megatron trainer's pool moves use on its GPU, where every parameter, gradient and
bucket is a view of a few buffers that must stay the same tensor objects."""

from __future__ import annotations

import torch

from rlctl.engines.memory import PrivateDir
from rlctl.engines.train.megatron_memory import InPlace


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
