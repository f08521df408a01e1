"""PPO's critic on the Megatron trainer: the policy's transformer again, with a value head.

The critic is a Megatron GPTModel built from the same HF config and loaded from the same HF
weights, without its output layer (post_process=False returns the decoder's hidden states, [S, B,
H], before the final norm), followed by the HF model's final RMSNorm and a zero-initialized linear
head giving one value per position; the torch engine's critic (rlctl/engines/train/critic.py) is
the same network. It is sharded over the policy's TP group like the policy, wrapped in its own
Megatron DDP with its own distributed optimizer (algo.critic_lr), reduced over the DP ranks once
per optimizer step, and checkpointed through dist_checkpointing next to the policy
(trainer/megatron-critic). Its values at the samples' weight versions (PPO's old values) come
from behaviour copies held in a second, frozen critic (rlctl/engines/train/behaviour.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from rlctl.engines.train.behaviour import Behaviour
from rlctl.engines.train.megatron_optim import optimizer_step, wrap_for_training


def _value_model_class():
    """MegatronValueModel, defined once megatron-core is importable (a MegatronModule, so that
    dist_checkpointing shards the backbone and replicates the norm and head)."""
    from megatron.core.transformer.module import MegatronModule

    class MegatronValueModel(MegatronModule):
        def __init__(self, config, backbone, norm_weight: torch.Tensor, eps: float) -> None:
            super().__init__(config)
            self.backbone = backbone
            self.norm_weight = torch.nn.Parameter(norm_weight.detach().float().clone().cuda())
            self.eps = eps
            self.head = torch.nn.Linear(norm_weight.numel(), 1).cuda()
            torch.nn.init.zeros_(self.head.weight)
            torch.nn.init.zeros_(self.head.bias)

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                    attention_mask=None) -> torch.Tensor:
            """Values [B, T-1]: position t scores the state before token t+1."""
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            hidden = self.backbone(input_ids, position_ids, attention_mask).transpose(0, 1)[:, :-1].float()
            hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.head(self.norm_weight * hidden).squeeze(-1)

    return MegatronValueModel


class MegatronCritic:
    def __init__(self, engine: Any, hf_cfg: Any, hf_state: dict[str, torch.Tensor], lr: float, keep: int) -> None:
        self.engine = engine
        self.config = copy.copy(engine.tconfig)  # its own no_sync and grad-scale hooks
        cls = _value_model_class()

        def build():
            backbone = engine._build_model(hf_cfg, post_process=False)
            engine._load_hf(backbone, hf_state, backbone_only=True)
            return cls(self.config, backbone, hf_state["model.norm.weight"], hf_cfg.rms_norm_eps)

        self.model = build()
        self.ddp, self.optimizer = wrap_for_training(self.model, self.config, engine.cfg, engine.dtype, lr)
        self.behaviour = Behaviour(self.model, keep, "critic", shadow=build().eval().requires_grad_(False))
        self.ddp.zero_grad_buffer()

    def values(self, ids: torch.Tensor) -> torch.Tensor:
        """Values [B, T-1] with gradients, through the critic's DDP."""
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.ddp(ids, positions, None)

    def step(self, normalizer: float) -> float:
        """The critic's optimizer step (skipped, like the policy's, when a gradient is not finite);
        returns the gradient norm."""
        return optimizer_step(self.model, self.ddp, self.optimizer, self.engine.dp_size / normalizer)[1]
