"""Gradients of a data-parallel torch trainer: one all-reduce per optimizer step."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def average_gradients(params: list[torch.nn.Parameter], world_size: int, divisor: float) -> None:
    """Sum every gradient over the ranks in one flat all-reduce, then divide by `divisor` (the
    train batch's loss normalizer): the summed losses become the batch's mean."""
    if world_size > 1:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
    for p in params:
        if p.grad is not None:
            p.grad.div_(divisor)


def optimizer_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int, divisor: float,
                   grad_clip: float) -> tuple[bool, float]:
    """Average the module's gradients (average_gradients), clip their norm and step; returns
    (whether the step was taken, the norm before clipping). A non-finite norm (a NaN reward, an
    overflow) skips the step, the same on every rank since the gradients were all-reduced."""
    params = list(module.parameters())
    average_gradients(params, world_size, divisor)
    norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    ok = math.isfinite(norm)
    if ok:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return ok, norm
