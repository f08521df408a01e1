"""Prompt sources: where each group's prompt and reference answer come from."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator

from rlctl.errors import RunError
from rlctl.recipe import DataConfig, DataSource


@dataclass(frozen=True)
class Prompt:
    index: int
    """Position in the stream of prompts (0, 1, 2, ...); stable for a given seed."""
    text: str
    answer: str


def prompt_stream(cfg: DataConfig, seed: int) -> Iterator[Prompt]:
    """An endless, seeded stream of prompts: a built-in task, or a JSONL file reshuffled each epoch."""
    rng = random.Random(seed)
    if cfg.source is DataSource.TASK:
        from rlctl.rewards.tasks import TASKS

        task = TASKS[cfg.task]
        index = 0
        while True:
            text, answer = task.sample(rng)
            yield Prompt(index, text, answer)
            index += 1
    rows = read_jsonl_prompts(Path(cfg.path or ""), cfg.prompt_key, cfg.answer_key)
    index = 0
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for i in order:
            yield Prompt(index, *rows[i])
            index += 1


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
