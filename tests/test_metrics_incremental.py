"""The incremental step metrics (the Recorder, fed as the run goes) against the whole-log
computation the controller used to redo at every step's end, on real simulated runs of every mode.

`whole_log_metrics` is that computation as it was: every step rescans every event so far (the
prefix of the log up to the step's step_end, which is what the controller had when it computed
the step). The recorder must give exactly its numbers. Only the two arithmetic helpers (a
percentile, the length of a union of intervals) are shared with the code under test.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from conftest import REPO
from rlctl.metrics import step_metrics, union_length
from rlctl.metrics.step import percentile
from rlctl.recipe import load_recipe
from rlctl.sim.run import simulate_run

SIM = REPO / "recipes" / "sim-1024gpu.yaml"
SMALL = ["rollout.batch_size=64", "rollout.group_size=8", "train.groups_per_batch=8", "sim.rollout_gpus=8",
         "sim.trainer_gpus=8", "rollout.sampling.max_new_tokens=4096"]
TRAIN_STATS = ("loss", "clip_frac", "kl", "grad_norm", "logprob_diff")


def _idle(events: list[dict[str, Any]], t_step: float, t_end: float) -> list[float]:
    busy: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e["event"] == "group_completed":
            for server, a, b in zip(e.get("servers", []), e.get("starts", []), e.get("ends", [])):
                a, b = max(a, t_step), min(b, t_end)
                if b > a:
                    busy.setdefault(server, []).append((a, b))
    servers = sorted({sv for e in events if e["event"] == "group_completed" for sv in e.get("servers", [])})
    step_time = t_end - t_step
    return [1.0 - union_length(busy.get(sv, [])) / step_time for sv in servers] if step_time > 0 else []


def completed_in(events: list[dict[str, Any]], start: dict[str, Any], end: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The groups completed between a step's start and end: a group counts in the step it
    completes in (in async, a later one than the step that opened it)."""
    last = events.index(end) if end is not None else len(events)
    return [e for e in events[events.index(start):last + 1] if e["event"] == "group_completed"]


def whole_log_metrics(events: list[dict[str, Any]], step: int) -> dict[str, Any]:
    ev = [e for e in events if e.get("step") == step]
    by = {kind: [e for e in ev if e["event"] == kind] for kind in ("step_start", "step_end", "group_admitted",
          "group_dropped", "train_start", "train_end", "accumulate_start", "accumulate_end", "sync_start", "sync_end",
          "reward_error")}
    by["group_completed"] = completed_in(events, by["step_start"][0], (by["step_end"] or [None])[0])
    ready_at = {e["group"]: e["t"] for e in events if e["event"] == "group_completed"}
    t_step = by["step_start"][0]["t"]
    starts = sorted(by["train_start"], key=lambda e: e["t"])
    # the window opens at the first request, or earlier at the first trainer call (async)
    t_first_request = min([e["t"] for e in by["group_admitted"]] or [t_step])
    t_first_request = min([t_first_request] + [e["t"] for e in starts + by["accumulate_start"]])
    ends = sorted(by["train_end"], key=lambda e: e["t"])
    train_times = [end["t"] - start["t"] for start, end in zip(starts, ends)]
    accumulate_times = [end["t"] - start["t"] for start, end in
                        zip(sorted(by["accumulate_start"], key=lambda e: e["t"]),
                            sorted(by["accumulate_end"], key=lambda e: e["t"]))]
    train_time = sum(train_times) + sum(accumulate_times)
    completed_here = sorted(e["t"] for e in by["group_completed"])
    t_train_end = ends[-1]["t"] if ends else (completed_here[-1] if completed_here else t_step)
    window = t_train_end - t_first_request
    wait = max(0.0, window - train_time)
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
    t_end = by["step_end"][0]["t"] if by["step_end"] else max(e["t"] for e in ev + by["group_completed"])
    step_time = t_end - t_step
    idle = _idle(events, t_step, t_end)
    m: dict[str, Any] = {
        "step": step, "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "response_len_p50": percentile(lengths, 0.5), "response_len_p90": percentile(lengths, 0.9),
        "response_len_max": max(lengths, default=0), "samples": len(rewards), "groups": len(by["group_completed"]),
        "groups_dropped": len(by["group_dropped"]), "reward_errors": len(by["reward_error"]),
        "train_batches": len(train_times), "step_time": step_time,
        "rollout_time": rollout_time, "train_time": train_time,
        "sync_time": sum(e["t"] for e in by["sync_end"]) - sum(e["t"] for e in by["sync_start"]),
        "wait_time": wait, "rollout_to_train_end": window, "trainer_wait_ratio": wait / window if window > 0 else 0.0,
        "wait_time_ratio": wait / (wait + train_time) if wait + train_time > 0 else 0.0,
        "rollout_idle_ratio": statistics.fmean(idle) if idle else 0.0, "critical_path_bound": bound,
        "efficiency": min(1.0, bound / window) if window > 0 else 0.0,
        "tokens_per_s": sum(lengths) / rollout_time if rollout_time > 0 else 0.0,
        "samples_per_s": len(lengths) / step_time if step_time > 0 else 0.0,
        "weight_version_min": min(versions, default=0), "weight_version_max": max(versions, default=0),
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0, "staleness_max": max(staleness, default=0),
        "staleness_hist": {str(k): staleness.count(k) for k in sorted(set(staleness))},
        "sync_bytes": sum(e.get("bytes", 0) for e in by["sync_end"]),
    }
    m.update({key: statistics.fmean(v) for key in TRAIN_STATS if (v := [end[key] for end in ends if key in end])})
    lags = sync_lags(events, starts)
    m.update(sync_lag_mean=statistics.fmean(lags) if lags else 0.0, sync_lag_max=max(lags, default=0))
    m.update(progress(events, step, t_end))
    return m


