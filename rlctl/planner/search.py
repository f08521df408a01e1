"""Every placement of a recipe on N GPUs, estimated and ranked.

The space (placements()):
- disaggregated: rollout and trainer GPUs split at whole nodes (every split when N is under two
  nodes), or colocated: all N GPUs take turns (sync mode only);
- rollout servers of tensor-parallel size 1, 2, 4 or 8 (at most a node);
- the trainer: data parallel only for the torch engine; tensor parallel 1-8 within a node for
  Megatron, and pipeline parallel 2-8 when asked for (`--pp`: rlctl's Megatron trainer runs
  pp=1 only, so those placements are a plan, not a launch);
- micro-batches of half, once and twice train.micro_batch_tokens;
- the pipeline modes sync, rolloutpipe and async, with the recipe's admission and staleness.
Placements that do not fit in memory are kept apart, with the reason; the rest are ranked by
predicted seconds per 1,000 samples (an async step trains fewer samples than a sync one), then
by GPU-seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from rlctl.engines.train.adapter import trainer_adapter
from rlctl.planner.estimate import estimate
from rlctl.costs.lengths import Lengths
from rlctl.planner.placement import Estimate, Placement
from rlctl.recipe import PipelineMode, Recipe
from rlctl.costs.model import CostModel

TPS = (1, 2, 4, 8)
PPS = (2, 4, 8)


@dataclass
class Plan:
    ranked: list[Estimate]
    """The placements that fit, fastest first."""
    unfit: list[Estimate] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time of the search."""
    considered: int = 0
    """Placements estimated (ranked keeps the best micro-batch of each layout)."""


def _splits(gpus: int, per_node: int) -> list[int]:
    """Rollout GPU counts of the disaggregated splits (the trainer gets the rest)."""
    if gpus < 2 * per_node:
        return list(range(1, gpus))
    return list(range(per_node, gpus, per_node))


def _train_layouts(recipe: Recipe, gpus: int, per_node: int, pp: bool) -> list[tuple[int, int]]:
    if trainer_adapter(recipe.train.engine).tp_key() is None:  # no tensor (or pipeline) parallelism
        return [(1, 1)]
    pps = (1, *PPS) if pp else (1,)
    return [(t, q) for t in TPS for q in pps if t <= per_node and gpus % (t * q) == 0]


def _micro_batches(recipe: Recipe) -> list[int]:
    mb = recipe.train.micro_batch_tokens
    return sorted({max(256, mb // 2), mb, mb * 2})


def placements(recipe: Recipe, gpus: int, per_node: int = 8, modes: list[PipelineMode] | None = None,
               pp: bool = False) -> Iterator[Placement]:
    modes = modes or list(PipelineMode)
    mbs = _micro_batches(recipe)
    for rollout in _splits(gpus, per_node):
        trainer = gpus - rollout
        for rtp in (t for t in TPS if t <= per_node and rollout % t == 0):
            for ttp, tpp in _train_layouts(recipe, trainer, per_node, pp):
                for mb in mbs:
                    for mode in modes:
                        yield Placement(mode, rollout, rtp, trainer, ttp, tpp, mb)
    if PipelineMode.SYNC in modes:
        for rtp in (t for t in TPS if t <= per_node and gpus % t == 0):
            for ttp, tpp in _train_layouts(recipe, gpus, per_node, pp):
                for mb in mbs:
                    yield Placement(PipelineMode.SYNC, gpus, rtp, gpus, ttp, tpp, mb, colocated=True)


def plan(recipe: Recipe, base: CostModel, gpus: int, per_node: int = 8, modes: list[PipelineMode] | None = None,
         pp: bool = False) -> Plan:
    start = time.perf_counter()
    lengths = Lengths.of(recipe)
    fit, unfit = [], []
    for p in placements(recipe, gpus, per_node, modes, pp):
        e = estimate(recipe, base, p, lengths)
        (fit if e.fits else unfit).append(e)
    fit.sort(key=lambda e: (e.s_per_1k, e.gpu_s_per_1k, e.peak_gib()))
    # Of placements that differ only in the micro-batch, the fastest stands for them all.
    best: dict[Placement, Estimate] = {}
    for e in fit:
        best.setdefault(replace(e.placement, micro_batch_tokens=0), e)
    return Plan(list(best.values()), unfit, time.perf_counter() - start, len(fit) + len(unfit))


_FIELDS = [("mode", "mode {}"), ("colocated", "colocated {}"), ("rollout_gpus", "{} rollout GPUs"),
           ("rollout_tp", "server tp {}"), ("train_tp", "train tp {}"), ("train_pp", "train pp {}"),
           ("micro_batch_tokens", "micro-batch {} tokens")]


def explain(best: Estimate, other: Estimate) -> str:
    """Why `best` beats `other`: how they differ, and the stages where the time goes."""
    a, b = best.placement, other.placement
    differs = [text.format(getattr(a, key)) for key, text in _FIELDS if getattr(a, key) != getattr(b, key)]
    stages = sorted(set(best.stages) | set(other.stages),
                    key=lambda k: -abs(best.stages.get(k, 0.0) - other.stages.get(k, 0.0)))
    moves = []
    for k in stages[:2]:
        delta = other.stages.get(k, 0.0) - best.stages.get(k, 0.0)
        if abs(delta) >= 0.0005 * max(other.step_s, 1e-9):
            moves.append(f"{k} {_seconds(abs(delta))} {'shorter' if delta > 0 else 'longer'}")
    gain = other.step_s - best.step_s
    why = f"{_seconds(gain)} ({gain / other.step_s:.1%}) faster per step" if gain > 0 else "as fast, fewer GPU-seconds"
    return (f"{why} with {', '.join(differs) or 'the same layout'}: " + ("; ".join(moves) or "no stage differs")
            + f" (bound by {best.bound} against {other.bound})")


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 0.01 else f"{s * 1000:.3g} ms"
