"""Per-step metrics from events.jsonl: pure functions, so every run reports the same thing.

Definitions (DESIGN.md "Metrics"), all in seconds of the controller's monotonic clock:
- rollout_to_train_end: first rollout request of the step -> end of its last optimizer step.
- trainer_wait_ratio: time the trainer waits for data inside that window / the window.
- wait_time_ratio (Slime's): wait / (wait + train), for like-for-like comparison with Slime.
- critical-path bound: max(last group ready + last train batch's time,
                           first group ready + the step's total train time), from the first request;
  efficiency = bound / rollout_to_train_end (1.0 = no avoidable waiting).
"""

from __future__ import annotations

import statistics
from typing import Any
from collections.abc import Iterable

TRAIN_STATS = ("loss", "clip_frac", "kl", "grad_norm", "logprob_diff")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def step_metrics(events: Iterable[dict[str, Any]], step: int) -> dict[str, Any]:
    """The step's metrics. `events` may hold the whole run: async trains in step k groups that
    completed earlier, and their ready times are looked up by group id."""
    events = list(events)
    ev = [e for e in events if e.get("step") == step]
    by = {kind: [e for e in ev if e["event"] == kind] for kind in
          ("step_start", "step_end", "group_admitted", "group_completed", "group_dropped",
           "train_start", "train_end", "sync_start", "sync_end")}
    if not by["step_start"]:
        raise ValueError(f"step {step}: no step_start in the events")
    ready_at = {e["group"]: e["t"] for e in events if e["event"] == "group_completed"}

    t_step = by["step_start"][0]["t"]
    t_first_request = min((e["t"] for e in by["group_admitted"]), default=t_step)
    starts = sorted(by["train_start"], key=lambda e: e["t"])
    ends = sorted(by["train_end"], key=lambda e: e["t"])
    train_times = [end["t"] - start["t"] for start, end in zip(starts, ends)]
    train_time = sum(train_times)
    completed_here = sorted(e["t"] for e in by["group_completed"])
    t_train_end = ends[-1]["t"] if ends else (completed_here[-1] if completed_here else t_step)
    window = t_train_end - t_first_request
    wait = max(0.0, window - train_time)

    # The critical path: the trainer cannot start a group before it is ready (nor before the
    # window opens), and must run every train batch of the step.
    trained_ready = sorted(max(ready_at.get(g, t_first_request), t_first_request)
                           for e in starts for g in e.get("groups", []))
    bound = 0.0
    if train_times and trained_ready:
        bound = max(trained_ready[-1] + train_times[-1], trained_ready[0] + train_time) - t_first_request

    rewards = [r for e in by["group_completed"] for r in e["rewards"]]
    lengths = [n for e in by["group_completed"] for n in e["lengths"]]
    versions = [v for e in by["group_completed"] for v in e["versions"]]
    staleness = [lag for e in starts for lag in e.get("staleness", [])]
    rollout_time = (completed_here[-1] - t_first_request) if completed_here else 0.0
    sync_time = sum(e["t"] for e in by["sync_end"]) - sum(e["t"] for e in by["sync_start"])
    t_end = by["step_end"][0]["t"] if by["step_end"] else max(e["t"] for e in ev)
    step_time = t_end - t_step

    # Rollout servers: busy while any request of theirs runs, within this step.
    busy: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e["event"] == "group_completed":
            for server, a, b in zip(e.get("servers", []), e.get("starts", []), e.get("ends", [])):
                a, b = max(a, t_step), min(b, t_end)
                if b > a:
                    busy.setdefault(server, []).append((a, b))
    servers = sorted({sv for e in events if e["event"] == "group_completed" for sv in e.get("servers", [])})
    idle = [1.0 - _union_length(busy.get(sv, [])) / step_time for sv in servers] if step_time > 0 else []

    m: dict[str, Any] = {
        "step": step,
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "response_len_p50": _percentile(lengths, 0.5),
        "response_len_p90": _percentile(lengths, 0.9),
        "response_len_max": max(lengths, default=0),
        "samples": len(rewards),
        "groups": len(by["group_completed"]),
        "groups_dropped": len(by["group_dropped"]),
        "train_batches": len(train_times),
        "step_time": step_time,
        "rollout_time": rollout_time,
        "train_time": train_time,
        "sync_time": sync_time,
        "wait_time": wait,
        "rollout_to_train_end": window,
        "trainer_wait_ratio": wait / window if window > 0 else 0.0,
        "wait_time_ratio": wait / (wait + train_time) if wait + train_time > 0 else 0.0,
        "rollout_idle_ratio": statistics.fmean(idle) if idle else 0.0,
        "critical_path_bound": bound,
        "efficiency": bound / window if window > 0 else 0.0,
        "tokens_per_s": sum(lengths) / rollout_time if rollout_time > 0 else 0.0,
        "samples_per_s": len(lengths) / step_time if step_time > 0 else 0.0,
        "weight_version_min": min(versions, default=0),
        "weight_version_max": max(versions, default=0),
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
        "staleness_max": max(staleness, default=0),
        "staleness_hist": {str(k): staleness.count(k) for k in sorted(set(staleness))},
        "sync_bytes": sum(e.get("bytes", 0) for e in by["sync_end"]),
    }
    for key in TRAIN_STATS:
        values = [end[key] for end in ends if key in end]
        if values:
            m[key] = statistics.fmean(values)
    return m