def sync_lags(events: list[dict[str, Any]], starts: list[dict[str, Any]]) -> list[int]:
    """Per trained sample: the weight syncs (sync_end versions) after the weights that made it, up
    to the trainer's version when the batch started (the last train_end's)."""
    lags = []
    for start in starts:
        before = [e for e in events if e["t"] <= start["t"] and e is not start]
        versions = [e["version"] for e in before if e["event"] == "train_end"]
        synced = [e["version"] for e in before if e["event"] == "sync_end"]
        for lag in start.get("staleness", []):
            lags.append(sum(1 for v in synced if versions[-1] - lag < v <= versions[-1]) if versions else 0)
    return lags


def progress(events: list[dict[str, Any]], step: int, t_end: float) -> dict[str, Any]:
    """The run's totals by this step's end: each earlier step's own samples and tokens (as its
    record counted them), every optimizer step and dropped group so far, the time since the start."""
    ends = [i for i, e in enumerate(events) if e["event"] == "step_end" and e["step"] <= step]
    samples = tokens = 0
    for i in ends:
        j = events[i]["step"]
        prefix = events[: i + 1]
        start = next(k for k, e in enumerate(prefix) if e["event"] == "step_start" and e["step"] == j)
        own = [e for e in prefix[start:] if e["event"] == "group_completed"]  # completed within step j
        samples += sum(len(e["rewards"]) for e in own)
        tokens += sum(sum(e["lengths"]) for e in own)
    dropped: dict[str, int] = {}
    for e in events:
        if e["event"] == "group_dropped":
            dropped[e["reason"]] = dropped.get(e["reason"], 0) + 1
    t0 = min(e["t"] for e in events if e["event"] in ("run_start", "step_start"))
    return {"optimizer_steps": sum(e["event"] == "train_end" for e in events), "samples_total": samples,
            "tokens_total": tokens, "elapsed_s": t_end - t0, "groups_dropped_total": sum(dropped.values()),
            "groups_dropped_by_reason": dropped}


MODES = {
    "sync": ["pipeline.mode=sync", "pipeline.admission=fifo", "run.steps=3"],
    "rolloutpipe-stream": ["pipeline.mode=rolloutpipe", "pipeline.admission=frontier", "run.steps=3",
                           "rollout.dynamic_sampling=true", "rollout.over_provision=0.25"],
    "rolloutpipe-whole-batches": ["pipeline.mode=rolloutpipe", "pipeline.admission=frontier", "run.steps=3",
                                  "pipeline.stream_train=false"],
    "async-finish": ["pipeline.mode=async", "pipeline.admission=frontier", "run.steps=5",
                     "pipeline.inflight_at_update=finish"],
    "async-abort_resume": ["pipeline.mode=async", "pipeline.admission=frontier", "run.steps=5",
                           "pipeline.inflight_at_update=abort_resume", "pipeline.max_staleness=2"],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_incremental_metrics_equal_the_whole_log_computation(mode):
    recipe = load_recipe(SIM, [*SMALL, *MODES[mode]], check_paths=False)
    run = simulate_run(recipe)
    events = run.events
    assert len(run.metrics) == recipe.run.steps
    step_ends = [i for i, e in enumerate(events) if e["event"] == "step_end"]
    for m, end in zip(run.metrics, step_ends):
        so_far = events[: end + 1]
        assert m == whole_log_metrics(so_far, m["step"]), f"step {m['step']}"
        assert step_metrics(so_far, m["step"]) == m
    assert all(0 <= m["efficiency"] <= 1 for m in run.metrics)  # the bound is never beaten, in any mode
    assert [m["optimizer_steps"] for m in run.metrics] == list(
        __import__("itertools").accumulate(m["train_batches"] for m in run.metrics))
    if mode == "sync":  # several optimizer steps per rollout batch, no sync between: behind in steps, not in syncs
        assert max(m["staleness_max"] for m in run.metrics) > 0 and all(m["sync_lag_max"] == 0 for m in run.metrics)
    # The runs exercise what crosses steps: async trains groups completed in an earlier step.
    if mode.startswith("async"):
        assert any(m["sync_lag_max"] >= 1 for m in run.metrics)
        step_of = {e["group"]: e["step"] for e in events if e["event"] == "group_completed"}
        assert any(step_of[g] < e["step"] for e in events if e["event"] == "train_start" for g in e["groups"])
    if mode == "rolloutpipe-stream":
        assert any(e["event"] == "accumulate_end" for e in events) and any(m["groups_dropped"] for m in run.metrics)
