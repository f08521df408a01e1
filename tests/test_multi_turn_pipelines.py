"""Trajectories of turns (rollout.multi_turn) keep every pipeline mode's promises, checked in
virtual time on simulated engines and tools (sim.tools: a turn calls a tool at random, the tool
takes lognormal virtual seconds): in sync and rolloutpipe every turn of every trained sample is
generated at its step's weights; in async the lag counted from a trajectory's oldest turn stays
within max_staleness; a trajectory waiting on its tools holds no admission slot; every tool call
is an event, and the trace draws it inside its sample's slice."""

from __future__ import annotations

import pytest

from rlctl.metrics.trace import LANE_STRIDE, chrome_trace
from test_pipelines import ASYNC, check_accounting, check_on_policy, check_staleness, rolloutpipe, simulated

MULTI_TURN = ["rollout.multi_turn.enabled=true", "rollout.multi_turn.max_turns=3", "rollout.multi_turn.max_tokens=120",
              "rollout.sampling.max_new_tokens=16", "sim.tools.latency_median_s=0.5", "sim.tools.call_prob=0.7"]


def trajectories(events: list[dict]) -> list[tuple[dict, int]]:
    return [(e, i) for e in events if e["event"] == "group_completed" for i in range(len(e["turns"]))]


def check_turns_on_policy(events: list[dict]) -> None:
    step_version = check_on_policy(events)
    many = 0
    for e, i in trajectories(events):
        turns = e["turns"][i]
        many += len(turns) > 1
        assert {v for turn in turns for v in turn[4]} == {step_version[e["step"]]}, (e["group"], i, turns)
    assert many >= 10  # trajectories of several turns, not single responses


def check_tool_events(events: list[dict]) -> None:
    calls = [e for e in events if e["event"] == "tool_call"]
    admitted = {e["group"] for e in events if e["event"] == "group_admitted"}
    assert calls and all(e["group"] in admitted and e["seconds"] >= 0 for e in calls)
    in_groups = sum(len(e["tools"][i]) for e, i in trajectories(events))
    assert in_groups <= len(calls)  # groups aborted at a step's end made calls no completed group lists
    for e, i in trajectories(events):
        turns, tools = e["turns"][i], e["tools"][i]
        # A call is answered by a next turn, unless the trajectory ended with it (its last allowed
        # turn called, or the results did not fit in max_tokens).
        assert len(tools) <= len(turns) - (e["finish_reasons"][i] == "stop")
        for (_, t_call, seconds, _), (_, _, turn_end, *_), (_, next_start, *_) in zip(tools, turns, turns[1:]):
            assert turn_end <= t_call and t_call + seconds <= next_start + 1e-6  # seconds rounded to 1 us


@pytest.mark.parametrize("settings", [[], *(rolloutpipe(a, s) for a, s in (("frontier", True), ("fifo", False),
                                                                            ("longest", True)))])
def test_every_turn_is_on_policy_in_sync_and_rolloutpipe(settings):
    events = simulated(*MULTI_TURN, *settings)
    check_accounting(events)
    check_turns_on_policy(events)
    check_tool_events(events)


@pytest.mark.parametrize("inflight", ["finish", "abort_resume"])
def test_async_counts_staleness_from_a_trajectorys_oldest_turn(inflight):
    events = simulated(*MULTI_TURN, *ASYNC, f"pipeline.inflight_at_update={inflight}", "rollout.multi_turn.max_tokens=200")
    check_accounting(events)
    check_staleness(events)
    for e, i in trajectories(events):
        versions = [v for turn in e["turns"][i] for v in turn[4]]
        assert e["versions"][i] == min(versions)  # the sample's version is its oldest turn's
    spread = [max(v) - min(v) for e, i in trajectories(events) if (v := [x for t in e["turns"][i] for x in t[4]])]
    assert max(spread) >= 1  # some trajectory's turns span a weight update, and its lag counts from the oldest
    check_tool_events(events)


def test_a_trajectory_waiting_on_its_tools_holds_no_admission_slot():
    """One server, one request at a time (frontier, concurrency 1), turns of an 8B model, tools
    of a second: the server never runs two turns at once, and runs turns while tools run."""
    events = simulated(*MULTI_TURN, *rolloutpipe("frontier", True), "rollout.concurrency=1", "sim.rollout_gpus=1",
                       "sim.params_b=8", "sim.tools.latency_median_s=1.0", "run.steps=1")
    turns = sorted((t[1], t[2]) for e, i in trajectories(events) for t in e["turns"][i])
    assert all(b0 <= a1 + 1e-9 for (_, b0), (a1, _) in zip(turns, turns[1:])), "two turns ran at once"
    tools = [(e["t"], e["t"] + e["seconds"]) for e in events if e["event"] == "tool_call"]
    during = [(a, b) for a, b in turns if any(c < a and b < d for c, d in tools)]
    assert len(during) >= len(tools) // 2, (len(during), len(tools))


