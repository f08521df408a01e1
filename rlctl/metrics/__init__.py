"""What a run reports: per-step metrics (metrics.jsonl), the recorder that writes a run's record
as it happens, and the timeline as a Chrome trace.

    spans.py     start/end pairing of trainer calls, syncs and steps; the union of intervals
    step.py      StepMetrics: each step's record from the events, as they are emitted
    recorder.py  Recorder: events to events.jsonl, records to metrics.jsonl and the tracker
    trace.py     chrome_trace

Definitions, in seconds of the run's clock (docs/metrics.md lists every key):
- rollout_to_train_end: first rollout request of the step -> end of its last optimizer step.
- trainer_wait_ratio: time the trainer waits for data inside that window / the window.
- wait_time_ratio (Slime's): wait / (wait + train), for like-for-like comparison with Slime.
- critical-path bound: max(last group ready + the last train call's time,
                           first group ready + the step's total train time), from the first request;
  efficiency = bound / rollout_to_train_end (1.0 = no avoidable waiting).
- rollout_idle_ratio: the mean over the servers seen so far of the share of the step during
  which none of a server's requests ran.
Training time counts every trainer call: a streamed train batch (rolloutpipe with stream_train)
is accumulate calls on its early groups (accumulate_start/_end) and one final call that takes
the optimizer step (train_start/_end). The last train call is all the work left once the last
group is ready; without streaming it is the whole last train batch.
"""

from rlctl.metrics.recorder import EventWriter, KeptEvents, Recorder
from rlctl.metrics.spans import Span, SpanKind, SpanPairer, union_length
from rlctl.metrics.step import TRAIN_STATS, StepMetrics, step_metrics
from rlctl.metrics.trace import chrome_trace, run_start_time

__all__ = [
    "TRAIN_STATS", "EventWriter", "KeptEvents", "Recorder", "Span", "SpanKind", "SpanPairer", "StepMetrics",
    "chrome_trace", "run_start_time", "step_metrics", "union_length",
]
