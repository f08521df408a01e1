"""A step's figures for trajectories with tool calls (rollout.multi_turn): how many turns and
calls, how many calls failed, the seconds in tools, and the servers' time idle while tools ran."""

from __future__ import annotations

import statistics
from typing import Any

from rlctl.metrics.spans import union_length

Interval = tuple[float, float]


def tool_metrics(model_turns: list[int], calls: list[tuple[float, float, bool]],
                 busy: dict[str, list[Interval]], servers: list[str], window: Interval) -> dict[str, Any]:
    """model_turns: model turns of each sample that completed in the step; calls: (start, end, ok)
    of each tool call the step made; busy: each server's request intervals; window: the step.

    rollout_idle_tool_ratio: the share of the servers' step time in which a server had no
    request while some tool call was running, the idle time tools cause (an idle server while no
    tool runs is idle for another reason). For a server, |tools ∩ idle| = |tools ∩ window| -
    |tools ∩ busy|, and |A ∩ B| = |A| + |B| - |A ∪ B| for unions of intervals."""
    t0, t1 = window
    span = t1 - t0
    tools = [(max(a, t0), min(b, t1)) for a, b, _ in calls if min(b, t1) > max(a, t0)]
    in_tools = union_length(tools)
    idle = []
    for server in servers:
        own = [(max(a, t0), min(b, t1)) for a, b in busy.get(server, []) if min(b, t1) > max(a, t0)]
        both = in_tools + union_length(own) - union_length(own + tools)
        idle.append((in_tools - both) / span if span > 0 else 0.0)
    seconds = [b - a for a, b, _ in calls]
    n = len(model_turns)
    return {
        **({"turns_per_sample": statistics.fmean(model_turns)} if model_turns else {}),
        "tool_calls": len(calls),
        "tool_calls_per_sample": len(calls) / n if n else 0.0,
        "tool_call_ok_ratio": sum(ok for *_, ok in calls) / len(calls) if calls else 0.0,
        "tool_seconds": sum(seconds),
        "tool_seconds_max": max(seconds, default=0.0),
        "rollout_idle_tool_ratio": statistics.fmean(idle) if idle else 0.0,
    }
