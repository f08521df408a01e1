"""How long one step of a placement takes: the rollout's work and depth, and what of the training
and the sync each pipeline mode leaves on the critical path (planner/estimate.py has the model
in words; every duration is the cost model's).
"""

from __future__ import annotations

from rlctl.costs.lengths import Lengths
from rlctl.planner.placement import Estimate, Placement
from rlctl.planner.tools import ToolTime
from rlctl.recipe import Admission, InflightAtUpdate, PipelineMode, Recipe
from rlctl.costs.model import CostModel

QUANTILES = 8
"""Points per train batch at which the planner places its groups' completions."""


def step_samples(recipe: Recipe, mode: PipelineMode) -> int:
    """Samples one step trains: the rollout batch, or in async the train batches between syncs."""
    ro = recipe.rollout
    if mode is PipelineMode.ASYNC:
        return recipe.train.groups_per_batch * recipe.pipeline.sync_every * ro.group_size
    return ro.batch_size * ro.group_size


class Rollout:
    """One server's share of a rollout: n requests, at most b running at once.

    One wave (n <= b): every request runs from the start; the rollout takes E[longest of all
    samples] decode steps, each at the mean batch until then, and the server with the most
    tokens (it keeps the requests it got) ends it. Several waves: the batch is full until the
    queue empties, (n E[L] - b E[R]) / b steps, then drains for E[longest of b x servers
    residuals] steps at the draining batch's mean size (costs/lengths.py). The first b requests
    stay on the server they were sent to (the busiest such server counts); later ones go to the
    server with the fewest in flight, which balances them."""

    def __init__(self, cost: CostModel, lengths: Lengths, n: float, b: int, prompt: int, all_samples: float,
                 servers: int) -> None:
        self.cost, self.lengths, self.n, self.b = cost, lengths, n, max(1, b)
        self.one_wave = n <= self.b
        self.prefill = n * cost.prefill_seconds(prompt)
        b_eff = max(1.0, min(float(self.b), n))
        self.work = n * lengths.mean / b_eff * cost.decode_step_seconds(b_eff) + self.prefill if n > 0 else 0.0
        if n <= 0:
            self.total = self.full_s = self.full_steps = 0.0
        elif self.one_wave:
            steps = lengths.expected_max(all_samples)
            self.total = steps * cost.decode_step_seconds(lengths.busiest_tokens(n, servers) / steps) + self.prefill
            self.full_s = self.full_steps = 0.0
        else:
            # The first b requests stay where they were sent; only later ones are balanced.
            tokens = lengths.busiest_tokens(self.b, servers) + (n - self.b) * lengths.mean
            self.full_steps = max(0.0, (tokens - self.b * lengths.residual_mean) / self.b)
            self.full_s = self.prefill + self.full_steps * cost.decode_step_seconds(self.b)
            drain_steps = lengths.expected_max_residual(self.b * servers)
            self.drain_pace = cost.decode_step_seconds(max(1.0, self.b * lengths.residual_mean / drain_steps))
            self.total = max(self.full_s + drain_steps * self.drain_pace,
                             lengths.expected_max(all_samples) * cost.decode_step_seconds(1) + self.prefill)
        self.tail = max(0.0, self.total - self.work)

    def done_at(self, admitted: float, steps: float) -> float:
        """When a request admitted at `admitted` seconds and `steps` long is done."""
        if self.one_wave:
            mean_batch = self.n * self.lengths.tokens_before(steps) / max(steps, 1.0)
            return min(self.total, self.prefill + steps * self.cost.decode_step_seconds(max(1.0, mean_batch)))
        pace = self.cost.decode_step_seconds(self.b)
        if admitted + steps * pace <= self.full_s:
            return admitted + steps * pace
        left = steps - max(0.0, self.full_s - admitted) / pace
        return min(self.total, max(admitted, self.full_s) + left * self.drain_pace)


class Training:
    """What the trainer spends on one step's train batches, whole or a group at a time."""

    def __init__(self, recipe: Recipe, cost: CostModel, p: Placement, lengths: Lengths) -> None:
        ro, gpb = recipe.rollout, recipe.train.groups_per_batch
        per_sample = recipe.sim.prompt_tokens + lengths.mean
        batch_samples = gpb * ro.group_size
        self.batch = cost.train_seconds(batch_samples * per_sample, step=True, samples=batch_samples)
        """One train batch at once, with its optimizer step."""
        self.step = self.batch - cost.train_seconds(batch_samples * per_sample, step=False, samples=batch_samples)
        self.last = cost.train_seconds(ro.group_size * per_sample, step=True, samples=ro.group_size)
        """The last group of a streamed batch, and the step."""
        self.piece = lambda groups: cost.train_seconds(groups * ro.group_size * per_sample, step=False,
                                                       samples=max(1, round(groups * ro.group_size)))
        """One call of `groups` groups (forward and backward, no step)."""
        self.streamed = p.mode is not PipelineMode.SYNC and recipe.pipeline.stream_train
        self.groups_per_batch = gpb
        self.batches = ro.batch_size // gpb
        self.total = self.batches * self.batch


