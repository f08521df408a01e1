"""The recorder: what a run writes down as it goes, the same for a real run and a simulation.

Every event goes to an event writer (events.jsonl, or memory) and through StepMetrics; at each
step_end the events written so far are flushed, so that `rlctl status` sees them with the step's
record, and the record goes to metrics.jsonl and to the experiment tracker. Nothing keeps the
events: memory and the work per event stay the same from the first step to the last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from rlctl.metrics.step import StepMetrics

if TYPE_CHECKING:
    from rlctl.run.tracking import Tracker


class EventWriter(Protocol):
    def write(self, event: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...


class KeptEvents(list):
    """An EventWriter that keeps every event in memory (tests, small simulations)."""

    def write(self, event: dict[str, Any]) -> None:
        self.append(event)

    def flush(self) -> None:
        pass


class Recorder:
    """`emit` is the pipeline's EventSink. `on_record` takes each step's record (metrics.jsonl);
    `wall_clock`, when given, stamps the record's `time`."""

    def __init__(self, events: EventWriter, on_record: Callable[[dict[str, Any]], None],
                 tracker: Tracker | None = None, wall_clock: Callable[[], float] | None = None) -> None:
        self.events = events
        self.on_record = on_record
        self.tracker = tracker
        self.wall_clock = wall_clock
        self.steps = StepMetrics()
        self.recorded = 0
        """Steps recorded so far."""
        self.last: dict[str, Any] | None = None
        """The latest step's record."""
        self.t_last = 0.0
        """The time of the latest event."""

    def emit(self, kind: str, t: float, **fields: Any) -> None:
        event = {"t": t, "event": kind, **fields}
        self.events.write(event)
        self.t_last = t
        record = self.steps.observe(event)
        if record is not None:
            self._step_done(record)

    def _step_done(self, record: dict[str, Any]) -> None:
        self.events.flush()
        if self.wall_clock is not None:
            record["time"] = self.wall_clock()
        self.on_record(record)
        if self.tracker is not None:
            self.tracker.log_step(record)
        self.recorded += 1
        self.last = record

    def evaluated(self, on_eval: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        """What takes an evaluation's record (rlctl/control/evaluation.py): `on_eval` (eval.jsonl),
        then the tracker; the events before it flushed, as at a step's end."""

        def record(found: dict[str, Any]) -> None:
            self.events.flush()
            on_eval(found)
            if self.tracker is not None:
                self.tracker.log_eval(found)

        return record

    def close(self, completed: bool) -> None:
        """The run ended (`completed`: every step done): flush what is left and tell the tracker."""
        self.events.flush()
        if self.tracker is not None:
            self.tracker.finish(ok=completed)
