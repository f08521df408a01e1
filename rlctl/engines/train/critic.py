"""PPO's critic on the torch trainer: a value head on its own copy of the policy's network.

The critic is the policy's transformer (loaded from the same model directory, without its LM
head) with a linear head giving one value per position, zero-initialized so that the first
values are 0. Position t's value is the state that predicts token t+1: the same indexing as the
policy's log-probs, so one response mask serves both. It has its own AdamW (algo.critic_lr), its
gradients are reduced over the ranks like the policy's, and it is saved next to the policy in a
checkpoint (trainer/critic.pt). Its values at the samples' weight versions (PPO's old values)
come from behaviour copies, as the policy's old log-probs do (rlctl/engines/train/behaviour.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlctl.engines.train import ckpt_files
from rlctl.engines.train.behaviour import Behaviour
from rlctl.engines.train.torch_grads import optimizer_step


class ValueModel(torch.nn.Module):
    def __init__(self, model_path: str) -> None:
        from transformers import AutoModel

        super().__init__()
        self.backbone = AutoModel.from_pretrained(model_path, dtype=torch.float32)
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values [B, T-1]: position t scores the state before token t+1."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[:, :-1].float()).squeeze(-1)


class Critic:
    def __init__(self, model_path: str, lr: float, weight_decay: float, grad_clip: float, device: torch.device,
                 world_size: int, keep: int) -> None:
        self.model = ValueModel(model_path).to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.grad_clip, self.world_size = grad_clip, world_size
        self.behaviour = Behaviour(self.model, keep, "critic")

    def step(self, normalizer: float) -> float:
        """The critic's optimizer step on its accumulated gradients (skipped, as the policy's, when
        they are not finite); returns the gradient norm."""
        return optimizer_step(self.model, self.optimizer, self.world_size, normalizer, self.grad_clip)[1]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, root: Path) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                   ckpt_files.trainer_dir(root) / "critic.pt")

    def read(self, root: Path, device: torch.device) -> dict:
        """trainer/critic.pt, read with weights_only=True (tensors and plain containers only)."""
        return torch.load(ckpt_files.trainer_dir(root) / "critic.pt", map_location=device, weights_only=True)

    def set_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.zero_grad()
