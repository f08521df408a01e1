"""A row of a dataset as a prompt: what the model is asked, the answer its response is checked
against, and the row's other fields, which a reward function may ask for by name.

Read as the field writes them:
- the prompt (data.prompt_key, default `prompt`): a string, or a list of chat messages
  ({role, content}, ending with a user's turn); a row with no `prompt` but a `messages` list uses that;
- the answer (data.answer_key, a dotted path for a nested field): a string or a number; a row
  with no `answer` but verl's `reward_model: {ground_truth: ...}` uses that;
- `data_source`, when the row has it, names the row's source in the metrics.
So a verl Parquet (data_source, prompt as messages, reward_model.ground_truth, extra_info) and a
file of {"prompt": ..., "answer": ...} lines are both read unchanged. Every malformed row is an
error naming the file, the row and the fix, before a run starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlctl.data.rows import DataError

ROLES = ("system", "user", "assistant", "tool")
VERL_ANSWER = "reward_model.ground_truth"


@dataclass(frozen=True)
class Prompt:
    index: int
    """Position in the stream of prompts (0, 1, 2, ...); stable for a given seed."""
    prompt: str | list[dict[str, str]]
    """The prompt as the data holds it: text, or chat messages."""
    answer: str
    source: str = ""
    """The row's data_source ("" for a built-in task or a row without one)."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The row's fields, as the reward function may ask for them (rlctl/recipe/reward_call.py)."""

    @property
    def text(self) -> str:
        """The prompt as one readable string: the text, or the messages as `role: content` lines."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.prompt)


def lookup(row: Mapping[str, Any], key: str) -> Any:
    """row[key], a dotted key reaching into nested fields; KeyError when any part is missing."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def row_prompt(where: str, row: Mapping[str, Any], prompt_key: str, answer_key: str) -> Prompt:
    """The prompt of one row (its index set by the stream); DataError naming `where` (file:row)."""
    return Prompt(-1, _prompt(where, row, prompt_key), _answer(where, row, answer_key),
                  str(row.get("data_source") or ""), dict(row))


def _prompt(where: str, row: Mapping[str, Any], key: str) -> str | list[dict[str, str]]:
    try:
        value = lookup(row, key)
    except KeyError:
        if key != "prompt" or "messages" not in row:
            raise DataError(f"{where}: no field '{key}' (data.prompt_key); fields: {sorted(row)[:12]}; set "
                            "data.prompt_key or fix the row") from None
        value = row["messages"]
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: the prompt '{key}' is empty; give every row a prompt or drop the row")
        return value
    if not isinstance(value, list):
        raise DataError(f"{where}: the prompt '{key}' is a {type(value).__name__}; give a string or a list of "
                        "{role, content} messages")
    return _messages(where, value)


def _messages(where: str, value: list[Any]) -> list[dict[str, str]]:
    if not value:
        raise DataError(f"{where}: the prompt is an empty list of messages; give at least a user message")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} is not a {{role, content}} pair of strings ({str(m)[:60]}); fix "
                            "the row")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has role '{m['role']}'; a role is one of {', '.join(ROLES)}")
        messages.append({"role": m["role"], "content": m["content"]})
    if messages[-1]["role"] == "assistant":
        raise DataError(f"{where}: the messages end with the assistant's turn; a prompt ends where the model "
                        "answers (drop the last message)")
    return messages


def _answer(where: str, row: Mapping[str, Any], key: str) -> str:
    try:
        value = lookup(row, key)
    except KeyError:
        try:
            if key != "answer":
                raise KeyError(key) from None
            value = lookup(row, VERL_ANSWER)
        except KeyError:
            raise DataError(f"{where}: no field '{key}' (data.answer_key); fields: {sorted(row)[:12]}; set "
                            "data.answer_key or fix the row") from None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataError(f"{where}: the answer '{key}' is a {type(value).__name__}; give a string or a number")
    answer = str(value)
    if not answer.strip():
        raise DataError(f"{where}: the answer '{key}' is empty; a verifier needs an answer to check against")
    return answer


def file_prompts(path: Path, rows: list[tuple[int, dict[str, Any]]], prompt_key: str, answer_key: str) -> list[Prompt]:
    """Every row of a file as a prompt; DataError on the first malformed one, or on none."""
    prompts = [row_prompt(f"{path}:{n}" if path.suffix == ".jsonl" else f"{path}: row {n}", row, prompt_key,
                          answer_key) for n, row in rows]
    if not prompts:
        raise DataError(f"{path}: no rows; data.source=file needs at least one")
    return prompts
