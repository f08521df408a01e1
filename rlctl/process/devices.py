"""Which device a process of a run uses: the one rule the worker, the controller and the
adapters share, so that a colocation decided in one place is the placement made in another."""

from __future__ import annotations

import os

from rlctl.errors import RunError
from rlctl.recipe import Device


def process_device(kind: Device, index: int, gpus: list[int] | None = None) -> str:
    """cuda -> the index-th of the recipe's GPU list (round-robin), or cuda:index when that GPU
    exists, else the GPUs are shared round-robin."""
    if kind is not Device.CUDA:
        return kind.value
    if gpus:
        return f"cuda:{gpus[index % len(gpus)]}"
    import torch

    return f"cuda:{index % max(1, torch.cuda.device_count())}"


def gpu_group(gpus: list[int], tp_size: int, index: int) -> str:
    """CUDA_VISIBLE_DEVICES of local rollout server `index` of an engine that takes whole GPUs: the
    index-th group of tp_size GPUs among rollout.gpus (all of this machine's when empty), so that no
    two servers share one; the server counts its own from 0 (SGLang's --base-gpu-id 0, vLLM's
    device 0)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    if not gpus:
        import torch

        gpus = list(range(len(visible) if visible else torch.cuda.device_count()))
    mine = gpus[index * tp_size:(index + 1) * tp_size]
    if len(mine) < tp_size:
        raise RunError(f"rollout server {index} needs {tp_size} GPUs of its own, GPUs {index * tp_size}.."
                         f"{(index + 1) * tp_size - 1} of {gpus}; list more in rollout.gpus or lower rollout.servers")
    return ",".join(visible[g] if visible else str(g) for g in mine)