def arrivals(recipe: Recipe, rollout: Rollout, batches: int) -> list[float]:
    """When the step's groups complete, QUANTILES points per train batch, in order. A group ends
    with its longest response (the q-quantile of the longest of a group). In one wave every group
    starts at once; in several, admission feeds the train batches in turn while the batch is full
    (frontier admission; fifo is the same in group order)."""
    g = recipe.rollout.group_size
    points = []
    for i in range(batches):
        admitted = 0.0 if rollout.one_wave else rollout.full_s * i / batches
        for j in range(QUANTILES):
            q = (i * QUANTILES + j + 0.5) / (batches * QUANTILES) if rollout.one_wave else (j + 0.5) / QUANTILES
            points.append(rollout.done_at(admitted, rollout.lengths.quantile_max(q, g)))
    return sorted(points)


def pipelined_end(recipe: Recipe, rollout: Rollout, train: Training) -> float:
    """rolloutpipe: when the last train batch is done. Streamed, the trainer takes the groups as
    they complete: an idle trainer takes each group in a call of its own, a busy one takes what
    came meanwhile in one call (rlctl/pipelines/base.py, train_streamed); each batch's optimizer
    step follows its last group. Else a batch starts once its gpb-th group is in."""
    points = arrivals(recipe, rollout, train.batches)
    free = 0.0
    if train.streamed:
        groups = train.groups_per_batch / QUANTILES
        for k, t in enumerate(points):
            calls = groups if free <= t else 1.0
            free = max(free, t) + calls * train.piece(groups / calls)
            free += train.step if (k + 1) % QUANTILES == 0 else 0.0
        return max(free, rollout.total + train.last)
    for i in range(train.batches):
        free = max(free, points[(i + 1) * QUANTILES - 1]) + train.batch
    return free


def schedule(recipe: Recipe, cost: CostModel, p: Placement, lengths: Lengths, out: Estimate) -> None:
    """Fill out.stages (seconds on the critical path), out.step_s and out.bound."""
    ro, pipe, prompt = recipe.rollout, recipe.pipeline, recipe.sim.prompt_tokens
    # Frontier admission keeps rollout.concurrency requests in flight per server, in every mode.
    b = min(out.running, ro.concurrency) if pipe.admission in (Admission.FRONTIER, Admission.LONGEST) else out.running
    train = Training(recipe, cost, p, lengths)
    tools = ToolTime.of(recipe)
    turns = tools.turns if tools else 1.0  # every model turn is a request (rlctl/planner/tools.py)
    if tools is not None:  # a later turn prefills only the tools' results (the rest is in the prefix cache)
        prompt = round((prompt + tools.calls * tools.result_tokens) / turns)
    rollout = Rollout(cost, lengths, out.samples * turns / p.servers, b, prompt, out.samples * turns, p.servers)
    tail = rollout.tail
    if p.mode is PipelineMode.SYNC:
        out.stages = {"rollout": rollout.work, "rollout tail": tail, "train": train.total}
    elif p.mode is PipelineMode.ROLLOUTPIPE:
        exposed = max(0.0, pipelined_end(recipe, rollout, train) - rollout.total)
        out.stages = {"rollout": rollout.work, "rollout tail": tail, "train": exposed}
    else:
        # A step trains k = gpb x sync_every groups. With inflight_at_update=finish the servers
        # are drained at every sync, so a step starts empty: the groups already complete feed its
        # first train batches, and the k groups it admits run as a rollout of their own, tail
        # included, while the trainer works. With abort_resume only the decode work counts.
        if pipe.inflight_at_update is not InflightAtUpdate.FINISH:
            tail = 0.0
        trained = train.batch * pipe.sync_every
        out.stages = {"rollout": rollout.work, "rollout tail": tail,
                      "train": max(0.0, trained - rollout.work - tail)}
    if tools is not None and p.mode is not PipelineMode.ASYNC:  # async's rollout goes on while tools run
        out.stages["tools"] = ToolTime.slowest(recipe, out.samples)
    elif tools is not None:  # ... but its open groups bound it (rlctl/planner/tools.py)
        open_samples = out.samples * (pipe.max_staleness + 1)  # a server runs no more than these
        pace = cost.decode_step_seconds(max(1.0, min(b, open_samples / p.servers)))
        floor = tools.group_latency(recipe, lengths, pace) / (pipe.max_staleness + 1)
        out.stages["tools"] = max(0.0, floor - sum(out.stages.values()))
    out.stages["sync"] = cost.broadcast_seconds()
    out.step_s = sum(out.stages.values())
    out.bound = max(out.stages, key=lambda k: out.stages[k])
