"""Environments: what answers a trajectory's tool calls.

An environment is a class (or any callable returning an object) that rlctl makes once per
trajectory, with no arguments, and then drives:

    class MyEnv:
        tools = [...]                     # the tools' JSON schemas: what the chat template shows
        def reset(self, row): ...         # the sample's data row: prompt, answer and its fields
        def step(self, name, arguments):  # one tool call; returns the tool's output as text,
            ...                           # or raises ToolError (or anything) for a failed call

`reset` is optional. A step that raises is a failed call: the error's message, one line, is
the tool's output, the model reads it and the call is counted as failed. The recipe names it as
rollout.multi_turn.environment = `module:Class`, found like reward.function (the Python path,
then the recipe's directory), or a built-in: `calculator` (calc), `python` (code in a sandbox,
rlctl/agents/sandbox.py). Steps run in worker threads, off the controller's event loop
(rlctl/agents/tools.py); the reward is still the reward section's, on the final model turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ToolError(Exception):
    """A tool call that failed: its message is what the model reads as the tool's output."""


class Environment:
    """A base class for environments with named tools (`tools`, one method `tool_<name>` each)."""

    tools: list[dict[str, Any]] = []

    def reset(self, row: Mapping[str, Any]) -> None:
        self.row = row

    def step(self, name: str, arguments: dict[str, Any]) -> str:
        known = [t["function"]["name"] for t in self.tools]
        if name not in known:
            raise ToolError(f"no tool named {name!r}; the tools are {', '.join(known)}")
        try:
            return str(getattr(self, f"tool_{name}")(**arguments))
        except TypeError as e:
            raise ToolError(f"{name}: {e}") from None
