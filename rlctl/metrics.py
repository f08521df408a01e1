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


def step_metrics(events: Iterable[dict[str, Any]], step: int) -> dict[str, Any]:
    ev = [e for e in events if e.get("step") == step]
    by = {kind: [e for e in ev if e["event"] == kind] for kind in
          ("step_start", "step_end", "group_admitted", "group_completed", "group_dropped",
           "train_start", "train_end", "sync_start", "sync_end")}
    if not by["step_start"] or not by["group_admitted"]:
        raise ValueError(f"step {step}: no step_start or no admitted group in the events")

    t_step = by["step_start"][0]["t"]
    t_first_request = min(e["t"] for e in by["group_admitted"])
    ready = sorted(e["t"] for e in by["group_completed"] + by["group_dropped"])
    trains = sorted(zip(sorted(by["train_start"], key=lambda e: e["t"]), sorted(by["train_end"], key=lambda e: e["t"]), strict=False),
                    key=lambda p: p[0]["t"])
    train_times = [end["t"] - start["t"] for start, end in trains]
    train_time = sum(train_times)
    t_train_end = trains[-1][1]["t"] if trains else ready[-1]
    window = t_train_end - t_first_request
    wait = max(0.0, window - train_time)

    bound = 0.0
    if trains and ready:
        bound = max(ready[-1] + train_times[-1], ready[0] + train_time) - t_first_request
    rewards = [r for e in by["group_completed"] for r in e["rewards"]]
    lengths = [n for e in by["group_completed"] for n in e["lengths"]]
    versions = [v for e in by["group_completed"] for v in e["versions"]]
    rollout_time = (ready[-1] - t_first_request) if ready else 0.0
    sync_time = sum(e["t"] for e in by["sync_end"]) - sum(e["t"] for e in by["sync_start"])
    t_end = by["step_end"][0]["t"] if by["step_end"] else max(e["t"] for e in ev)

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
        "train_batches": len(trains),
        "step_time": t_end - t_step,
        "rollout_time": rollout_time,
        "train_time": train_time,
        "sync_time": sync_time,
        "wait_time": wait,
        "rollout_to_train_end": window,
        "trainer_wait_ratio": wait / window if window > 0 else 0.0,
        "wait_time_ratio": wait / (wait + train_time) if wait + train_time > 0 else 0.0,
        "critical_path_bound": bound,
        "efficiency": bound / window if window > 0 else 0.0,
        "tokens_per_s": sum(lengths) / rollout_time if rollout_time > 0 else 0.0,
        "weight_version_min": min(versions, default=0),
        "weight_version_max": max(versions, default=0),
        "sync_bytes": sum(e.get("bytes", 0) for e in by["sync_end"]),
    }
    for key in TRAIN_STATS:
        values = [end[key] for _, end in trains if key in end]
        if values:
            m[key] = statistics.fmean(values)
    return m
