"""Held-out evaluation: mean@k and pass@k as defined, when evaluations run in each pipeline mode
and that every one sees a single weight version (the same scheduler on simulated engines, in
virtual time), the recipe's eval section, and eval.jsonl read back by status and compare. A real
run's evaluations are in test_chat_rewards.py's e2e test."""

from __future__ import annotations

import json

import pytest

from conftest import QUICKSTART, REPO
from test_compare import base_recipe, make_run
from rlctl.errors import RecipeError
from rlctl.metrics.trace import chrome_trace
from rlctl.pipelines.evaluation import EvalResponse, Evaluator, eval_metrics
from rlctl.recipe import EvalConfig, load_recipe
from rlctl.run.compare import comparison
from rlctl.run.dir import RunDir
from rlctl.run.evals import eval_lines, eval_summary, read_evals
from rlctl.run.tracking import eval_loggable
from rlctl.sim.run import simulate_run


CLUSTER = REPO / "recipes" / "slurm-qwen3-1.7b.yaml"


def responses(rewards: list[list[float]], sources: list[str] | None = None) -> list[EvalResponse]:
    return [EvalResponse(n, sources[n] if sources else "", r, 3, "length" if r < 0 else "stop", 0)
            for n, rs in enumerate(rewards) for r in rs]


def test_mean_and_pass_at_k_by_their_definitions():
    # 3 prompts x 4: all right; one right in four; none right
    m = eval_metrics(responses([[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]]), k=4)
    assert m["mean@4"] == pytest.approx(5 / 12)
    assert m["pass@1"] == pytest.approx((1 + 0.25 + 0) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert (m["prompts"], m["k"], m["errors"]) == (3, 4, 0)


def test_correct_at_and_per_source_numbers():
    got = eval_metrics(responses([[0.6, 0.2], [0.9, 0.4]], sources=["gsm8k", "math"]), k=2, correct_at=0.5)
    assert got["pass@2"] == 1.0 and got["pass@1"] == pytest.approx(0.5)
    assert got["by_source"]["gsm8k"] == pytest.approx({"mean@2": 0.4, "pass@1": 0.5, "pass@2": 1.0})
    assert got["by_source"]["math"]["mean@2"] == pytest.approx(0.65)
    strict = eval_metrics(responses([[0.6, 0.2], [0.9, 0.4]]), k=2)  # correct_at 1.0: none is
    assert strict["pass@2"] == 0.0 and "by_source" not in strict


@pytest.mark.parametrize("every,before,at_end,steps,due", [
    (0, True, True, 5, [0, 5]),
    (2, True, True, 5, [0, 2, 4, 5]),
    (2, False, False, 6, [2, 4, 6]),
    (0, False, False, 5, []),
])
def test_when_evaluations_are_due(every, before, at_end, steps, due):
    e = Evaluator(EvalConfig(every=every, before=before, at_end=at_end), [], None, 1, None, None, None, None)
    assert [n for n in range(steps + 1) if e.due(n, steps)] == due


def eval_set(tmp_path, n: int = 12) -> str:
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"max({i},1,2)=", "answer": str(max(i, 2)),
                                        "data_source": "ab"[i % 2]}) + "\n" for i in range(n)))
    return str(path)


@pytest.mark.parametrize("mode", ["sync", "rolloutpipe", "async"])
def test_every_evaluation_sees_one_weight_version_and_no_rollout_runs_beside_it(tmp_path, mode):
    """Before training, every 2 steps and at the end; each evaluation's samples all of the version
    the trainer had then; no rollout sample is generated during an evaluation (async's first one
    aside, which runs beside rollout at version 0)."""
    # A cluster recipe's costs, so that an evaluation takes time; async resumes requests aborted at
    # the update, which would run during the evaluation if rollout were not paused.
    more = ["pipeline.max_staleness=4", "pipeline.inflight_at_update=abort_resume"] if mode == "async" else []
    recipe = load_recipe(CLUSTER, ["run.steps=5", f"pipeline.mode={mode}", "rollout.batch_size=8", "rollout.group_size=4",
                                   "train.groups_per_batch=4", "eval.every=2", *more,
                                   f"eval.sets=[{{path: {eval_set(tmp_path)}, samples: 3}}]"], check_paths=False)
    result = simulate_run(recipe)
    assert [e["steps"] for e in result.evals] == [0, 2, 4, 5]
    versions = {e["step"]: e["version"] for e in result.events if e["event"] == "step_end"}
    for e in result.evals:
        assert e["versions"] == [e["version"]] == [versions[e["steps"] - 1] if e["steps"] else 0]
        assert (e["prompts"], e["k"]) == (12, 3) and set(e["by_source"]) == {"a", "b"}
    spans, t_open = [], None
    for ev in result.events:
        if ev["event"] == "eval_start":
            t_open = ev["t"]
        elif ev["event"] == "eval_end":
            spans.append((t_open, ev["t"], ev["steps"]))
    assert [s for _, _, s in spans] == [0, 2, 4, 5] and all(b > a + 1.0 for a, b, _ in spans)
    trace = [e for e in chrome_trace(result.events)["traceEvents"] if e.get("cat") is None and e["pid"] == 3
             and e.get("tid") == 1 and e["ph"] == "X"]
    assert [e["args"]["version"] for e in trace] == [e["version"] for e in result.evals]
    generated = [(t0, t1) for ev in result.events if ev["event"] == "group_completed"
                 for t0, t1 in zip(ev["starts"], ev["ends"])]
    for a, b, steps in spans:
        if mode != "async" or steps:
            assert not [x for x in generated if x[0] < b and x[1] > a], f"rollout ran during the evaluation after {steps}"


