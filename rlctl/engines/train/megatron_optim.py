"""Megatron's DistributedDataParallel and distributed optimizer as rlctl's Megatron trainer and
critic use them: gradients reduced once per optimizer step (a train batch may arrive in several
accumulate() calls), and a step with a non-finite gradient anywhere skipped on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlctl.recipe import TrainConfig

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

def wrap_for_training(model, config: TransformerConfig, cfg: TrainConfig, dtype: torch.dtype, lr: float):
    """(Megatron's DDP around `model`, its distributed optimizer) with `config`'s hooks set so that
    gradients are reduced once per optimizer step, in optimizer_step(), not at the end of every
    forward-backward call: a train batch may arrive in several accumulate() calls."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False), module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=cfg.weight_decay, bf16=dtype == torch.bfloat16,
                        params_dtype=dtype, use_distributed_optimizer=True, clip_grad=cfg.grad_clip,
                        adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8),
        [ddp])
    config.finalize_model_grads_func = None
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer


def optimizer_step(model, ddp, optimizer, scale: float) -> tuple[bool, float]:
    """Reduce the accumulated gradients over DP ranks (Megatron's finalize: reduce-scatter for the
    distributed optimizer, scaled by 1/dp), multiply them by `scale` and take the step; returns
    (whether the weights were updated, the gradient norm). A step whose gradients are not finite on
    some rank is skipped on every rank: without loss scaling (bf16, fp32) Megatron would apply it."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp])
    ddp.scale_gradients(scale)
    ok, norm = False, float("nan")
    if _all_finite(p.main_grad for p in model.parameters() if getattr(p, "main_grad", None) is not None):
        ok, grad_norm, _ = optimizer.step()
        norm = float(grad_norm or 0.0)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    return bool(ok), norm


def _all_finite(tensors, group=None) -> bool:
    """Whether every tensor is finite on every rank of `group` (one all-reduce)."""
    bad = torch.zeros(1, device="cuda")
    for t in tensors:
        bad += (~torch.isfinite(t)).any()
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return not bool(bad.item())
