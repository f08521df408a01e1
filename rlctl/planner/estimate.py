"""One placement's step, from work and depth per stage (the planner's analytic model).

Every duration comes from the recipe's cost model (planner/costs.py, the one `rlctl simulate`
uses); what is analytic here is the schedule: how the work spreads over the GPUs and which
depth the pipeline mode leaves exposed.

Rollout, per server (n = samples / servers requests, a running batch of b):
- work: n * E[L] tokens decoded at b per step, d(b) seconds a step, plus each request's prefill;
- depth: the longest sample's decode steps. When n <= b every request runs from the start and
  the rollout takes E[longest of all samples] steps. Otherwise the batch is full until the
  queue empties and then drains: (n E[L] - b E[R]) / b full steps, then E[longest of b x servers
  residuals] steps at the draining batch's mean size (planner/lengths.py has R).
Training: the step's tokens through cost.train_seconds, in the pieces the mode sends (a train
batch at a time in sync, a group at a time when rolloutpipe or async stream them).
Sync: cost.broadcast_seconds() (colocated: a device copy, and the swapped state out and back).

Modes (the critical path):
- sync: rollout + training + sync; colocated is sync on the same GPUs.
- rolloutpipe: groups complete from the first (E[longest of a group] steps in) to the end of
  the rollout, about evenly; the trainer takes each as it comes, so the step ends at
  max(first group + all training, rollout + the last piece) + sync.
- async: the rollout never waits for its tail (samples carry over to the next step), so a step
  costs the larger of the rollout's work and the training, plus the sync that pauses both.

Known to be wrong: groups do not complete evenly (a long tail bunches them at the end); async
drops stale groups and regenerates them, work this does not count; every server gets the same
share of requests and lengths; decode steps are priced at the mean context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from rlctl.planner.lengths import Lengths
from rlctl.planner.memory import (
    GIB,
    TRAINER_HEADROOM,
    Breakdown,
    TrainLayout,
    colocated_budget,
    micro_batch_tokens,
    running_batch,
    server_memory,
    trainer_memory,
)
from rlctl.planner.schedule import schedule, step_samples
from rlctl.recipe import PipelineMode, Recipe, RolloutEngine
from rlctl.sim.cost import CostModel


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


def _trainer_fit(recipe: Recipe, cost: CostModel, p: Placement, tokens: float) -> Breakdown:
    layout = TrainLayout(p.train_tp, p.train_pp, p.train_dp, p.micro_batch_tokens)
    return trainer_memory(recipe, cost.model, layout, micro_batch_tokens(recipe, layout, tokens))


def estimate(recipe: Recipe, base: CostModel, p: Placement, lengths: Lengths | None = None) -> Estimate:
    """The step of placement `p` for `recipe`, on `base` (the recipe's cost model) re-laid."""
    lengths = lengths or Lengths.of(recipe)
    ro, sim = recipe.rollout, recipe.sim
    samples = step_samples(recipe, p.mode)
    tokens = ro.batch_size * ro.group_size * (sim.prompt_tokens + lengths.mean)
    cost = replace(base, gpus_per_server=p.rollout_tp, trainer_gpus=p.trainer_gpus, train_tp=p.train_tp,
                   train_pp=p.train_pp, micro_batch_tokens=p.micro_batch_tokens, colocated=p.colocated, swap_bytes=0.0)
    out = Estimate(p, samples=samples)
    builtin = ro.engine is RolloutEngine.BUILTIN
    out.trainer = _trainer_fit(recipe, cost, p, tokens)
    hbm = cost.hardware.hbm_bytes
    if p.colocated:
        out.running, swap = colocated_budget(cost, out.trainer, ro.max_running_requests)
        cost = replace(cost, swap_bytes=swap)
        out.server = server_memory(cost, out.running, builtin)
        peak = out.trainer.total + out.server.parts["weights"]  # the KV cache is freed to train
        if peak > hbm * TRAINER_HEADROOM:
            out.unfit = f"training beside the servers' weights needs {peak / GIB:.0f} GiB per GPU"
    else:
        out.running = running_batch(cost, ro.max_running_requests)
        out.server = server_memory(cost, out.running, builtin)
        if out.trainer.total > hbm * TRAINER_HEADROOM:
            out.unfit = f"the trainer needs {out.trainer.total / GIB:.0f} GiB per GPU ({out.trainer.largest()} most)"
    if out.running < 1:
        out.unfit = out.unfit or "a server's weights leave no room for one request's KV cache"
    if out.unfit:
        return out
    schedule(recipe, cost, p, lengths, out)
    return out
