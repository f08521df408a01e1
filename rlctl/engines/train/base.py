"""The train-engine contract: what the trainer service needs from torch or Megatron trainers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Iterable

if TYPE_CHECKING:
    import torch


@dataclass
class TrainSample:
    """One generated sample, as the controller sends it to the trainer."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    logprobs: list[float]
    """Per response token, from the rollout server: the behaviour policy in the PPO ratio."""
    weight_version: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainSample:
        return cls(list(d["prompt_ids"]), list(d["response_ids"]), float(d["advantage"]),
                   [float(x) for x in d["logprobs"]], int(d["weight_version"]))


class TrainEngine(Protocol):
    """One data-parallel rank of a trainer. Every rank gets every call, with the same arguments."""

    version: int
    """Weight version of the trainer's working copy: 0 at start, +1 per optimizer step."""

    def train_batch(self, samples: list[TrainSample]) -> dict[str, float]:
        """One optimizer step on one train batch (this rank uses its share of the samples)."""

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full weights with Hugging Face names, in a fixed order (meaningful on rank 0)."""
