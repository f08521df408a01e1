"""The stream of a run's prompts: a built-in task drawn at random, or a file's rows in an order
reshuffled each epoch, both seeded, with a cursor that a checkpoint saves."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlctl.data.prompts import Prompt, file_prompts
from rlctl.data.rows import DataError, read_rows
from rlctl.recipe import DataConfig, DataSource


def read_prompts(cfg: DataConfig) -> list[Prompt]:
    """Every prompt of data.path (source=file); DataError naming the row on a malformed one."""
    return read_file_prompts(cfg.path or "", cfg.prompt_key, cfg.answer_key)


def read_file_prompts(path: str, prompt_key: str, answer_key: str) -> list[Prompt]:
    """Every prompt of a dataset file (a run's data, an eval set)."""
    where = Path(path).expanduser()
    return file_prompts(where, read_rows(where), prompt_key, answer_key)


def prompt_stream(cfg: DataConfig, seed: int, prompt_tokens: Callable[[Prompt], int] | None = None) -> PromptStream:
    """An endless, seeded stream of prompts: a built-in task, or a file's rows reshuffled each
    epoch. prompt_tokens: a prompt's length in tokens as the servers get it, for
    data.max_prompt_tokens (not given: no row is left out)."""
    return PromptStream(cfg, seed, prompt_tokens)


class PromptStream:
    """The prompts of a run in a fixed order, with a cursor that a checkpoint saves.

    `state()` is where the stream is: the next prompt's index and the RNG state at the start of
    the current epoch (a file) or now (task); `restore(state)` continues exactly there, so a
    resumed run draws the prompts the uninterrupted run would have drawn next."""

    def __init__(self, cfg: DataConfig, seed: int, prompt_tokens: Callable[[Prompt], int] | None = None) -> None:
        self.rng = random.Random(seed)
        self.position = 0
        """Prompts handed out so far: the index of the next one."""
        self.task = None
        self.rows: list[Prompt] = []
        self.left_out = 0
        """Rows longer than data.max_prompt_tokens, left out."""
        if cfg.source is DataSource.TASK:
            from rlctl.rewards.tasks import TASKS

            self.task = TASKS[cfg.task]
        else:
            self.rows = read_prompts(cfg)
            if cfg.max_prompt_tokens is not None and prompt_tokens is not None:
                total = len(self.rows)
                self.rows = [p for p in self.rows if prompt_tokens(p) <= cfg.max_prompt_tokens]
                self.left_out = total - len(self.rows)
                if not self.rows:
                    raise DataError(f"{cfg.path}: every one of its {total} prompts is longer than "
                                    f"data.max_prompt_tokens={cfg.max_prompt_tokens}; raise it")
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
        return replace(self.rows[self._order[offset]], index=index)

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
