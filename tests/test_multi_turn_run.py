"""A real multi-turn run: rlctl's built-in servers generate each turn over HTTP, the controller
parses the Hermes tool calls, runs the calculator in its tool workers and appends the results,
and the torch trainer trains on the model's tokens only. What only real processes show: the
trajectories' events, their samples and metrics, and every turn on-policy in rolloutpipe."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, rlctl
from rlctl.run.dir import RunDir

pytestmark = pytest.mark.e2e

SMALL = ["run.steps=3", "model.init.hidden_size=32", "model.init.head_dim=8", "model.init.intermediate_size=64",
         "model.init.warmup_steps=40", "rollout.batch_size=8", "rollout.group_size=4", "train.groups_per_batch=4",
         "pipeline.mode=rolloutpipe", "pipeline.admission=frontier", "rollout.concurrency=4",
         "run.sample_groups=1000"]  # every group's samples in samples.jsonl, so they match the events


def test_a_tool_calling_run_trains_on_trajectories_with_every_turn_on_policy(tmp_path):
    heldout = tmp_path / "heldout.jsonl"  # the task's own prompts: 2-digit products
    heldout.write_text("".join(json.dumps({"prompt": f"{a}*{b}=", "answer": str(a * b)}) + "\n"
                               for a, b in ((23, 47), (81, 19), (55, 64), (12, 99))))
    res = rlctl("launch", str(REPO / "recipes" / "tool-calc.yaml"), *SMALL, f"run.output_dir={tmp_path / 'runs'}",
                f"eval.sets=[{{path: {heldout}, samples: 8}}]", "eval.before=false", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (path,) = (tmp_path / "runs").iterdir()
    rd = RunDir(path)
    events = rd.events()
    step_version = {e["step"]: e["version"] for e in events if e["event"] == "step_start"}
    completed = [e for e in events if e["event"] == "group_completed"]
    assert completed and all("turns" in e and "tools" in e for e in completed)
    for e in completed:  # every turn of every sample at its step's weights
        for turns in e["turns"]:
            assert {v for turn in turns for v in turn[4]} == {step_version[e["step"]]}
    calls = [e for e in events if e["event"] == "tool_call"]
    assert calls and {e["name"] for e in calls if e["ok"]} <= {"calc"}
    # (a tiny model warmed up this briefly writes calls that do not parse, or name no tool it has:
    # each is answered with its error)
    assert all("error" in e for e in calls if not e["ok"])
    two_turns = [turns for e in completed for turns in e["turns"] if len(turns) == 2]
    assert two_turns  # a call, then the answer after the tool's result
    samples = [json.loads(line) for line in rd.samples_path.read_text().splitlines()]
    answered = [s for s in samples if s.get("turns") == 2]  # a second turn reads the first one's tool results
    assert len(samples) == sum(len(e["turns"]) for e in completed) and len(answered) == len(two_turns)
    assert all("<tool_call>" in s["trajectory"] and "<tool_response>" in s["trajectory"] for s in answered)
    metrics = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert all(m["tool_calls"] > 0 and 1.0 <= m["turns_per_sample"] <= 2.0 for m in metrics)
    (evaluation,) = rd.evals()  # at the end, in trajectories (a model this small calls in few of them)
    assert evaluation["k"] == 8 and {"turns_mean", "tool_calls_per_response"} <= set(evaluation), evaluation
    assert all(e["step"] >= 0 for e in calls)  # the evaluation's calls are no training events
    res = rlctl("samples", str(path), "--limit", "1", cwd=tmp_path)
    assert res.returncode == 0 and "trajectory (" in res.stdout, res.stdout + res.stderr