def test_eval_sets_errors_name_the_item_and_key(tmp_path):
    good = eval_set(tmp_path)
    cases = {f"eval.sets=[{{path: {good}, samples: 0}}]": "eval.sets[0].samples: must be > 0",
             f"eval.sets=[{{path: {good}, bogus: 1}}]": "eval.sets[0].bogus: unknown key; valid keys: path, name,",
             f"eval.sets=[{{path: {good}}}, {{path: {good}, samples: many}}]": "eval.sets[1].samples: Value 'many'",
             f"eval.sets=[{{path: {good}}}, {{path: {good}}}]": "eval.sets[1].name: two sets are named 'heldout'",
             "eval.sets=[{path: /nonexistent.jsonl}]": "eval.sets[0].path: '/nonexistent.jsonl' does not exist",
             f"eval.sets=[{{path: {good}, reward: {{verifier: nope}}}}]": "eval.sets[0].reward.verifier: 'nope' is not one of",
             "run.steps=0": "run.steps: 0 trains nothing and only evaluates eval.sets"}
    for override, message in cases.items():
        with pytest.raises(RecipeError) as e:
            load_recipe(QUICKSTART, [override])
        assert message in str(e.value), override


def write_evals(path, lines: list[str]) -> RunDir:
    rd = make_run(path.parent, path.name, base_recipe("sync"), [0.1, 0.2])
    (path / "eval.jsonl").write_text("".join(line + "\n" for line in lines))
    return rd


def record(steps: int, **numbers) -> str:
    return json.dumps({"set": "gsm", "steps": steps, "version": steps * 4, "prompts": 8, "k": 4, **numbers})


def test_eval_jsonl_read_back_for_status_compare_and_wandb(tmp_path):
    """The first and latest evaluation per set; a damaged line skipped and counted; a step written
    twice (a resumed run) counted once, the later one."""
    a = write_evals(tmp_path / "a-1", [record(0, **{"mean@4": 0.1, "pass@4": 0.3}), "not json", '{"set": 3}',
                                     record(2, **{"mean@4": 0.2, "pass@4": 0.4}),
                                     record(2, **{"mean@4": 0.25, "pass@4": 0.5})])
    b = write_evals(tmp_path / "b-1", [record(2, **{"mean@4": 0.5, "pass@4": float("nan")})])
    sets, bad = read_evals(a)
    assert bad == 2 and [r["steps"] for r in sets["gsm"]] == [0, 2] and sets["gsm"][-1]["mean@4"] == 0.25
    (line,) = eval_lines(eval_summary(a))
    assert line == "eval gsm (8 prompts x 4): mean@4 0.100 -> 0.250, pass@4 0.300 -> 0.500 (0 -> 2 steps)"
    rows = comparison([a, b])["eval"]
    assert rows["gsm mean@4"][1] == {"first": 0.5, "last": 0.5, "steps": 2, "diff": pytest.approx(0.25)}
    assert rows["gsm pass@4"][1] is None  # not a finite number: not shown
    logged = eval_loggable({**json.loads(record(2, **{"pass@4": 0.5})), "by_source": {"x": {"pass@4": 0.7}}})
    assert logged == {"eval/gsm/pass@4": 0.5, "eval/gsm/x/pass@4": 0.7, "eval/gsm/prompts": 8, "eval/gsm/version": 8}


def test_a_resume_drops_the_evaluations_after_its_checkpoint(tmp_path):
    """Evaluations are run before the checkpoint of their step: a resume from the checkpoint after
    2 steps keeps those up to 2 steps and runs the later ones again."""
    from test_checkpoint_safety import a_checkpoint

    from rlctl.run.checkpoint import Checkpoint, prepare_resume
    from rlctl.run.dir import create_run_dir

    rd = create_run_dir(tmp_path / "runs", "r", "run: {}\n", {"launcher": "local", "steps_total": 6, "plan": None})
    rd.eval_path.write_text("".join(record(n, **{"mean@4": 0.1}) + "\n" for n in (0, 2, 4)))
    prepare_resume(rd, Checkpoint(2, a_checkpoint(rd.path / "checkpoints" / "step-000002")))
    assert [e["steps"] for e in rd.evals()] == [0, 2]
