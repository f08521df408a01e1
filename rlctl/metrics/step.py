"""Per-step metrics, computed as the events happen: work per event that does not grow with the run,
and no event kept beyond the step it belongs to. The definitions are in rlctl/metrics/__init__.py.

A step's own events are those that carry its step number and come between its step_start and
its step_end. Three things cross steps: the time each completed group became ready (async trains
in step k groups completed earlier; kept until the group is trained or dropped), the rollout
servers seen so far (a server idle for a whole step still counts), and the requests of any step
that ran during this one (they make the servers busy).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rlctl.metrics.spans import SpanKind, SpanPairer, union_length
from rlctl.metrics.tools import tool_metrics

TRAIN_STATS = ("loss", "clip_frac", "kl", "grad_norm", "logprob_diff", "approx_kl", "entropy", "dual_clip_frac",
               "mismatch_kl", "is_weight_mean", "is_capped_frac", "value_loss", "value_clip_frac", "explained_var",
               "values_mean", "critic_grad_norm", "update_ok", "peak_gib")
"""The trainer's statistics a step's record averages over its train batches (docs/metrics.md);
each is present only where the run's algo section produces it."""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class _Step:
    """What one open step has seen so far."""

    step: int
    t_start: float
    t_last: float
    """The latest time among the step's own events: its end when the log has no step_end."""
    t_end: float | None = None
    t_first_request: float | None = None
    t_last_ready: float | None = None
    train_times: list[float] = field(default_factory=list)
    accumulate_times: list[float] = field(default_factory=list)
    t_train_end: float | None = None
    trained_ready: list[float | None] = field(default_factory=list)
    """When each trained group became ready (None: not in the log, counted as the first request)."""
    rewards: list[float] = field(default_factory=list)
    source_rewards: dict[str, list[float]] = field(default_factory=dict)
    """The rewards of each data source's groups (the row's data_source), when the data names one."""
    scores: dict[str, list[float]] = field(default_factory=dict)
    """Each named score a reward function returned, over the step's samples that have it."""
    lengths: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    groups: int = 0
    groups_dropped: int = 0
    reward_errors: int = 0
    t_first_train: float | None = None
    """When the step's first trainer call began (async trains groups that were ready before its first request)."""
    sync_lags: list[int] = field(default_factory=list)
    """Per trained sample: weight syncs between the weights that generated it and the trainer's."""
    sync_starts: list[float] = field(default_factory=list)
    sync_ends: list[float] = field(default_factory=list)
    sync_bytes: int = 0
    turns: list[float] = field(default_factory=list)
    """colocate.enabled: the seconds of each turn of the devices (colocate_turn events)."""
    train_stats: dict[str, list[float]] = field(default_factory=dict)
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """Each server's request intervals, from the step's start on."""
    model_turns: list[int] = field(default_factory=list)
    """rollout.multi_turn: the model turns of each sample."""
    tool_calls: list[tuple[float, float, bool]] = field(default_factory=list)
    """rollout.multi_turn: (start, end, ok) of each tool call (tool_call events)."""


@dataclass
class Progress:
    """What a run has done so far, in units that mean the same in every mode (a step is 4
    optimizer steps in one run and 1 in another): carried from record to record, and into a
    resumed attempt from its last record (carry())."""

    optimizer_steps: int = 0
    samples: int = 0
    tokens: int = 0
    elapsed_before: float = 0.0
    """Seconds of earlier attempts (a resumed run)."""
    t_start: float | None = None
    """This attempt's start: its run_start, else its first step_start."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Groups dropped so far, by reason (stale, all_equal, surplus, aborted, resumed)."""
    synced: list[int] = field(default_factory=list)
    """The weight versions synced to the servers, recent ones (sync lags are counted in them)."""
    version: int | None = None
    """The trainer's weight version after its last optimizer step."""


