"""Pipeline invariants of every mode: in sync and rolloutpipe every trained sample has its step's
weight version; in async the lag never exceeds max_staleness; no group is trained twice, and every
admitted group ends in exactly one event (completed, then trained or dropped; or aborted).

Each setting is checked in virtual time first (the same scheduler on simulated engines,
rlctl/sim/run.py: the fast tier), then on real runs (real servers, trainer and controller: the
e2e tier) for what only real engines show: streamed train batches accumulated on the trainer,
requests aborted and resumed at an update. sync's real run is in test_launch.py."""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import FAST, QUICKSTART, rlctl
from rlctl.errors import RunError
from rlctl.recipe import load_recipe
from rlctl.run.dir import RunDir
from rlctl.sim.run import simulate_run

ROLLOUTPIPE = [("frontier", True), ("fifo", True), ("frontier", False), ("fifo", False), ("longest", True),
               ("longest", False)]
ASYNC = ["pipeline.mode=async", "pipeline.max_staleness=1", "run.steps=6", "rollout.sampling.long_tail.enabled=true",
         "rollout.sampling.max_new_tokens=24"]
DYNAMIC = ["pipeline.mode=rolloutpipe", "pipeline.admission=frontier", "rollout.dynamic_sampling=true",
           "rollout.over_provision=0.5", "run.steps=2", "model.init.warmup_steps=60"]


def rolloutpipe(admission: str, stream: bool) -> list[str]:
    return ["pipeline.mode=rolloutpipe", f"pipeline.admission={admission}", "rollout.concurrency=4",
            f"pipeline.stream_train={str(stream).lower()}"]


def simulated(*overrides: str) -> list[dict]:
    """The events of the quickstart (FAST) with these overrides, run in virtual time."""
    return simulate_run(load_recipe(QUICKSTART, [*FAST, *overrides], check_paths=False)).events


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


def check_on_policy(events: list[dict]) -> dict[int, int]:
    """Every completed group and every train batch of step k has the step's weight version."""
    step_version = {e["step"]: e["version"] for e in events if e["event"] == "step_start"}
    assert step_version == {0: 0, 1: 2, 2: 4}
    for e in events:
        if e["event"] == "group_completed":
            assert set(e["versions"]) == {step_version[e["step"]]}
        if e["event"] == "train_start":
            assert e["versions"] == [step_version[e["step"]]]
    return step_version


def check_staleness(events: list[dict]) -> None:
    lags = [lag for e in events if e["event"] == "train_start" for lag in e["staleness"]]
    assert lags and max(lags) <= 1
    assert Counter(e["event"] for e in events)["sync_end"] == 6


def check_dynamic_sampling(events: list[dict]) -> None:
    trained, dropped = check_accounting(events)
    assert len(trained) == 2 * 8
    assert "all_equal" in dropped.values()  # a tiny half-trained model gets all-wrong groups
    for e in events:
        if e["event"] == "group_completed" and e["group"] in trained:
            assert len(set(e["rewards"])) > 1


# -- virtual time: every setting ------------------------------------------------------------------


@pytest.mark.parametrize("admission,stream", ROLLOUTPIPE)
def test_rolloutpipe_is_on_policy_in_virtual_time(admission, stream):
    events = simulated(*rolloutpipe(admission, stream))
    check_accounting(events)
    check_on_policy(events)


def test_longest_admission_stays_on_policy_on_a_dataset_read_again_with_prompt_lengths():
    """A dataset of 8 prompts read every step, lengths that belong to their prompts: what the
    length-aware policy learns from; every invariant holds."""
    events = simulated(*rolloutpipe("longest", True), "sim.dataset_prompts=8", "rollout.sampling.long_tail.enabled=true",
                       "rollout.sampling.long_tail.prompt_share=0.8", "rollout.sampling.max_new_tokens=64")
    check_accounting(events)
    check_on_policy(events)


def test_rolloutpipe_dynamic_sampling_keeps_batches_full_in_virtual_time():
    check_dynamic_sampling(simulated(*DYNAMIC))


def test_groups_cancelled_before_any_request_went_out_are_in_no_event():
    """Over-provisioned far past what one request at a time can start, most leftover groups at a
    step's end never had a request admitted: they are neither admitted nor dropped."""
    events = simulated(*DYNAMIC, "rollout.concurrency=1", "rollout.over_provision=2.0")
    check_dynamic_sampling(events)
    dropped = Counter(e["reason"] for e in events if e["event"] == "group_dropped")
    assert dropped["aborted"] >= 2, dropped  # the admitted leftovers are still recorded


@pytest.mark.parametrize("inflight", ["finish", "abort_resume"])
def test_async_staleness_is_bounded_in_virtual_time(inflight):
    events = simulated(*ASYNC, f"pipeline.inflight_at_update={inflight}")
    check_accounting(events)
    check_staleness(events)


# -- real runs: what only real engines show -------------------------------------------------------


@pytest.mark.e2e
def test_rolloutpipe_is_on_policy_and_streams_train_batches(tmp_path):
    """Frontier admission with streamed train batches: groups accumulated early are part of their
    batch's step, and complete-group pipelining starts training before a step's last group."""
    events = run(tmp_path, *rolloutpipe("frontier", True))
    check_accounting(events)
    step_version = check_on_policy(events)
    batch_of = {g: (e["step"], e["batch"]) for e in events if e["event"] == "train_start" for g in e["groups"]}
    accumulated = [e for e in events if e["event"] == "accumulate_end"]
    assert accumulated
    for e in accumulated:
        assert all(batch_of[g] == (e["step"], e["batch"]) for g in e["groups"])
    # Frontier admission (8 requests in flight = 2 groups) completes groups in waves, and complete-
    # group pipelining starts training before the step's last group is ready.
    for step in step_version:
        first_train = min(e["t"] for e in events if e["event"] in ("train_start", "accumulate_start") and e["step"] == step)
        last_ready = max(e["t"] for e in events if e["event"] == "group_completed" and e["step"] == step)
        assert first_train < last_ready


@pytest.mark.e2e
def test_rolloutpipe_whole_train_batches_with_dynamic_sampling(tmp_path):
    """stream_train=false: nothing reaches the trainer before its train batch is whole; dynamic
    sampling drops the groups whose rewards are all equal and keeps every batch full."""
    events = run(tmp_path, *DYNAMIC, "pipeline.stream_train=false", "rollout.concurrency=4")
    check_dynamic_sampling(events)
    assert not any(e["event"] == "accumulate_end" for e in events)


@pytest.mark.e2e
@pytest.mark.parametrize("inflight", ["finish", "abort_resume"])
def test_async_staleness_is_bounded(tmp_path, inflight):
    events = run(tmp_path, *ASYNC, f"pipeline.inflight_at_update={inflight}")
    check_accounting(events)
    check_staleness(events)
    segments = [n for e in events if e["event"] == "group_completed" for n in e["segments"]]
    if inflight == "finish":
        assert set(segments) == {1}
    else:
        assert max(segments) >= 2, "no request was aborted and resumed at an update"


@pytest.mark.parametrize("mode", ["sync", "rolloutpipe", "async"])
def test_dynamic_sampling_with_every_reward_equal_fails_saying_so_instead_of_drawing_for_ever(mode):
    recipe = load_recipe(QUICKSTART, [*FAST, f"pipeline.mode={mode}", "rollout.dynamic_sampling=true",
                                      "sim.reward_rate=0", "rollout.max_gen_batches=3"], check_paths=False)
    with pytest.raises(RunError, match=r"dynamic sampling dropped 24 groups in a row whose rewards were all equal"):
        simulate_run(recipe)
