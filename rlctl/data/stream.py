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
from rlctl.recipe import DataConfig, DataSource, MixedSource


def read_prompts(cfg: DataConfig) -> list[Prompt]:
    """Every prompt of data.path (source=file); DataError naming the row on a malformed one."""
    return read_file_prompts(cfg.path or "", cfg.prompt_key, cfg.answer_key)


def read_file_prompts(path: str, prompt_key: str, answer_key: str) -> list[Prompt]:
    """Every prompt of a dataset file (a run's data, an eval set)."""
    where = Path(path).expanduser()
    return file_prompts(where, read_rows(where), prompt_key, answer_key)


def read_source(cfg: DataConfig, source: MixedSource) -> list[Prompt]:
    """Every prompt of one file of a mix (data.sources), each named by the source's label."""
    rows = read_file_prompts(source.path, source.prompt_key or cfg.prompt_key, source.answer_key or cfg.answer_key)
    return [replace(p, source=source.label) for p in rows]


def prompt_stream(cfg: DataConfig, seed: int,
                  prompt_tokens: Callable[[Prompt], int] | None = None) -> PromptStream | MixedStream:
    """An endless, seeded stream of prompts: a built-in task, a file's rows reshuffled each epoch,
    or several files' mixed by weight (data.sources). prompt_tokens: a prompt's length in tokens
    as the servers get it, for data.max_prompt_tokens (not given: no row is left out)."""
    if cfg.sources:
        return MixedStream(cfg, seed, prompt_tokens)
    return PromptStream(cfg, seed, prompt_tokens)


class PromptStream:
    """The prompts of a run in a fixed order, with a cursor that a checkpoint saves.

    `state()` is where the stream is: the next prompt's index and the RNG state at the start of
    the current epoch (a file) or now (task); `restore(state)` continues exactly there, so a
    resumed run draws the prompts the uninterrupted run would have drawn next."""

    def __init__(self, cfg: DataConfig, seed: int, prompt_tokens: Callable[[Prompt], int] | None = None,
                 rows: list[Prompt] | None = None, where: str | None = None) -> None:
        """rows: prompts read already (one file of a mix, `where`), instead of data.path's."""
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
            self.rows = read_prompts(cfg) if rows is None else rows
            if cfg.max_prompt_tokens is not None and prompt_tokens is not None:
                total = len(self.rows)
                self.rows = [p for p in self.rows if prompt_tokens(p) <= cfg.max_prompt_tokens]
                self.left_out = total - len(self.rows)
                if not self.rows:
                    raise DataError(f"{where or cfg.path}: every one of its {total} prompts is longer than "
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


class MixedStream:
    """data.sources: each prompt drawn from one of several files, chosen at random by weight (a
    seeded generator of its own), each file its own PromptStream (its rows reshuffled every
    epoch of its own, seeded apart). state() and restore() hold every cursor, so a resumed run
    draws what the uninterrupted one would have."""

    def __init__(self, cfg: DataConfig, seed: int, prompt_tokens: Callable[[Prompt], int] | None = None) -> None:
        self.labels = [s.label for s in cfg.sources]
        self.weights = [s.weight for s in cfg.sources]
        self.streams = [PromptStream(cfg, seed + 1 + i, prompt_tokens, rows=read_source(cfg, s), where=s.path)
                        for i, s in enumerate(cfg.sources)]
        self.rng = random.Random(seed)
        self.position = 0

    @property
    def rows(self) -> list[Prompt]:
        return [p for s in self.streams for p in s.rows]

    @property
    def left_out(self) -> int:
        return sum(s.left_out for s in self.streams)

    def by_source(self) -> dict[str, int]:
        """Rows kept, per source."""
        return {label: len(s.rows) for label, s in zip(self.labels, self.streams)}

    def __iter__(self) -> MixedStream:
        return self

    def __next__(self) -> Prompt:
        (stream,) = self.rng.choices(self.streams, weights=self.weights)
        prompt = replace(next(stream), index=self.position)
        self.position += 1
        return prompt

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "rng": rng_to_json(self.rng.getstate()),
                "sources": [s.state() for s in self.streams]}

    def restore(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.rng.setstate(rng_from_json(state["rng"]))
        for stream, saved in zip(self.streams, state["sources"], strict=True):
            stream.restore(saved)


def rng_to_json(state: Any) -> list[Any]:
    """A random.Random state as JSON (and back: rng_from_json)."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_from_json(data: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