OPEN_STEP_EVENTS = ("colocate_turn", "group_completed", "tool_call")
"""Events that belong to the step open when they happen, whatever step they name: a colocated
run's turns name none; a group (and its tool calls) names the step that opened it, which in
async may be an earlier one than the step it completes in, and the step's figures count what
completed in it."""


class StepMetrics:
    """Observes every event as it is emitted; at each step_end, returns that step's record (the
    line metrics.jsonl gets) and forgets the step."""

    def __init__(self) -> None:
        self._spans = SpanPairer()
        self._ready_at: dict[int, float] = {}
        """Completed groups not yet trained or dropped: when each became ready."""
        self._servers: set[str] = set()
        self._open: _Step | None = None
        self.progress = Progress()

    def carry(self, record: dict[str, Any]) -> None:
        """A resumed attempt goes on counting from the last record of the attempts before it."""
        p = self.progress
        p.optimizer_steps = int(record.get("optimizer_steps", 0))
        p.samples = int(record.get("samples_total", 0))
        p.tokens = int(record.get("tokens_total", 0))
        p.elapsed_before = float(record.get("elapsed_s", 0.0))
        p.dropped = {str(k): int(v) for k, v in (record.get("groups_dropped_by_reason") or {}).items()}

    def observe(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """Take one event; the step's record when the event is its step_end."""
        kind = event["event"]
        ready: list[float | None] = []
        p = self.progress
        if kind == "group_completed":
            self._completed(event)
        elif kind == "group_dropped":
            self._ready_at.pop(event["group"], None)
            reason = str(event.get("reason", "other"))
            p.dropped[reason] = p.dropped.get(reason, 0) + 1
        elif kind == "train_start":
            ready = [self._ready_at.pop(g, None) for g in event.get("groups", [])]
        elif kind == "train_end":
            p.optimizer_steps += 1
            p.version = event.get("version", p.version)
        elif kind == "sync_end" and isinstance(event.get("version"), int):
            p.synced = [*p.synced[-1023:], event["version"]]
        if kind in ("run_start", "step_start") and p.t_start is None:
            p.t_start = event["t"]
        span = self._spans.observe(event)
        s = self._open
        if kind == "step_start":
            self._open = _Step(event["step"], event["t"], event["t"])
            return None
        if s is None or (s.step if kind in OPEN_STEP_EVENTS else event.get("step")) != s.step:
            return None
        s.t_last = max(s.t_last, event["t"])
        s.trained_ready += ready
        _take(s, event, kind)
        if kind == "train_start":
            s.sync_lags += self._sync_lags(event.get("staleness", []))
        if span is not None and span.kind in (SpanKind.TRAIN, SpanKind.ACCUMULATE):
            (s.train_times if span.kind is SpanKind.TRAIN else s.accumulate_times).append(span.seconds)
            began = span.start["t"]
            s.t_first_train = began if s.t_first_train is None else min(s.t_first_train, began)
        if kind == "step_end":
            s.t_end = event["t"]
            return self.close()
        return None

    def _sync_lags(self, staleness: list[int]) -> list[int]:
        """Each sample's lag in weight syncs: the syncs after the one whose weights generated it
        (its staleness counts optimizer steps, of which a sync mode step takes several with no
        sync between)."""
        p = self.progress
        if p.version is None:
            return [0 for _ in staleness]
        return [sum(1 for v in p.synced if p.version - lag < v <= p.version) for lag in staleness]

    def close(self) -> dict[str, Any] | None:
        """End the open step here (a log cut short ends at its last event) and return its record."""
        s, self._open = self._open, None
        if s is None:
            return None
        record = _record(s, sorted(self._servers))
        p = self.progress
        p.samples += record["samples"]
        p.tokens += sum(s.lengths)
        t_end = s.t_last if s.t_end is None else s.t_end
        record.update({
            "optimizer_steps": p.optimizer_steps, "samples_total": p.samples, "tokens_total": p.tokens,
            "elapsed_s": p.elapsed_before + t_end - (s.t_start if p.t_start is None else p.t_start),
            "groups_dropped_total": sum(p.dropped.values()), "groups_dropped_by_reason": dict(p.dropped),
        })
        return record

    def _completed(self, e: dict[str, Any]) -> None:
        self._ready_at[e["group"]] = e["t"]
        servers = e.get("servers", [])
        if isinstance(e.get("turns"), list):  # trajectories: a server is busy with their model turns only
            spans = [(t[0], t[1], t[2]) for turns in e["turns"] for t in turns]
        else:
            spans = list(zip(servers, e.get("starts", []), e.get("ends", [])))
        self._servers.update(servers)
        self._servers.update(server for server, _, _ in spans)  # a trajectory's later turns may go elsewhere
        s = self._open
        if s is None:
            return
        for server, a, b in spans:
            if b > s.t_start:
                s.busy.setdefault(server, []).append((max(a, s.t_start), b))


def _take(s: _Step, e: dict[str, Any], kind: str) -> None:
    """An event of the open step."""
    t = e["t"]
    if kind == "group_admitted":
        s.t_first_request = t if s.t_first_request is None else min(s.t_first_request, t)
    elif kind == "group_completed":
        s.groups += 1
        s.t_last_ready = t if s.t_last_ready is None else max(s.t_last_ready, t)
        s.rewards += e["rewards"]
        if e.get("source"):
            s.source_rewards.setdefault(str(e["source"]), []).extend(e["rewards"])
        for name, values in (e.get("scores") or {}).items():
            s.scores.setdefault(str(name), []).extend(v for v in values if isinstance(v, int | float))
        s.lengths += e["lengths"]
        s.versions += e["versions"]
        if isinstance(e.get("turns"), list):
            s.model_turns += [len(turns) for turns in e["turns"]]
    elif kind == "tool_call":
        s.tool_calls.append((t, t + float(e.get("seconds") or 0.0), bool(e.get("ok"))))
    elif kind == "group_dropped":
        s.groups_dropped += 1
    elif kind == "reward_error":
        s.reward_errors += 1
    elif kind == "train_start":
        s.staleness += e.get("staleness", [])
    elif kind == "train_end":
        s.t_train_end = t if s.t_train_end is None else max(s.t_train_end, t)
        for key in TRAIN_STATS:
            if key in e:
                s.train_stats.setdefault(key, []).append(e[key])
    elif kind == "sync_start":
        s.sync_starts.append(t)
    elif kind == "sync_end":
        s.sync_ends.append(t)
        s.sync_bytes += e.get("bytes", 0)
    elif kind == "colocate_turn":
        s.turns.append(float(e.get("seconds") or 0.0))


def _record(s: _Step, servers: list[str]) -> dict[str, Any]:
    t_end = s.t_last if s.t_end is None else s.t_end
    t_first_request = s.t_start if s.t_first_request is None else s.t_first_request
    if s.t_first_train is not None:  # async trains groups that were ready before its first request
        t_first_request = min(t_first_request, s.t_first_train)
    train_time = sum(s.train_times) + sum(s.accumulate_times)
    t_train_end = s.t_train_end if s.t_train_end is not None else (
        s.t_last_ready if s.t_last_ready is not None else s.t_start)
    window = t_train_end - t_first_request
    wait = max(0.0, window - train_time)

    # The critical path: the trainer cannot start a group before it is ready (nor before the
    # window opens), and must run every train batch of the step.
    ready = [t_first_request if r is None else max(r, t_first_request) for r in s.trained_ready]
    bound = 0.0
    if s.train_times and ready:
        bound = max(max(ready) + s.train_times[-1], min(ready) + train_time) - t_first_request

    rollout_time = s.t_last_ready - t_first_request if s.t_last_ready is not None else 0.0
    step_time = t_end - s.t_start
    idle = [1.0 - union_length([(a, min(b, t_end)) for a, b in s.busy.get(server, []) if min(b, t_end) > a]) / step_time
            for server in servers] if step_time > 0 else []

    m: dict[str, Any] = {
        "step": s.step,
        "reward_mean": statistics.fmean(s.rewards) if s.rewards else 0.0,
        "response_len_mean": statistics.fmean(s.lengths) if s.lengths else 0.0,
        "response_len_p50": percentile(s.lengths, 0.5),
        "response_len_p90": percentile(s.lengths, 0.9),
        "response_len_max": max(s.lengths, default=0),
        "samples": len(s.rewards),
        "groups": s.groups,
        "groups_dropped": s.groups_dropped, "reward_errors": s.reward_errors,
        "train_batches": len(s.train_times),
        "step_time": step_time,
        "rollout_time": rollout_time,
        "train_time": train_time,
        "sync_time": sum(s.sync_ends) - sum(s.sync_starts),
        "wait_time": wait,
        "rollout_to_train_end": window,
        "trainer_wait_ratio": wait / window if window > 0 else 0.0,
        "wait_time_ratio": wait / (wait + train_time) if wait + train_time > 0 else 0.0,
        "rollout_idle_ratio": statistics.fmean(idle) if idle else 0.0,
        "critical_path_bound": bound,
        "efficiency": min(1.0, bound / window) if window > 0 else 0.0,
        "tokens_per_s": sum(s.lengths) / rollout_time if rollout_time > 0 else 0.0,
        "samples_per_s": len(s.lengths) / step_time if step_time > 0 else 0.0,
        "weight_version_min": min(s.versions, default=0),
        "weight_version_max": max(s.versions, default=0),
        "staleness_mean": statistics.fmean(s.staleness) if s.staleness else 0.0,
        "staleness_max": max(s.staleness, default=0),
        "staleness_hist": {str(k): s.staleness.count(k) for k in sorted(set(s.staleness))},
        "sync_lag_mean": statistics.fmean(s.sync_lags) if s.sync_lags else 0.0,
        "sync_lag_max": max(s.sync_lags, default=0),
        "sync_bytes": s.sync_bytes,
    }
    for key in TRAIN_STATS:
        if key in s.train_stats:
            m[key] = statistics.fmean(s.train_stats[key])
    return m | _where_given(s, servers, t_end)


def _where_given(s: _Step, servers: list[str], t_end: float) -> dict[str, float]:
    """reward_mean/<source> per data source and score_<name> per named score, where the data or
    the reward function gives them; turn_time in a colocated run (what taking turns cost the
    step: releasing and resuming memory); a multi-turn run's tool figures (rlctl/metrics/tools.py)."""
    m = {f"reward_mean/{source}": statistics.fmean(rewards) for source, rewards in sorted(s.source_rewards.items())}
    if s.model_turns or s.tool_calls:
        m |= tool_metrics(s.model_turns, s.tool_calls, s.busy, servers, (s.t_start, t_end))
    m |= {"turn_time": sum(s.turns)} if s.turns else {}
    return m | {f"score_{name}": statistics.fmean(values) for name, values in sorted(s.scores.items()) if values}


def step_metrics(events: Iterable[dict[str, Any]], step: int) -> dict[str, Any]:
    """One step's record from a whole log, through the same observer the controller feeds as the
    run goes (so each step counts what had happened by its step_end). Events are taken in time
    order; a step the log holds twice (a requeued run) gives its last record."""
    observer = StepMetrics()
    found: dict[str, Any] | None = None
    started = False
    for event in sorted(events, key=lambda e: e["t"]):
        started = started or (event["event"] == "step_start" and event["step"] == step)
        m = observer.observe(event)
        if m is not None and m["step"] == step:
            found = m
    m = observer.close()
    if m is not None and m["step"] == step:
        found = m
    if found is None or not started:
        raise ValueError(f"step {step}: no step_start in the events")
    return found
