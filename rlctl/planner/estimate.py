"""One placement's step, from work and depth per stage (the planner's analytic model).

Every duration comes from the recipe's cost model (costs/recipe.py, the one `rlctl simulate`
uses); what is analytic here is the schedule: how the work spreads over the GPUs and which
depth the pipeline mode leaves exposed.

Rollout, per server (n = samples / servers requests, a running batch of b):
- work: n * E[L] tokens decoded at b per step, d(b) seconds a step, plus each request's prefill;
- depth: the longest sample's decode steps. When n <= b every request runs from the start and
  the rollout takes E[longest of all samples] steps. Otherwise the batch is full until the
  queue empties and then drains: (n E[L] - b E[R]) / b full steps, then E[longest of b x servers
  residuals] steps at the draining batch's mean size (costs/lengths.py has R).
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

from dataclasses import replace

from rlctl.costs.lengths import Lengths
from rlctl.costs.memory import (
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
from rlctl.planner.placement import Estimate, Placement
from rlctl.planner.schedule import schedule, step_samples
from rlctl.engines.rollout.registry import rollout_adapter
from rlctl.recipe import Recipe
from rlctl.costs.model import CostModel


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
    expands_kv = rollout_adapter(ro.engine).expands_kv
    out.trainer = _trainer_fit(recipe, cost, p, tokens)
    hbm = cost.hardware.hbm_bytes
    if p.colocated:
        out.running, swap = colocated_budget(cost, out.trainer, ro.max_running_requests)
        cost = replace(cost, swap_bytes=swap)
        out.server = server_memory(cost, out.running, expands_kv)
        peak = out.trainer.total + out.server.parts["weights"]  # the KV cache is freed to train
        if peak > hbm * TRAINER_HEADROOM:
            out.unfit = f"training beside the servers' weights needs {peak / GIB:.0f} GiB per GPU"
    else:
        out.running = running_batch(cost, ro.max_running_requests)
        out.server = server_memory(cost, out.running, expands_kv)
        if out.trainer.total > hbm * TRAINER_HEADROOM:
            out.unfit = f"the trainer needs {out.trainer.total / GIB:.0f} GiB per GPU ({out.trainer.largest()} most)"
    if out.running < 1:
        out.unfit = out.unfit or "a server's weights leave no room for one request's KV cache"
    if out.unfit:
        return out
    schedule(recipe, cost, p, lengths, out)
    return out
