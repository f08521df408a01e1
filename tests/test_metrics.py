"""Per-step metrics from a hand-built event timeline."""

from __future__ import annotations

import pytest

from rlctl.metrics import chrome_trace, step_metrics


def timeline():
    # Step 0 (sync-like): rollout 0..4 s, two train batches 4..5 and 5..7, sync 7..7.5.
    e = [
        {"t": 0.0, "event": "step_start", "step": 0, "version": 0},
        {"t": 0.0, "event": "group_admitted", "step": 0, "group": 0},
        {"t": 0.0, "event": "group_admitted", "step": 0, "group": 1},
        {"t": 2.0, "event": "group_completed", "step": 0, "group": 0, "rewards": [1, 0], "lengths": [2, 4],
         "versions": [0, 0], "servers": ["r0", "r1"], "starts": [0.0, 0.0], "ends": [1.0, 2.0]},
        {"t": 4.0, "event": "group_completed", "step": 0, "group": 1, "rewards": [1, 1], "lengths": [6, 8],
         "versions": [0, 0], "servers": ["r0", "r1"], "starts": [0.5, 2.0], "ends": [3.0, 4.0]},
        {"t": 4.0, "event": "train_start", "step": 0, "batch": 0, "groups": [0], "staleness": [0, 0]},
        {"t": 5.0, "event": "train_end", "step": 0, "batch": 0, "loss": 1.0},
        {"t": 5.0, "event": "train_start", "step": 0, "batch": 1, "groups": [1], "staleness": [1, 1]},
        {"t": 7.0, "event": "train_end", "step": 0, "batch": 1, "loss": 3.0},
        {"t": 7.0, "event": "sync_start", "step": 0},
        {"t": 7.5, "event": "sync_end", "step": 0, "bytes": 100},
        {"t": 7.5, "event": "step_end", "step": 0},
        {"t": 7.5, "event": "step_start", "step": 1, "version": 2},
    ]
    return e


def test_sync_step_metrics():
    m = step_metrics(timeline(), 0)
    assert m["reward_mean"] == 0.75
    assert m["response_len_mean"] == 5.0
    assert m["response_len_max"] == 8
    assert m["rollout_time"] == 4.0
    assert m["train_time"] == 3.0
    assert m["sync_time"] == 0.5
    assert m["step_time"] == 7.5
    assert m["rollout_to_train_end"] == 7.0
    assert m["wait_time"] == 4.0
    assert m["trainer_wait_ratio"] == pytest.approx(4 / 7)
    assert m["wait_time_ratio"] == pytest.approx(4 / 7)
    # bound = max(last ready 4 + last batch 2, first ready 2 + total train 3) = 6 -> efficiency 6/7
    assert m["critical_path_bound"] == 6.0
    assert m["efficiency"] == pytest.approx(6 / 7)
    assert m["tokens_per_s"] == 20 / 4.0
    assert m["loss"] == 2.0
    assert (m["weight_version_min"], m["weight_version_max"]) == (0, 0)
    assert m["staleness_hist"] == {"0": 2, "1": 2} and m["staleness_max"] == 1
    # r0 busy 0..3, r1 busy 0..4, of a 7.5 s step.
    assert m["rollout_idle_ratio"] == pytest.approx(1 - (3 / 7.5 + 4 / 7.5) / 2)


def test_a_colocated_step_counts_its_turns():
    e = timeline()
    assert "turn_time" not in step_metrics(e, 0)  # not colocated: no such metric
    e.insert(5, {"t": 4.0, "event": "colocate_turn", "to": "trainer", "start": 4.0, "seconds": 0.25})
    e.insert(-2, {"t": 7.5, "event": "colocate_turn", "to": "servers", "start": 7.0, "seconds": 0.125})
    assert step_metrics(e, 0)["turn_time"] == 0.375


