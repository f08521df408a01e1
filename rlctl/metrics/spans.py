"""Spans and busy time: the two ways events become durations, written once for metrics, the
trace and calibration.

A span is a call that the log brackets with `<kind>_start` and `<kind>_end` (a train call, an
accumulate call, a weight sync, a step, an evaluation); busy time is the length of a union of intervals (a
rollout server is busy while any of its requests runs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class SpanKind(enum.StrEnum):
    TRAIN = "train"
    ACCUMULATE = "accumulate"
    SYNC = "sync"
    STEP = "step"
    EVAL = "eval"
    """A held-out evaluation of one set (between steps: rlctl/control/evaluation.py)."""


# Event name -> (span kind, whether it opens the span), for one dict lookup per event.
_EDGES = {f"{kind}_{edge}": (kind, edge == "start") for kind in SpanKind for edge in ("start", "end")}


@dataclass(frozen=True)
class Span:
    kind: SpanKind
    start: dict[str, Any]
    end: dict[str, Any]

    @property
    def seconds(self) -> float:
        return self.end["t"] - self.start["t"]


class SpanPairer:
    """Pairs each `<kind>_start` event with the `<kind>_end` of the same kind, step and batch
    (syncs and steps have no batch), fed one event at a time in the order they happened. An end
    without its start (a log cut short at the front) pairs with nothing."""

    def __init__(self) -> None:
        self._open: dict[tuple[SpanKind, Any, Any], dict[str, Any]] = {}

    def observe(self, event: dict[str, Any]) -> Span | None:
        """The span this event closes, if it closes one."""
        edge = _EDGES.get(event["event"])
        if edge is None:
            return None
        kind, opens = edge
        key = (kind, event.get("step"), event.get("batch"))
        if opens:
            self._open[key] = event
            return None
        start = self._open.pop(key, None)
        return None if start is None else Span(kind, start, event)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
