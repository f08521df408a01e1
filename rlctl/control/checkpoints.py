"""The controller's side of checkpoints: continuing from one (a resumed attempt), one after every
run.save_every steps or when a Slurm job is about to be stopped, and a completed run's final
policy. What a checkpoint holds and how it is written whole: rlctl/run/checkpoint.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rlctl.errors import RunError
from rlctl.metrics import Recorder
from rlctl.pipelines.base import Pipeline
from rlctl.pipelines.interfaces import Clock, EventSink, RunTrainer
from rlctl.recipe import Recipe
from rlctl.run.checkpoint import Checkpoint, Preempted, save_checkpoint, save_final_policy, should_save
from rlctl.run.dir import RunDir

log = logging.getLogger("rlctl.control.checkpoints")


async def load_checkpoint(trainer: RunTrainer, ckpt: Checkpoint, emit: EventSink,
                          clock: Clock) -> dict[str, Any]:
    """The trainer continues from the checkpoint (weights, optimizer, RNG); returns the
    controller's part of it (rlctl/run/checkpoint.py)."""
    start = clock.now()
    state = ckpt.controller_state()
    loaded = await trainer.load_checkpoint(str(ckpt.path.resolve()))
    if int(loaded["version"]) != int(state["version"]):
        raise RunError(f"{ckpt.path}: the trainer's weight version is {int(loaded['version'])}, the controller's "
                       f"{state['version']}; the checkpoint is inconsistent")
    emit("checkpoint_loaded", clock.now(), start=start, steps=ckpt.steps, version=int(state["version"]),
         path=str(ckpt.path), prompts=(state.get("prompts") or {}).get("position"))
    return state


def restore_pipeline(pipeline: Pipeline, state: dict[str, Any], emit: EventSink, clock: Clock) -> None:
    """The scheduler where the checkpoint left it. Groups unfinished at the checkpoint (async:
    in flight or waiting to be trained) are not in it: they are recorded as dropped."""
    pipeline.restore(state)
    for g in state.get("unfinished", []):
        emit("group_dropped", clock.now(), step=g["step"], group=g["group"], reason="resumed")


def checkpointer(rd: RunDir, recipe: Recipe, trainer: RunTrainer, pipeline: Pipeline,
                 recorder: Recorder, clock: Clock, preempt: asyncio.Event) -> Callable[[int], Awaitable[None]]:
    """The pipeline's after_step: a checkpoint every run.save_every steps and after the last, and
    one when `preempt` is set, after which the run stops (Preempted) unless that was its last step.
    The scheduler's state is taken first, at the step's end, before anything else can move."""

    async def after_step(step: int) -> None:
        last = step + 1 == recipe.run.steps
        stopping = preempt.is_set() and not last
        if not (stopping or should_save(step + 1, recipe.run.save_every, recipe.run.steps)):
            return
        state = {"t": clock.now(), **pipeline.state()}
        stats = await save_checkpoint(rd.path, step + 1, trainer, state, recipe.run.keep_checkpoints)
        recorder.emit("checkpoint", clock.now(), steps=step + 1, version=state["version"],
                      unfinished_groups=len(state["unfinished"]), **stats)
        if stopping:
            recorder.emit("preempted", clock.now(), steps=step + 1, checkpoint=stats["path"])
        recorder.events.flush()
        if stopping:
            raise Preempted(step + 1, stats["path"])

    return after_step


async def save_final(rd: RunDir, recipe: Recipe, trainer: RunTrainer, version: int, recorder: Recorder,
                     clock: Clock) -> None:
    """run.save_final: the policy of a run that completed its steps, as RUN/final/ (an HF model
    directory with its tokenizer, what `rlctl export RUN` writes out), unless a checkpoint was
    written after the last step already (run.save_every: export takes that one)."""
    steps = recipe.run.steps
    if not steps or not recipe.run.save_final or should_save(steps, recipe.run.save_every, steps):
        return
    stats = await save_final_policy(rd.path, steps, version, trainer)
    recorder.emit("final_saved", clock.now(), steps=steps, version=version, **stats)
    recorder.events.flush()
    log.info("final policy (version %d) in %s: %.1f MiB, %.1f s", version, stats["path"], stats["bytes"] / 2**20,
             stats["seconds"])
