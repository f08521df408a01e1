"""Pipeline invariants on real runs of every mode (real servers, trainer and controller).

In sync and rolloutpipe every trained sample has its step's weight version; in async the lag
never exceeds max_staleness; no group is trained twice, and every opened group ends in exactly
one event (completed, then trained or dropped; or aborted)."""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import FAST, QUICKSTART, rlctl
from rlctl.rundir import RunDir

pytestmark = pytest.mark.slow


def run(tmp_path, *overrides: str) -> list[dict]:
    res = rlctl("launch", str(QUICKSTART), *FAST, f"run.output_dir={tmp_path / 'runs'}", *overrides, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (path,) = (tmp_path / "runs").iterdir()
    return RunDir(path).events()


def check_accounting(events: list[dict], groups_per_batch: int = 4) -> tuple[list[int], dict]:
    admitted = [e["group"] for e in events if e["event"] == "group_admitted"]
    completed = [e["group"] for e in events if e["event"] == "group_completed"]
    dropped = {e["group"]: e["reason"] for e in events if e["event"] == "group_dropped"}
    trained = [g for e in events if e["event"] == "train_start" for g in e["groups"]]
    assert len(set(admitted)) == len(admitted)
    assert len(set(trained)) == len(trained), "a group was trained twice"
    assert not set(trained) & set(dropped), "a dropped group was trained"
    # Every admitted group is trained or dropped; only aborted groups never complete.
    assert set(admitted) == set(trained) | set(dropped)
    assert set(completed) == set(trained) | {g for g, why in dropped.items() if why != "aborted"}
    assert all(len(e["groups"]) == groups_per_batch for e in events if e["event"] == "train_start")
    return trained, dropped


@pytest.mark.parametrize("admission,stream", [("frontier", True), ("fifo", True), ("frontier", False)])
def test_rolloutpipe_is_on_policy(tmp_path, admission, stream):
    events = run(tmp_path, "pipeline.mode=rolloutpipe", f"pipeline.admission={admission}", "rollout.concurrency=4",
                 f"pipeline.stream_train={str(stream).lower()}")
    check_accounting(events)
    step_version = {e["step"]: e["version"] for e in events if e["event"] == "step_start"}
    assert step_version == {0: 0, 1: 2, 2: 4}
    for e in events:
        if e["event"] == "group_completed":
            assert set(e["versions"]) == {step_version[e["step"]]}
        if e["event"] == "train_start":
            assert e["versions"] == [step_version[e["step"]]]
    # Streaming: groups accumulated early are part of their batch's step, never a step of their own.
    accumulated = {g for e in events if e["event"] == "accumulate_end" for g in e["groups"]}
    batch_of = {g: (e["step"], e["batch"]) for e in events if e["event"] == "train_start" for g in e["groups"]}
    for e in events:
        if e["event"] == "accumulate_end":
            assert all(batch_of[g] == (e["step"], e["batch"]) for g in e["groups"])
    assert bool(accumulated) == stream
    if admission == "fifo":
        return
    # Frontier admission (8 requests in flight = 2 groups) completes groups in waves, and complete-
    # group pipelining starts training before the step's last group is ready.
    for step in step_version:
        first_train = min(e["t"] for e in events if e["event"] in ("train_start", "accumulate_start") and e["step"] == step)
        last_ready = max(e["t"] for e in events if e["event"] == "group_completed" and e["step"] == step)
        assert first_train < last_ready


def test_rolloutpipe_dynamic_sampling_keeps_batches_full(tmp_path):
    events = run(tmp_path, "pipeline.mode=rolloutpipe", "pipeline.admission=frontier", "rollout.dynamic_sampling=true",
                 "rollout.over_provision=0.5", "run.steps=2")
    trained, dropped = check_accounting(events)
    assert len(trained) == 2 * 8
    assert "all_equal" in dropped.values()  # a tiny half-trained model gets all-wrong groups
    for e in events:
        if e["event"] == "group_completed" and e["group"] in trained:
            assert len(set(e["rewards"])) > 1


@pytest.mark.parametrize("inflight", ["finish", "abort_resume"])
def test_async_staleness_is_bounded(tmp_path, inflight):
    events = run(tmp_path, "pipeline.mode=async", "pipeline.max_staleness=1", f"pipeline.inflight_at_update={inflight}",
                 "run.steps=6", "rollout.sampling.long_tail.enabled=true", "rollout.sampling.max_new_tokens=24")
    check_accounting(events)
    lags = [lag for e in events if e["event"] == "train_start" for lag in e["staleness"]]
    assert lags and max(lags) <= 1
    assert Counter(e["event"] for e in events)["sync_end"] == 6
    segments = [n for e in events if e["event"] == "group_completed" for n in e["segments"]]
    if inflight == "finish":
        assert set(segments) == {1}
    else:
        assert max(segments) >= 2, "no request was aborted and resumed at an update"
