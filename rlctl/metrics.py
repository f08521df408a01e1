"""Per-step metrics from events.jsonl: pure functions, so every run reports the same thing.

Definitions (DESIGN.md "Metrics"), all in seconds of the controller's monotonic clock:
- rollout_to_train_end: first rollout request of the step -> end of its last optimizer step.
- trainer_wait_ratio: time the trainer waits for data inside that window / the window.
- wait_time_ratio (Slime's): wait / (wait + train), for like-for-like comparison with Slime.
- critical-path bound: max(last group ready + the last train call's time,
                           first group ready + the step's total train time), from the first request;
  efficiency = bound / rollout_to_train_end (1.0 = no avoidable waiting).
Training time counts every trainer call: a streamed train batch (rolloutpipe with stream_train)
is accumulate calls on its early groups (accumulate_start/_end) and one final call that takes
the optimizer step (train_start/_end). The last train call is all the work left once the last
group is ready; without streaming it is the whole last train batch.
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
           "train_start", "train_end", "accumulate_start", "accumulate_end", "sync_start", "sync_end")}
    if not by["step_start"]:
        raise ValueError(f"step {step}: no step_start in the events")
    ready_at = {e["group"]: e["t"] for e in events if e["event"] == "group_completed"}

    t_step = by["step_start"][0]["t"]
    t_first_request = min((e["t"] for e in by["group_admitted"]), default=t_step)
    starts = sorted(by["train_start"], key=lambda e: e["t"])
    ends = sorted(by["train_end"], key=lambda e: e["t"])
    train_times = [end["t"] - start["t"] for start, end in zip(starts, ends)]
    accumulate_times = [end["t"] - start["t"] for start, end in zip(sorted(by["accumulate_start"], key=lambda e: e["t"]),
                                                                   sorted(by["accumulate_end"], key=lambda e: e["t"]))]
    train_time = sum(train_times) + sum(accumulate_times)
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


def chrome_trace(events: list[dict[str, Any]], trainer_ranks: int = 1) -> dict[str, Any]:
    """The run's timeline as Chrome trace JSON (opens in Perfetto / chrome://tracing): one track per
    rollout server (each sample's request), one per trainer rank (train batches, weight syncs),
    and one for the controller (steps)."""
    t0 = min((e["t"] for e in events), default=0.0)
    out: list[dict[str, Any]] = []

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 1)

    def span(name: str, pid: int, tid: int, start: float, end: float, **args: Any) -> None:
        out.append({"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": us(start),
                    "dur": max(0.0, round((end - start) * 1e6, 1)), "args": args})

    servers = sorted({s for e in events if e["event"] == "group_completed" for s in e.get("servers", [])})
    tid_of = {s: i for i, s in enumerate(servers)}
    for pid, name in ((1, "rollout servers"), (2, "trainer"), (3, "controller")):
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
    for server, tid in tid_of.items():
        out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": server}})
    for rank in range(trainer_ranks):
        out.append({"name": "thread_name", "ph": "M", "pid": 2, "tid": rank, "args": {"name": f"trainer-{rank}"}})
    out.append({"name": "thread_name", "ph": "M", "pid": 3, "tid": 0, "args": {"name": "steps"}})

    open_spans: dict[tuple[str, Any], dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        kind = e["event"]
        if kind == "group_completed":
            for i, (server, a, b) in enumerate(zip(e.get("servers", []), e.get("starts", []), e.get("ends", []))):
                span(f"g{e['group']}", 1, tid_of[server], a, b, group=e["group"], sample=i, step=e["step"],
                     tokens=e["lengths"][i], reward=e["rewards"][i], version=e["versions"][i])
        elif kind in ("train_start", "accumulate_start", "sync_start", "step_start"):
            open_spans[(kind.split("_")[0], e.get("batch", e["step"]))] = e
        elif kind in ("train_end", "accumulate_end", "sync_end", "step_end"):
            what = kind.split("_")[0]
            start = open_spans.pop((what, e.get("batch", e["step"])), None)
            if start is None:
                continue
            if what == "step":
                span(f"step {e['step']}", 3, 0, start["t"], e["t"], step=e["step"], version=e.get("version"))
                continue
            label = {"train": f"train batch {e.get('batch')}", "accumulate": f"accumulate batch {e.get('batch')}",
                     "sync": f"weight sync v{e.get('version', '?')}"}[what]
            for rank in range(trainer_ranks):
                span(label, 2, rank, start["t"], e["t"], step=e["step"], version=e.get("version"))
        elif kind in ("group_dropped", "server_up", "server_down"):
            out.append({"name": kind, "ph": "i", "s": "p", "pid": 3 if kind == "group_dropped" else 1,
                        "tid": tid_of.get(e.get("role"), 0), "ts": us(e["t"]),
                        "args": {k: v for k, v in e.items() if k not in ("t", "event")}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}