def test_async_step_trains_groups_that_were_ready_before_it():
    e = [
        {"t": 0.0, "event": "step_start", "step": 0, "version": 0},
        {"t": 0.0, "event": "group_admitted", "step": 0, "group": 0},
        {"t": 3.0, "event": "group_completed", "step": 0, "group": 0, "rewards": [1, 0], "lengths": [1, 1],
         "versions": [0, 0]},
        {"t": 3.0, "event": "train_start", "step": 0, "batch": 0, "groups": [0]},
        {"t": 4.0, "event": "train_end", "step": 0, "batch": 0},
        {"t": 4.0, "event": "step_end", "step": 0},
        {"t": 4.0, "event": "step_start", "step": 1, "version": 1},
        {"t": 4.0, "event": "group_admitted", "step": 1, "group": 1},
        {"t": 4.5, "event": "train_start", "step": 1, "batch": 1, "groups": [7]},
        {"t": 6.5, "event": "train_end", "step": 1, "batch": 1},
        {"t": 6.5, "event": "step_end", "step": 1},
        {"t": 1.0, "event": "group_completed", "step": 0, "group": 7, "rewards": [0, 1], "lengths": [1, 1],
         "versions": [0, 0]},
    ]
    m = step_metrics(e, 1)
    # Group 7 was ready long before step 1: the bound is the train time alone.
    assert m["critical_path_bound"] == 2.0
    assert m["rollout_to_train_end"] == 2.5 and m["efficiency"] == pytest.approx(0.8)


def test_overlapped_step_waits_less():
    e = timeline()
    # Same work, but the first train batch starts as soon as group 0 is ready (t=2).
    for ev in e:
        if ev["event"] == "train_start" and ev["batch"] == 0:
            ev["t"] = 2.0  # group 0 is ready at 2
        if ev["event"] == "train_end" and ev["batch"] == 0:
            ev["t"] = 3.0
        if ev["event"] == "train_start" and ev["batch"] == 1:
            ev["t"] = 4.0
        if ev["event"] == "train_end" and ev["batch"] == 1:
            ev["t"] = 6.0
    m = step_metrics(e, 0)
    assert m["rollout_to_train_end"] == 6.0
    assert m["efficiency"] == 1.0
    assert m["trainer_wait_ratio"] == pytest.approx(3 / 6)


def test_streamed_batch_counts_its_accumulate_calls_as_training():
    """One train batch of groups 0 and 1, streamed: group 0 is accumulated at 2..2.5 while group 1
    is still generating; the final call (group 1 and the optimizer step) runs 4..5."""
    e = [ev for ev in timeline() if ev["event"] not in ("train_start", "train_end")]
    e += [
        {"t": 2.0, "event": "accumulate_start", "step": 0, "batch": 0, "groups": [0]},
        {"t": 2.5, "event": "accumulate_end", "step": 0, "batch": 0, "groups": [0], "tokens": 6, "samples": 2},
        {"t": 4.0, "event": "train_start", "step": 0, "batch": 0, "groups": [0, 1], "staleness": [0, 0, 0, 0]},
        {"t": 5.0, "event": "train_end", "step": 0, "batch": 0, "loss": 1.0},
    ]
    m = step_metrics(e, 0)
    assert m["train_batches"] == 1
    assert m["train_time"] == 1.5  # 0.5 accumulating + 1.0 in the final call
    assert m["rollout_to_train_end"] == 5.0
    assert m["wait_time"] == 3.5
    # bound = max(last ready 4 + final call 1, first ready 2 + all training 1.5) = 5: no avoidable wait
    assert m["critical_path_bound"] == 5.0 and m["efficiency"] == 1.0
    trace = chrome_trace(e)["traceEvents"]
    names = sorted(x["name"] for x in trace if x.get("pid") == 2 and x["ph"] == "X")
    assert names == ["accumulate batch 0", "train batch 0", "weight sync v?"]


def test_missing_step_is_an_error():
    with pytest.raises(ValueError):
        step_metrics(timeline(), 5)


