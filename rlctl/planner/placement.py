"""A placement (where a step's work goes) and its estimate (what the planner predicts of that
step): the records the search ranks, the estimate and the schedule fill in, and the launch turns
into recipe keys. They live apart from the model that computes them so that every part of the
planner can name them without importing the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlctl.costs.memory import GIB, Breakdown
from rlctl.recipe import PipelineMode


@dataclass(frozen=True)
class Placement:
    """Where the work goes: the rollout and train GPUs (the same ones when colocated), each
    server's tensor-parallel size, the trainer's layout and micro-batch, and the pipeline mode."""

    mode: PipelineMode
    rollout_gpus: int
    rollout_tp: int
    trainer_gpus: int
    train_tp: int = 1
    train_pp: int = 1
    micro_batch_tokens: int = 8192
    colocated: bool = False

    @property
    def servers(self) -> int:
        return self.rollout_gpus // self.rollout_tp

    @property
    def train_dp(self) -> int:
        return self.trainer_gpus // (self.train_tp * self.train_pp)

    @property
    def gpus(self) -> int:
        return self.rollout_gpus if self.colocated else self.rollout_gpus + self.trainer_gpus

    def label(self) -> str:
        where = (f"colocated {self.rollout_gpus}" if self.colocated
                 else f"{self.rollout_gpus}+{self.trainer_gpus}")
        mb = f"{self.micro_batch_tokens // 1024}k" if self.micro_batch_tokens % 1024 == 0 else str(self.micro_batch_tokens)
        return (f"{self.mode} {where} srv tp{self.rollout_tp} x{self.servers} "
                f"train tp{self.train_tp} pp{self.train_pp} dp{self.train_dp} mb {mb}")

    def overrides(self, running: int) -> list[str]:
        """The recipe keys that make `rlctl simulate` (or a launch) take this placement."""
        return [f"pipeline.mode={self.mode}", f"sim.rollout_gpus={self.rollout_gpus}",
                f"sim.trainer_gpus={self.trainer_gpus}", f"sim.tp={self.rollout_tp}", f"sim.train_tp={self.train_tp}",
                f"sim.train_pp={self.train_pp}", f"sim.colocated={str(self.colocated).lower()}",
                f"train.micro_batch_tokens={self.micro_batch_tokens}", f"rollout.max_running_requests={running}"]


@dataclass
class Estimate:
    placement: Placement
    step_s: float = math.inf
    stages: dict[str, float] = field(default_factory=dict)
    """Seconds of each stage on the critical path: rollout (work), rollout tail (depth), train,
    sync; in rolloutpipe and async, the stage that is hidden counts only what it adds."""
    bound: str = ""
    trainer: Breakdown = field(default_factory=Breakdown)
    server: Breakdown = field(default_factory=Breakdown)
    running: int = 0
    """Requests each server runs at once (max_running_requests, or fewer when the KV cache is short)."""
    samples: int = 0
    unfit: str = ""
    """Why it does not fit in memory ('' when it does)."""

    @property
    def fits(self) -> bool:
        return not self.unfit

    @property
    def s_per_1k(self) -> float:
        """Wall seconds per 1,000 samples trained: what ranks placements of different modes."""
        return self.step_s / self.samples * 1000 if self.samples else math.inf

    @property
    def gpu_s_per_1k(self) -> float:
        return self.step_s * self.placement.gpus / self.samples * 1000 if self.samples else math.inf

    def peak_gib(self) -> float:
        both = self.trainer.total + self.server.total if self.placement.colocated else max(self.trainer.total,
                                                                                            self.server.total)
        return both / GIB

    def to_json(self) -> dict[str, Any]:
        p = self.placement
        return {"placement": {"mode": str(p.mode), "colocated": p.colocated, "rollout_gpus": p.rollout_gpus,
                              "rollout_tp": p.rollout_tp, "servers": p.servers, "trainer_gpus": p.trainer_gpus,
                              "train_tp": p.train_tp, "train_pp": p.train_pp, "train_dp": p.train_dp,
                              "micro_batch_tokens": p.micro_batch_tokens},
                "label": p.label(), "step_s": self.step_s, "samples_per_step": self.samples,
                "s_per_1k_samples": self.s_per_1k, "gpu_s_per_1k_samples": self.gpu_s_per_1k,
                "stages": self.stages, "bound": self.bound, "running_per_server": self.running,
                "trainer_bytes": self.trainer.parts, "server_bytes": self.server.parts, "fits": self.fits,
                "unfit": self.unfit, "overrides": p.overrides(self.running)}
