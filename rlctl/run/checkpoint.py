"""Checkpoints of a run, and what a resume does to the run directory.

    runs/<id>/checkpoints/
      step-000004/            the state after 4 steps (steps 0..3); a resume continues at step 4
        hf/                   the policy as a Hugging Face model directory (config.json,
                              *.safetensors, tokenizer files): `rlctl export` copies it
        trainer/              engine.json (weight version), optimizer state (torch: optimizer.pt;
                              Megatron: megatron/, dist_checkpointing), rng-rank-R.json per rank
        controller.json       steps done, weight version, the prompt cursor and the scheduler's
                              RNG states, the groups left unfinished, the run clock at the save
        manifest.json         every other file's size and sha256 (rlctl/run/manifest.py)
      .tmp-step-000006-PID/   a checkpoint being written: never listed, never loaded
      .tmp-final-PID/         the final policy being written
    runs/<id>/final/          a completed run's policy at its end (run.save_final), when no
      hf/                     checkpoint was written after its last step: hf/ as above, final.json
                              (steps, weight version) and manifest.json; `rlctl export` takes it

A checkpoint is written into a temporary directory inside checkpoints/ (the trainer writes hf/
and trainer/, the controller controller.json and the manifest), every file and directory is
fsynced, and then it is renamed to step-NNNNNN: a checkpoint is visible complete or not at all.
Old ones beyond run.keep_checkpoints are renamed out of sight before they are deleted. The
trainer writes only into such a temporary directory of its own run and loads only from a
step-NNNNNN of it (confined_checkpoint_dir), whatever path its routes are given.

Nothing here imports torch: `rlctl status` lists checkpoints through this module.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlctl.run.manifest import check_manifest, write_manifest
from rlctl.errors import RunError, UsageError
from rlctl.run.dir import RunDir, now_iso, read_jsonl, write_atomic

CHECKPOINTS = "checkpoints"
CONTROLLER_FILE = "controller.json"
HF_DIR = "hf"
_NAME = re.compile(r"^step-(\d{6,})$")
_TMP_NAME = re.compile(r"^\.tmp-step-\d{6,}-\d+$")
_TMP_FINAL = re.compile(r"^\.tmp-final-\d+$")
FINAL = "final"
FINAL_FILE = "final.json"
SLURM_ATTEMPT_KEYS = ("job_id", "restart_count", "trainer_nodes", "rollout_nodes")
"""What an attempt's record keeps of run.json's `slurm` (the job, where it ran)."""
PREEMPTED_EXIT = 75
"""The controller's exit code after it checkpointed and stopped on request (SIGUSR1): the run is
not over, its job requeues itself (EX_TEMPFAIL: try again later)."""


class Preempted(Exception):
    """The controller wrote a checkpoint after `steps` steps and stopped, as asked."""

    def __init__(self, steps: int, path: str) -> None:
        super().__init__(f"stopped after a checkpoint at step {steps} ({path}), as asked (SIGUSR1)")
        self.steps, self.path = steps, path


def checkpoint_name(steps: int) -> str:
    return f"step-{steps:06d}"


@dataclass(frozen=True)
class Checkpoint:
    steps: int
    """Steps done: the run continues at this step index."""
    path: Path

    @property
    def hf(self) -> Path:
        return self.path / HF_DIR

    @property
    def is_final(self) -> bool:
        """The final policy (RUN/final/: hf/ alone), not a checkpoint a run can resume from."""
        return self.path.name == FINAL

    def controller_state(self) -> dict[str, Any]:
        return json.loads((self.path / CONTROLLER_FILE).read_text())

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    def saved_at(self) -> float:
        """When it was completed (the controller's file is written last)."""
        return (self.path / (FINAL_FILE if self.is_final else CONTROLLER_FILE)).stat().st_mtime

    def describe(self) -> dict[str, Any]:
        """One row of `rlctl status RUN`."""
        return {"step": self.steps, "path": str(self.path), "bytes": self.size_bytes(),
                "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.saved_at()))}


def list_checkpoints(run_path: Path) -> list[Checkpoint]:
    """The run's complete checkpoints, oldest first."""
    root = run_path / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _NAME.match(d.name)
        if m and (d / CONTROLLER_FILE).is_file():
            found.append(Checkpoint(int(m.group(1)), d))
    return sorted(found, key=lambda c: c.steps)


def final_policy(run_path: Path) -> Checkpoint | None:
    """The run's final policy (RUN/final/), if a completed run wrote one."""
    path = run_path / FINAL
    try:
        return Checkpoint(int(json.loads((path / FINAL_FILE).read_text())["steps"]), path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_checkpoint(run_path: Path, steps: int | None = None) -> Checkpoint:
    """The checkpoint or final policy after `steps` steps, or the newest of them (the final policy
    when it is as new as the newest checkpoint); a usage error naming what there is."""
    final = final_policy(run_path)
    found = sorted([*list_checkpoints(run_path), *([final] if final else [])], key=lambda c: (c.steps, c.is_final))
    if not found:
        raise UsageError(f"run {run_path.name} has no checkpoint and no final policy; a run that completes writes "
                         "its final policy (run.save_final), and run.save_every N a checkpoint every N steps")
    if steps is None:
        return found[-1]
    for c in found:
        if c.steps == steps:
            return c
    raise UsageError(f"run {run_path.name} has no checkpoint at step {steps}; it has "
                     f"{', '.join(str(c.steps) for c in found)}")


class CheckpointPathRefused(RunError):
    """A checkpoint path outside the run's own checkpoints/ (the trainer service answers 403)."""


def confined_checkpoint_dir(run_path: Path, path: str, purpose: str) -> Path:
    """`path`, with symbolic links and `..` resolved, if it is where the trainer may write a
    checkpoint (purpose "save": RUN/checkpoints/.tmp-step-NNNNNN-PID, the temporary directory
    save_checkpoint renames into place), the final policy ("policy": RUN/checkpoints/.tmp-final-PID,
    which save_final_policy renames to RUN/final) or read one ("load": RUN/checkpoints/step-NNNNNN);
    otherwise CheckpointPathRefused naming the path and the rule. The path the engine is then
    given is the resolved one, so it cannot be redirected by the link it came through."""
    pattern, what = {"save": (_TMP_NAME, ".tmp-step-NNNNNN-PID"), "policy": (_TMP_FINAL, ".tmp-final-PID"),
                     "load": (_NAME, "step-NNNNNN")}[purpose]
    root = (Path(run_path) / CHECKPOINTS).resolve()
    rule = (f"the trainer {'writes' if purpose == 'save' else 'reads'} checkpoints only in {root}/{what} "
            "(symbolic links and .. resolved)")
    if not os.path.isabs(path):
        raise CheckpointPathRefused(f"{path!r}: not an absolute path; {rule}")
    target = Path(os.path.realpath(path))
    if target.parent != root or not pattern.match(target.name):
        shown = f"{path} (that is {target})" if str(target) != os.path.normpath(path) else path
        raise CheckpointPathRefused(f"{shown}: refused; {rule}")
    return target


def should_save(steps_done: int, save_every: int, total_steps: int) -> bool:
    """After every save_every steps, and after the last step (save_every 0: never)."""
    return save_every > 0 and (steps_done % save_every == 0 or steps_done == total_steps)


# -- writing ---------------------------------------------------------------------------------


class TrainerCheckpoints(Protocol):
    async def save_checkpoint(self, path: str) -> dict[str, Any]: ...

    async def save_policy(self, path: str) -> dict[str, Any]: ...


def fsync_tree(path: Path) -> None:
    """Every file and directory under path (and path) on disk."""
    for d, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(d))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def save_checkpoint(run_path: Path, steps: int, trainer: TrainerCheckpoints, controller_state: dict[str, Any],
                          keep: int) -> dict[str, Any]:
    """Write the checkpoint after `steps` steps: the trainer's part, then the controller's, then
    fsync and rename into place; then drop the oldest beyond `keep` (0: keep all)."""
    start = time.monotonic()
    root = run_path / CHECKPOINTS
    root.mkdir(exist_ok=True)
    final = root / checkpoint_name(steps)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    await trainer.save_checkpoint(str(tmp.resolve()))
    (tmp / CONTROLLER_FILE).write_text(json.dumps({"steps": steps, **controller_state}) + "\n")
    await asyncio.to_thread(write_manifest, tmp)  # reads every file once: seconds for GBs, off the event loop
    fsync_tree(tmp)
    if final.exists():  # written before by an attempt that then failed: the new one replaces it
        _discard(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    removed = prune(run_path, keep)
    size = Checkpoint(steps, final).size_bytes()
    return {"path": str(final), "bytes": size, "seconds": time.monotonic() - start, "removed": removed}


async def save_final_policy(run_path: Path, steps: int, version: int, trainer: TrainerCheckpoints) -> dict[str, Any]:
    """Write the policy at a completed run's end as RUN/final/ (hf/, final.json, manifest.json),
    through a temporary directory in checkpoints/ renamed into place, as a checkpoint is."""
    start = time.monotonic()
    root = run_path / CHECKPOINTS
    root.mkdir(exist_ok=True)
    tmp = root / f".tmp-final-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    await trainer.save_policy(str(tmp.resolve()))
    (tmp / FINAL_FILE).write_text(json.dumps({"steps": steps, "version": version}) + "\n")
    await asyncio.to_thread(write_manifest, tmp)
    fsync_tree(tmp)
    final = run_path / FINAL
    if final.exists():  # a resumed run that completes again: its newer end replaces the old
        _discard(final)
    os.rename(tmp, final)
    _fsync_dir(run_path)
    return {"path": str(final), "bytes": Checkpoint(steps, final).size_bytes(), "seconds": time.monotonic() - start}


def _discard(path: Path) -> None:
    """Out of sight first (one rename), then deleted."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune(run_path: Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` checkpoints (0: keep all); the steps deleted."""
    found = list_checkpoints(run_path)
    old = found[:-keep] if keep > 0 else []
    for c in old:
        _discard(c.path)
    return [c.steps for c in old]


def remove_leftovers(run_path: Path) -> None:
    """Temporary and half-deleted checkpoint directories of processes that died."""
    root = run_path / CHECKPOINTS
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(d, ignore_errors=True)


# -- resuming --------------------------------------------------------------------------------


def keep_lines(path: Path, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite a JSONL file atomically with the records `keep` accepts; how many were removed."""
    records = read_jsonl(path)
    kept = [r for r in records if keep(r)]
    write_atomic(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept))
    return len(records) - len(kept)


def prepare_resume(rd: RunDir, ckpt: Checkpoint | None) -> dict[str, Any]:
    """Make the run directory continue from `ckpt` (None: start over, as a Slurm job requeued
    before its first checkpoint does): metrics of the steps after it removed, the pipeline's
    events after it (those that carry a step) removed, run.json reopened with the new attempt and
    the checkpoint to start from. Returns the attempt's record. A checkpoint that does not match
    its manifest is refused before anything is changed."""
    if ckpt is not None:
        check_manifest(ckpt.path)
    remove_leftovers(rd.path)
    steps = ckpt.steps if ckpt else 0
    metrics_removed = keep_lines(rd.metrics_path, lambda m: m.get("step", -1) < steps)
    if rd.eval_path.exists():  # an evaluation after the checkpoint's last step is run again
        keep_lines(rd.eval_path, lambda m: m.get("steps", -1) <= steps)
    t_cut = float(ckpt.controller_state()["t"]) if ckpt else float("-inf")
    events_removed = keep_lines(rd.events_path, lambda e: "step" not in e or e.get("t", 0.0) <= t_cut)
    attempt: dict[str, Any] = {}

    def reopen(d: dict[str, Any]) -> None:
        attempts = d.setdefault("attempts", [])
        if not attempts:
            attempts.append({"attempt": 1, "resumed_from": None, "started": d["created"]})
        attempts[-1].update(attempt_ending(d), processes=d.get("processes", {}))
        d.pop("attempt_end", None)
        attempt.update(attempt=len(attempts) + 1, resumed_from=ckpt.steps if ckpt else None,
                       checkpoint=str(ckpt.path) if ckpt else None, started=now_iso())
        attempts.append(dict(attempt))
        d.update(state="starting", ended=None, exit_reason=None, processes={},
                 resume={"checkpoint": str(ckpt.path.resolve()), "steps": ckpt.steps, "attempt": attempt["attempt"]}
                 if ckpt else None)

    rd.update(reopen)
    rd.event("resume", attempt=attempt["attempt"], from_step=steps, checkpoint=str(ckpt.path) if ckpt else None,
             metrics_removed=metrics_removed, events_removed=events_removed)
    return attempt


def attempt_ending(info: dict[str, Any]) -> dict[str, Any]:
    """How the run's latest attempt ended, as its `attempts` record keeps it (ended, state,
    exit_reason, and its Slurm job): from run.json's `attempt_end` when there is one (a Slurm job
    requeued or submitted again, whose next attempt has not begun), else the run's own end."""
    ended = info.get("attempt_end") if isinstance(info.get("attempt_end"), dict) else {}
    out = {"ended": ended.get("at", info.get("ended")), "state": ended.get("state", info.get("state")),
           "exit_reason": ended.get("reason", info.get("exit_reason"))}
    slurm = ended.get("slurm") if isinstance(ended.get("slurm"), dict) else info.get("slurm") or {}
    if slurm.get("job_id"):
        out["slurm"] = {k: slurm.get(k) for k in SLURM_ATTEMPT_KEYS}
    return out


def resume_point(info: dict[str, Any]) -> Checkpoint | None:
    """The checkpoint this attempt starts from (run.json's `resume`), if it is a resumed one."""
    resume = info.get("resume")
    if not resume:
        return None
    ckpt = Checkpoint(int(resume["steps"]), Path(resume["checkpoint"]))
    if not (ckpt.path / CONTROLLER_FILE).is_file():
        raise RunError(f"{ckpt.path}: the checkpoint to resume from is gone")
    return ckpt
