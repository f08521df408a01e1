"""Tool calls as a model writes them, and the parsers that read them out of a turn's text.

The first format is Hermes / Qwen3's: each call is a JSON object {"name": ..., "arguments": {...}}
between `<tool_call>` and `</tool_call>`, several calls one after another. SGLang reads it with
its `hermes` and `qwen25` function-call detectors (sglang/srt/function_call/); this parser reads
what they read: the text between the tags, stripped, as JSON, `parameters` or else `arguments`
for the arguments, a JSON list for several calls in one block. Where SGLang's detectors skip a block that
is not JSON or names no known tool, a trajectory cannot: the model said something, so the block
is a call that failed (`ToolCall.error`), answered with that error, counted, and trained against
like any wrong answer. An opening tag never closed is a failed call too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call a model's turn made: a tool's name and its arguments, or why it could not be read."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Set when the block could not be read as a call (bad JSON, no name); name is then ''."""


def parse_hermes(text: str) -> list[ToolCall]:
    """Every call in a turn's text, in order (empty: the turn called no tool)."""
    calls: list[ToolCall] = []
    for block in _BLOCK.findall(text):
        calls.extend(_calls_of(block.strip()))
    tail = text[text.rfind(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE):] if TOOL_CALL_CLOSE in text else text
    if TOOL_CALL_OPEN in tail:
        calls.append(ToolCall("", error=f"a {TOOL_CALL_OPEN} without its {TOOL_CALL_CLOSE}"))
    return calls


def _calls_of(block: str) -> list[ToolCall]:
    try:
        value = json.loads(block)
    except json.JSONDecodeError as e:
        return [ToolCall("", error=f"the call is not JSON ({e.msg} at character {e.pos})")]
    out = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            out.append(ToolCall("", error='the call has no "name"'))
            continue
        args = item.get("parameters") or item.get("arguments", {})  # in SGLang's order
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            out.append(ToolCall(item["name"], error='"arguments" is not a JSON object'))
            continue
        out.append(ToolCall(item["name"], args))
    return out


Parser = Callable[[str], list[ToolCall]]

PARSERS: dict[str, Parser] = {"hermes": parse_hermes, "qwen3": parse_hermes}
"""rollout.multi_turn.tool_parser's choices. Qwen3 (and Qwen2.5) write Hermes' format."""
