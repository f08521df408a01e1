"""Prompt sources: where each group's prompt and reference answer come from."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.errors import RunError
from rlctl.recipe import DataConfig, DataSource


@dataclass(frozen=True)
class Prompt:
    index: int
    """Position in the stream of prompts (0, 1, 2, ...); stable for a given seed."""
    text: str
    answer: str


def prompt_stream(cfg: DataConfig, seed: int) -> PromptStream:
    """An endless, seeded stream of prompts: a built-in task, or a JSONL file reshuffled each epoch."""
    return PromptStream(cfg, seed)


class PromptStream:
    """The prompts of a run in a fixed order, with a cursor that a checkpoint saves.

    `state()` is where the stream is: the next prompt's index and the RNG state at the start of
    the current epoch (JSONL) or now (task); `restore(state)` continues exactly there, so a
    resumed run draws the prompts the uninterrupted run would have drawn next."""

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        self.rng = random.Random(seed)
        self.position = 0
        """Prompts handed out so far: the index of the next one."""
        self.task = None
        self.rows: list[tuple[str, str]] = []
        if cfg.source is DataSource.TASK:
            from rlctl.rewards.tasks import TASKS

            self.task = TASKS[cfg.task]
        else:
            self.rows = read_jsonl_prompts(Path(cfg.path or ""), cfg.prompt_key, cfg.answer_key)
        self._epoch_rng: Any = None
        self._order: list[int] = []

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> Prompt:
        index = self.position
        self.position += 1
        if self.task is not None:
            return Prompt(index, *self.task.sample(self.rng))
        offset = index % len(self.rows)
        if offset == 0:
            self._new_epoch()
        return Prompt(index, *self.rows[self._order[offset]])

    def _new_epoch(self) -> None:
        self._epoch_rng = self.rng.getstate()
        self._order = list(range(len(self.rows)))
        self.rng.shuffle(self._order)

    def state(self) -> dict[str, Any]:
        """JSON: the cursor (next index) and the RNG state to continue from."""
        mid_epoch = self.task is None and self.position % len(self.rows)
        rng = self._epoch_rng if mid_epoch else self.rng.getstate()
        return {"position": self.position, "rng": rng_to_json(rng)}

    def restore(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.rng.setstate(rng_from_json(state["rng"]))
        if self.task is None and self.position % len(self.rows):
            self._new_epoch()  # the epoch the cursor is in: the same shuffle from the same state


def rng_to_json(state: Any) -> list[Any]:
    """A random.Random state as JSON (and back: rng_from_json)."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_from_json(data: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)


def read_jsonl_prompts(path: Path, prompt_key: str, answer_key: str) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append((str(row[prompt_key]), str(row[answer_key])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise RunError(
                    f"{path}:{lineno}: not a JSON object with '{prompt_key}' and '{answer_key}' ({e}); fix the row or data.prompt_key/answer_key"
                ) from None
    if not rows:
        raise RunError(f"{path}: no prompts in the file; data.source=jsonl needs at least one row")
    return rows
