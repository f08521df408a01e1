"""What the three pipeline modes share: training one batch and broadcasting weights, with events."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any

from rlctl.data import rng_from_json, rng_to_json
from rlctl.pipelines.core import GroupProducer
from rlctl.pipelines.groups import Group, Shaping
from rlctl.pipelines.interfaces import Clock, Evaluate, EventSink, Trainer


class Pipeline:
    def __init__(self, producer: GroupProducer, trainer: Trainer, *, batch_size: int, groups_per_batch: int,
                 clock: Clock, emit: EventSink, on_step_end: Callable[[int], None] = lambda step: None,
                 over_provision: float = 0.0) -> None:
        self.producer = producer
        self.over_provision = over_provision
        self.trainer = trainer
        self.batch_size = batch_size
        self.groups_per_batch = groups_per_batch
        self.clock = clock
        self.emit = emit
        self.on_step_end = on_step_end
        self.version = 0
        """The trainer's weight version: optimizer steps taken."""
        self.batches = 0
        self.rngs: dict[str, random.Random] = {}
        """The scheduler's own random generators (response lengths), kept by a checkpoint."""
        self.after_step: Callable[[int], Awaitable[None]] | None = None
        """Awaited after each step's end (the controller saves checkpoints there)."""
        self.shaping = Shaping()
        """How groups become the trainer's rows (advantage normalization, overlong handling)."""
        self.evaluate: Evaluate | None = None
        """The held-out evaluations (eval section), run where the servers hold one weight version:
        before the first step of a fresh run and between steps (evaluate_between)."""
        self.steps = 0
        """The run's number of steps (run()'s)."""

    async def run(self, steps: int, start: int = 0) -> None:
        """Steps start .. steps-1 (a resumed run starts after its checkpoint's last step)."""
        self.steps = steps
        if start == 0 and self.eval_due(0):  # the starting weights, before any group is opened
            await self.evaluate(0, self.version)  # type: ignore[misc]
        for step in range(start, steps):
            self.emit("step_start", self.clock.now(), step=step, version=self.version)
            await self.step(step)
            self.emit("step_end", self.clock.now(), step=step, version=self.version)
            self.on_step_end(step)
            await self.evaluate_between(step)
            if self.after_step is not None:  # the checkpoint after the evaluation: a resume redoes neither
                await self.after_step(step)

    def eval_due(self, steps_done: int) -> bool:
        return self.evaluate is not None and self.evaluate.due(steps_done, self.steps)

    async def evaluate_between(self, step: int) -> None:
        """After `step`'s end, its weights broadcast: sync and rolloutpipe open no group before the
        next step, so the servers hold that one version and nothing else runs on them."""
        if self.eval_due(step + 1):
            await self.evaluate(step + 1, self.version)  # type: ignore[misc]

    def state(self) -> dict[str, Any]:
        """The scheduler's part of a checkpoint, taken at a step's end (JSON): weight version, train
        batches, next group id, the prompt cursor, the RNG states, and the groups still unfinished
        (async: in flight or waiting), which the checkpoint does not keep."""
        p = self.producer
        prompts = p.prompts.state() if hasattr(p.prompts, "state") else None
        return {"version": self.version, "batches": self.batches, "next_group": p.next_group, "prompts": prompts,
                "rngs": {k: rng_to_json(r.getstate()) for k, r in self.rngs.items()},
                "unfinished": [{"group": g.id, "step": g.step} for g in p.unfinished()]}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state(); its unfinished groups are gone (the caller records them)."""
        self.version, self.batches = int(state["version"]), int(state["batches"])
        self.producer.next_group = int(state["next_group"])
        if state.get("prompts") is not None:
            self.producer.prompts.restore(state["prompts"])  # type: ignore[attr-defined]
        for name, rng in state.get("rngs", {}).items():
            if name in self.rngs:
                self.rngs[name].setstate(rng_from_json(rng))

    async def step(self, step: int) -> None:
        raise NotImplementedError

    async def train(self, step: int, groups: list[Group], last_piece: list[Group] | None = None) -> None:
        """One optimizer step on `groups`. The trainer is sent all of them, or only `last_piece`
        when train_streamed() has already accumulated the rest there. train_start/train_end
        bracket this call and list every group of the batch."""
        samples = [row for g in groups for row in g.train_samples(self.shaping)]
        sent = samples if last_piece is None else [row for g in last_piece for row in g.train_samples(self.shaping)]
        batch = self.batches
        self.batches += 1
        filtered = sum(len(g.samples) for g in groups) - len(samples)
        self.emit("train_start", self.clock.now(), step=step, batch=batch, groups=[g.id for g in groups],
                  versions=sorted({s["weight_version"] for s in samples}), **({"filtered": filtered} if filtered else {}),
                  staleness=[self.version - s["weight_version"] for s in samples])
        stats = await self.trainer.train(sent)
        self.version = int(stats["version"])
        self.emit("train_end", self.clock.now(), step=step, batch=batch, groups=[g.id for g in groups],
                  **{k: v for k, v in stats.items() if k != "version"}, version=self.version)

    async def train_streamed(self, step: int) -> None:
        """One train batch built as its groups complete: whenever the trainer is free, every group
        that is ready goes to it at once (forward and backward, gradients accumulated), and the
        call that completes `groups_per_batch` groups takes the optimizer step. The trainer so
        starts on the first complete group instead of waiting for a whole train batch; the step
        itself is the one train() takes on the whole batch. Each earlier piece is recorded as
        accumulate_start/accumulate_end (metrics count them as training time)."""
        groups: list[Group] = []
        while True:
            piece = [await self.producer.get()]
            piece += self.producer.take_ready(self.groups_per_batch - len(groups) - 1)
            groups += piece
            if len(groups) == self.groups_per_batch:
                await self.train(step, groups, last_piece=piece)
                return
            ids = [g.id for g in piece]
            self.emit("accumulate_start", self.clock.now(), step=step, batch=self.batches, groups=ids)
            stats = await self.trainer.accumulate([row for g in piece for row in g.train_samples(self.shaping)])
            self.emit("accumulate_end", self.clock.now(), step=step, batch=self.batches, groups=ids,
                      tokens=sum(s.n_tokens for g in piece for s in g.samples),
                      samples=sum(len(g.samples) for g in piece), seconds=stats.get("seconds", 0.0))

    async def sync_weights(self, step: int, pause_mode: str = "abort") -> None:
        self.emit("sync_start", self.clock.now(), step=step, version=self.version)
        stats = await self.trainer.sync_weights(self.version, pause_mode)
        self.emit("sync_end", self.clock.now(), step=step, version=self.version,
                  bytes=stats.get("bytes", 0), seconds=stats.get("seconds", 0.0))