def test_chrome_trace_has_a_track_per_server_and_rank():
    from rlctl.metrics import chrome_trace

    trace = chrome_trace(timeline(), trainer_ranks=2)["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    # r0 ran two samples at once: the second is on r0's second lane
    assert names == {(1, 0): "r0", (1, 1): "r1", (2, 0): "trainer-0", (2, 1): "trainer-1", (3, 0): "steps",
                     (1, 100000): "r0 #2"}
    assert_slices_nest(trace)
    samples = [e for e in trace if e["ph"] == "X" and e["pid"] == 1]
    assert len(samples) == 4 and all(e["dur"] > 0 for e in samples)
    trains = [e for e in trace if e["ph"] == "X" and e["pid"] == 2 and e["name"].startswith("train")]
    assert sorted((e["tid"], e["ts"], e["dur"]) for e in trains) == [
        (0, 4e6, 1e6), (0, 5e6, 2e6), (1, 4e6, 1e6), (1, 5e6, 2e6)]
    assert [e["name"] for e in trace if e["pid"] == 3 and e["ph"] == "X"] == ["step 0"]


def test_a_colocated_runs_turns_have_a_track_of_their_own():
    from rlctl.metrics import chrome_trace

    e = timeline()
    e.insert(5, {"t": 4.25, "event": "colocate_turn", "to": "trainer", "start": 4.0, "seconds": 0.25})
    trace = chrome_trace(e)["traceEvents"]
    assert {"name": "thread_name", "ph": "M", "pid": 3, "tid": 2, "args": {"name": "colocated turns"}} in trace
    (turn,) = [x for x in trace if x["ph"] == "X" and (x["pid"], x["tid"]) == (3, 2)]
    assert (turn["name"], turn["ts"], turn["dur"]) == ("to trainer", 4e6, 0.25e6)
    assert "colocated turns" not in str(chrome_trace(timeline()))  # a run that is not colocated has none


def test_trace_opens_at_the_run_start_whatever_other_writers_stamped():
    """`rlctl launch` on a login node recorded the submission three days before the job ran, and
    `rlctl status` there recorded the end a day after: the trace still spans the run alone."""
    day = 86400.0
    e = [{"t": -3 * day, "event": "submitted", "host": "login-1", "job_id": 7},
         {"t": -0.5, "event": "server_up", "host": "node-2", "role": "r0"},
         {"t": -0.1, "event": "run_start", "host": "node-1", "steps": 1, "mode": "sync"},
         *timeline(),
         {"t": 8.0, "event": "server_down", "host": "node-2", "role": "r0"},
         {"t": day, "event": "run_end", "host": "login-1", "state": "failed"}]
    trace = chrome_trace(e)["traceEvents"]
    timed = [x for x in trace if "ts" in x]
    assert min(x["ts"] for x in timed) == 0.1e6  # step 0 starts 0.1 s after run_start
    assert max(x["ts"] + x.get("dur", 0) for x in timed) == pytest.approx(8.1e6)
    assert [x["name"] for x in trace if x["ph"] == "i"] == ["server_down"]


def assert_slices_nest(trace: list[dict]) -> None:
    """The Chrome trace format's rule for complete ("X") events on one thread: each one ends
    before the next begins, or encloses it (what Perfetto can draw as a stack)."""
    by_thread: dict[tuple, list[dict]] = {}
    for e in trace:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for thread, slices in by_thread.items():
        open_ends: list[float] = []
        for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1], f"{thread}: {e['name']} partly overlaps the slice it starts in"
            open_ends.append(end)


def test_concurrent_requests_of_one_server_are_dealt_onto_lanes_that_nest():
    """A server running up to 5 requests at once, started and ended in every order."""
    import random

    from rlctl.metrics import chrome_trace

    rng = random.Random(3)
    events = [{"t": 0.0, "event": "run_start"}]
    for g in range(40):
        starts = [rng.uniform(0, 10) for _ in range(2)]
        ends = [a + rng.uniform(0.01, 3) for a in starts]
        events.append({"t": max(ends), "event": "group_completed", "step": 0, "group": g, "servers": ["r0", "r1"],
                       "starts": starts, "ends": ends, "lengths": [1, 1], "rewards": [0, 1], "versions": [0, 0]})
    trace = chrome_trace(events)["traceEvents"]
    assert_slices_nest(trace)
    samples = [e for e in trace if e["ph"] == "X"]
    assert len(samples) == 80 and {e["tid"] % 100000 for e in samples} == {0, 1}
    lanes = {e["tid"] for e in samples if e["tid"] % 100000 == 0}
    assert len(lanes) > 3  # as many lanes as requests overlapped at once
    named = {e["tid"] for e in trace if e["name"] == "thread_name" and e["pid"] == 1}
    assert lanes <= named
    with pytest.raises(AssertionError, match="partly overlaps"):  # the check itself can fail
        assert_slices_nest([{"ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 2, "name": "a"},
                            {"ph": "X", "pid": 1, "tid": 0, "ts": 1, "dur": 2, "name": "b"}])