def test_tool_metrics_and_trace_lanes():
    events = simulated(*MULTI_TURN, "run.steps=2")
    from rlctl.metrics.step import step_metrics

    m = step_metrics(events, 1)
    calls = [e for e in events if e["event"] == "tool_call" and e["step"] == 1]
    assert m["tool_calls"] == len(calls) and m["tool_call_ok_ratio"] == 1.0
    assert m["tool_seconds"] == pytest.approx(sum(e["seconds"] for e in calls))
    assert 1.0 < m["turns_per_sample"] <= 3 and 0.0 <= m["rollout_idle_tool_ratio"] <= m["rollout_idle_ratio"] <= 1.0
    trace = chrome_trace(events)["traceEvents"]
    slices = [e for e in trace if e.get("ph") == "X" and e["pid"] == 1]
    parents = [e for e in slices if e["name"].startswith("g")]
    tools = [e for e in slices if e["name"] == "tool"]
    assert tools and len(tools) == sum(p["args"]["tool_calls"] for p in parents)
    for tool in tools:  # on the lane of a sample whose slice holds it
        assert any(p["tid"] == tool["tid"] and p["ts"] <= tool["ts"] and tool["ts"] + tool["dur"] <= p["ts"] + p["dur"] + 0.2
                   for p in parents), tool
    assert max(e["tid"] for e in slices) >= LANE_STRIDE  # samples side by side on lanes


def test_status_says_what_tools_took_in_the_last_step():
    from rlctl.commands.status import _metrics_lines
    from rlctl.metrics.step import step_metrics

    m = step_metrics(simulated(*MULTI_TURN, "run.steps=1"), 0)
    (line,) = [x for x in _metrics_lines(m) if x.startswith("tools: ")]
    assert f"{m['tool_calls']} calls (100% ok" in line and "model turns a sample" in line
    assert not any(x.startswith("tools: ") for x in _metrics_lines(step_metrics(simulated("run.steps=1"), 0)))


def test_simulate_prints_the_tool_columns_for_a_multi_turn_recipe():
    from rlctl.commands.simulate import render_metrics
    from rlctl.recipe import load_recipe
    from rlctl.sim.run import simulate_run
    from test_pipelines import FAST, QUICKSTART

    metrics = simulate_run(load_recipe(QUICKSTART, [*FAST, *MULTI_TURN], check_paths=False)).metrics
    head, *rows = render_metrics(metrics).splitlines()
    assert head.split()[-7:] == ["turns", "calls", "tool", "max", "s", "idle", "tools"] and len(rows) == 3
    assert "calls" not in render_metrics(simulate_run(load_recipe(QUICKSTART, FAST, check_paths=False)).metrics)


def test_an_evaluation_runs_trajectories_with_the_runs_tools(tmp_path):
    """eval.sets with rollout.multi_turn: each response is a trajectory of the same loop (turns,
    tool calls), summed up in the eval record; its tool calls are not training's events."""
    from rlctl.recipe import load_recipe
    from rlctl.sim.run import simulate_run
    from test_eval import eval_set
    from test_pipelines import FAST, QUICKSTART

    keys = [*FAST, *MULTI_TURN, "run.steps=2", "eval.every=1", f"eval.sets=[{{path: {eval_set(tmp_path, 6)}, samples: 4}}]"]
    result = simulate_run(load_recipe(QUICKSTART, keys, check_paths=False))
    assert [e["steps"] for e in result.evals] == [0, 1, 2]
    for e in result.evals:
        assert (e["prompts"], e["k"]) == (6, 4) and e["versions"] == [e["version"]]
        assert 1.0 < e["turns_mean"] <= 3.0 and e["tool_calls_per_response"] > 0 and 0 < e["tool_call_ok_ratio"] <= 1
    calls = [e for e in result.events if e["event"] == "tool_call"]
    assert len(calls) == sum(len(tools) for e, i in trajectories(result.events) for tools in [e["tools"][i]])
    single = simulate_run(load_recipe(QUICKSTART, [k for k in keys if not k.startswith("rollout.multi_turn")],
                                      check_paths=False))
    assert single.evals and not any("turns_mean" in e for e in single.evals)
