"""Rewards that fail loudly: a verifier that raises or runs past reward.timeout_s fails the run
saying why (or, with reward.on_error=zero, scores 0 until reward.max_errors), and a reward
function that cannot be loaded is refused with the recipe (fast tier: no process, no socket)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import FAST, QUICKSTART, rlctl_here
from rlctl.data import Prompt
from rlctl.errors import RecipeError, RunError
from rlctl.recipe.checks import clip_message
from rlctl.metrics import KeptEvents, Recorder
from rlctl.pipelines.build import build_pipeline
from rlctl.pipelines.scoring import PooledScorer, ScoringWorker, inline_scorer, scoring_reply, serve
from rlctl.costs.recipe import cost_model
from rlctl.recipe import RewardConfig, load_recipe
from rlctl.recipe.choices import RewardOnError
from rlctl.rewards.failures import RewardError, RewardErrors, VerifierFailed, excerpt
from rlctl.rewards.verifiers import Scored, make_verifier, scored_by
from rlctl.sim.engines import SimRollout, SimTrainer
from rlctl.sim.loop import VirtualClock, run_virtual


def reward_module(directory: Path, body: str) -> str:
    """A reward module of a name no other test imports (modules are cached by name); its name."""
    name = f"reward_{uuid.uuid4().hex[:12]}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(body)
    return name


def recipe_in(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "recipe.yaml"
    path.write_text(QUICKSTART.read_text())
    return path


# -- the recipe: reward.function beside the recipe, imported and checked at load ------------------


def test_a_reward_module_beside_the_recipe_loads_without_pythonpath(tmp_path):
    recipe = recipe_in(tmp_path / "exp")
    name = reward_module(tmp_path / "exp", "def score(response, answer):\n    return float(response == answer)\n")
    r = load_recipe(recipe, ["reward.verifier=function", f"reward.function={name}:score"])
    assert r.reward.module_dir == str(tmp_path / "exp")
    verify = make_verifier(r.reward)
    assert (verify("9", "9").reward, verify("8", "9").reward) == (1.0, 0.0)


def test_module_dir_is_relative_to_the_recipe_not_the_current_directory(tmp_path, monkeypatch):
    recipe = recipe_in(tmp_path / "exp")
    name = reward_module(tmp_path / "exp" / "lib", "def score(response, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    r = load_recipe(recipe, ["reward.verifier=function", f"reward.function={name}:score", "reward.module_dir=lib"])
    assert r.reward.module_dir == str(tmp_path / "exp" / "lib")
    # the run's resolved recipe keeps the absolute directory: loaded from elsewhere, it stays
    again = load_recipe(recipe, ["reward.verifier=function", f"reward.function={name}:score",
                                 f"reward.module_dir={tmp_path / 'exp' / 'lib'}"])
    assert again.reward.module_dir == r.reward.module_dir


BAD_FUNCTIONS = {
    "missing-module": ("", "nosuchmodule_{n}:score", "no module 'nosuchmodule_"),
    "missing-callable": ("def score(response, answer):\n    return 1.0\n", "{n}:scor", "has no 'scor'; name a function"),
    "not-callable": ("score = 3\n", "{n}:score", "is not callable (its type is int)"),
    "one-parameter": ("def score(response):\n    return 1.0\n", "{n}:score",
                      "cannot be called as a reward: it names no parameter for the answer"),
    "unnamed-keyword-only": ("def score(*, r, a):\n    return 1.0\n", "{n}:score",
                             "it takes neither (response, answer) as its first two parameters nor parameters named"),
    "positional-only-by-name": ("def score(response, /, answer):\n    return 1.0\n", "{n}:score",
                                "positional-only parameters cannot be passed by name"),
    "raises-on-import": ("raise RuntimeError('no GPU here')\n", "{n}:score",
                         "importing '{n}' raised RuntimeError: no GPU here; fix the module"),
    "imports-a-missing-package": ("import nosuchpackage_xyz\n", "{n}:score", "install what it imports"),
    "no-colon": ("", "{n}.score", "is not of the form module:callable"),
}


@pytest.mark.parametrize("case", BAD_FUNCTIONS)
def test_a_reward_function_that_cannot_be_called_is_refused_with_the_recipe(tmp_path, case):
    body, function, said = BAD_FUNCTIONS[case]
    recipe = recipe_in(tmp_path)
    n = reward_module(tmp_path, body)
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, ["reward.verifier=function", f"reward.function={function.format(n=n)}"])
    assert (e.value.file, e.value.key) == ("<overrides>", "reward.function")
    assert said.format(n=n) in e.value.message and "\n" not in str(e.value)


def test_launch_refuses_a_misspelled_callable_in_one_line_and_creates_nothing(tmp_path):
    recipe = recipe_in(tmp_path / "exp")
    name = reward_module(tmp_path / "exp", "def score(response, answer):\n    return 1.0\n")
    res = rlctl_here("launch", str(recipe), "reward.verifier=function", f"reward.function={name}:scroe",
                     f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 2
    said = f"module '{name}' ({tmp_path / 'exp' / name}.py) has no 'scroe'; name a function defined in it"
    assert res.stderr.strip().splitlines() == [f"error: <overrides>: reward.function: {clip_message(said)}"]  # a deep tmp dir's path is cut
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("override,said", [
    ("reward.timeout_s=0", "reward.timeout_s: must be > 0"),
    ("reward.timeout_s=1e9", "reward.timeout_s: must be <= 86,400"),
    ("reward.max_errors=-1", "reward.max_errors: must be >= 0"),
    ("reward.on_error=skip", "reward.on_error: 'skip' is not one of fail, zero"),
    ("reward.module_dir=lib", "reward.module_dir: only used with reward.verifier=function"),
])
def test_reward_keys_out_of_bounds(tmp_path, override, said):
    with pytest.raises(RecipeError, match=said):
        load_recipe(recipe_in(tmp_path), [override])


def test_a_simulation_does_not_import_the_reward_function(tmp_path):
    recipe = recipe_in(tmp_path)
    r = load_recipe(recipe, ["reward.verifier=function", "reward.function=nosuchmodule_sim:score"], check_paths=False)
    assert r.reward.function == "nosuchmodule_sim:score"


# -- what a failure says, and what the run does with it -------------------------------------------


def failing(verify: Callable[[str, str], float], response: str = "the response") -> VerifierFailed:
    """The VerifierFailed that scoring `response` with `verify` gives."""
    with pytest.raises(VerifierFailed) as e:
        asyncio.run(inline_scorer(lambda ids: response, verify)([1, 2], Prompt(0, "max(1,9)=", "9")))
    return e.value


def test_a_raising_verifier_fails_with_its_traceback_from_the_users_code(tmp_path):
    name = reward_module(tmp_path, "def score(response, answer):\n    return 1 / 0\n")
    verify = make_verifier(RewardConfig(verifier="function", function=f"{name}:score", module_dir=str(tmp_path)))
    failure = failing(verify)
    assert failure.error == "ZeroDivisionError: division by zero"
    assert failure.response == "the response"
    frames = [line for line in failure.traceback.splitlines() if line.strip().startswith("File ")]
    assert f"{name}.py" in frames[0] and len(frames) == 1, failure.traceback  # rlctl's own frames left out
    assert failure.traceback.rstrip().endswith("ZeroDivisionError: division by zero")


@pytest.mark.parametrize("returned,said", [("None", "returned None, not a number"), ("float('nan')", "returned nan"),
                                           ("'high'", "returned 'high', not a number")])
def test_a_reward_function_that_returns_no_number_is_a_reward_error(tmp_path, returned, said):
    name = reward_module(tmp_path, f"def score(response, answer):\n    return {returned}\n")
    verify = make_verifier(RewardConfig(verifier="function", function=f"{name}:score", module_dir=str(tmp_path)))
    assert said in failing(verify).error


def test_a_scoring_says_the_verifiers_error_by_its_last_line_or_its_reward():
    kind, error, tb = scoring_reply("resp", ("9", "max(1,9)=", {}), scored_by(lambda r, a: {}["missing"]))
    assert (kind, error) == ("error", "KeyError: 'missing'") and "Traceback" in tb
    assert scoring_reply("9", ("9", "max(1,9)=", {}), scored_by(lambda r, a: float(r == a)))[:2] == ("reward", 1.0)


def test_excerpt_keeps_the_first_and_last_lines_each_cut():
    text = "\n".join(f"line {i} " + "x" * 300 for i in range(50))
    cut = excerpt(text).splitlines()
    assert len(cut) == 5 and cut[2] == "... (46 lines cut) ..."
    assert cut[0].startswith("line 0 ") and cut[-1].startswith("line 49 ") and all(len(c) <= 200 for c in cut)


def test_on_error_fail_raises_with_the_last_line_and_records_the_sample(caplog):
    errors = RewardErrors(RewardOnError.FAIL, 100, "reward.function m:score")
    events: list[tuple[str, dict]] = []
    failure = VerifierFailed("a\nlong\nresponse\nof\nsix\nlines", "ZeroDivisionError: division by zero",
                             "Traceback (most recent call last):\n  File \"m.py\"\nZeroDivisionError: division by zero\n")
    with caplog.at_level(logging.INFO, "rlctl.rewards"), pytest.raises(RewardError) as e:
        errors.failed(failure, lambda kind, t, **f: events.append((kind, f)), 1.0, prompt="max(1,2)=", answer="2",
                      step=3, group=7, sample=1)
    assert str(e.value).startswith("reward.function m:score failed on a response of step 3: "
                                   "ZeroDivisionError: division by zero")
    ((kind, fields),) = events
    assert kind == "reward_error" and fields["step"] == 3 and fields["scored_zero"] is False
    assert fields["response"] == "a\nlong\n... (2 lines cut) ...\nsix\nlines" and fields["answer"] == "2"
    assert "File \"m.py\"" in caplog.text and "prompt: max(1,2)=" in caplog.text


def test_on_error_zero_scores_0_and_counts_until_max_errors(caplog):
    errors = RewardErrors(RewardOnError.ZERO, 2, "reward.verifier math")
    events: list[dict] = []
    failure = VerifierFailed("r", "ValueError: bad", "Traceback\nValueError: bad")

    def fail() -> float:
        return errors.failed(failure, lambda kind, t, **f: events.append(f), 0.0, prompt="p", answer="a", step=0,
                             group=0, sample=0)

    with caplog.at_level(logging.INFO, "rlctl.rewards"):
        assert (fail(), fail()) == (0.0, 0.0)
        with pytest.raises(RewardError, match=r"3 reward errors, more than reward.max_errors \(2\); the last: "
                                              "ValueError: bad"):
            fail()
    assert [e["errors"] for e in events] == [1, 2, 3] and [e["scored_zero"] for e in events] == [True, True, False]
    assert caplog.text.count("Traceback") == 1  # the same error again is one line


# -- the scheduler: a failing verifier ends the run instead of opening groups forever ---------------


def simulate(overrides: list[str], verify: Callable[[str, str], float]) -> tuple[list[dict], list[dict]]:
    """The recipe's pipeline on simulated engines in virtual time, scoring with `verify`: its
    events and step records. Fails the test if the run opens 200 groups (it went on forever)."""
    recipe = load_recipe(QUICKSTART, [*FAST, "run.steps=2", *overrides], check_paths=False)
    cost = cost_model(recipe)
    servers = [SimRollout(f"rollout-{i}", cost, recipe.rollout.max_running_requests) for i in range(2)]
    events, records = KeptEvents(), []
    recorder = Recorder(events, records.append)
    pipeline = build_pipeline(recipe, servers, SimTrainer(cost, servers), VirtualClock(), recorder.emit,
                              lambda step: None, tokenize=lambda prompt: [0] * 8,
                              score=inline_scorer(lambda ids: "response", scored_by(verify)))
    prompts = pipeline.producer.prompts

    def at_most_200() -> Iterator[Prompt]:  # the producer opens groups on its own task: this ends it
        for _ in range(200):
            yield next(prompts)
        raise AssertionError("the run went on opening groups after a reward error")

    pipeline.producer.prompts = at_most_200()
    try:
        run_virtual(pipeline.run(recipe.run.steps))
    finally:
        simulate.events = list(events)  # type: ignore[attr-defined]
    return list(events), records


@pytest.mark.parametrize("mode", ["sync", "rolloutpipe", "async"])
def test_a_raising_verifier_ends_the_run_in_every_mode(mode):
    with pytest.raises(RewardError, match="ZeroDivisionError: division by zero"):
        simulate([f"pipeline.mode={mode}"], lambda response, answer: 1 / 0)
    events = simulate.events  # type: ignore[attr-defined]
    assert any(e["event"] == "reward_error" for e in events)
    assert not any(e["event"] == "train_start" for e in events)


def test_on_error_zero_goes_on_and_counts_the_errors_per_step():
    calls = iter(range(10**6))

    def every_third_raises(response: str, answer: str) -> float:
        if next(calls) % 3 == 2:
            raise ValueError("every third")
        return 1.0

    events, records = simulate(["reward.on_error=zero"], every_third_raises)
    assert len(records) == 2
    for r in records:
        errors = [e for e in events if e["event"] == "reward_error" and e["step"] == r["step"]]
        assert r["reward_errors"] == len(errors) > 0
    assert sum(r["reward_errors"] for r in records) == 64 // 3  # 2 steps x 8 groups x 4 samples
    zeros = sum(x == 0.0 for e in events if e["event"] == "group_completed" for x in e["rewards"])
    assert zeros == 64 // 3


def test_on_error_zero_fails_the_run_past_max_errors():
    with pytest.raises(RewardError, match=r"6 reward errors, more than reward.max_errors \(5\)"):
        simulate(["reward.on_error=zero", "reward.max_errors=5"], lambda response, answer: 1 / 0)


# -- the pooled scorer: timeouts, and a worker that is replaced -----------------------------------


NINE = Prompt(0, "max(1,9)=", "9")


class ServingThread:
    """A scoring worker's own loop (scoring.serve) in a thread of this process instead of a
    spawned process; kill() releases a verifier that waits for it."""

    def __init__(self, verify: Callable[[str, str], float], released: threading.Event) -> None:
        self.conn, theirs = multiprocessing.Pipe()
        self.released = released
        self.exitcode: int | None = None
        self.thread = threading.Thread(target=self._run, args=(theirs, verify), daemon=True)
        self.thread.start()

    def _run(self, conn, verify) -> None:
        try:
            serve(conn, lambda: scored_by(verify))
        except OSError:  # its pipe closed by stop()
            pass

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def kill(self) -> None:
        self.released.set()
        self.exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


def pooled(verify: Callable[[str, str], float], released: threading.Event,
           timeout_s: float = 60.0) -> tuple[PooledScorer, list[ServingThread]]:
    """A scorer of one worker at a time, each a ServingThread; the list of those it started."""
    started: list[ServingThread] = []

    def start() -> ScoringWorker:
        started.append(ServingThread(verify, released))
        return ScoringWorker(started[-1].conn, started[-1])

    return PooledScorer(lambda ids: " ".join(map(str, ids)), RewardConfig(timeout_s=timeout_s), workers=1,
                        start_worker=start), started


def test_a_verifier_that_never_returns_times_out_and_its_worker_is_replaced():
    released = threading.Event()

    def hangs_on_1(response: str, answer: str) -> float:
        if response == "1":
            released.wait()  # until the scorer kills its worker
        return float(response == answer)

    scorer, started = pooled(hangs_on_1, released, timeout_s=0.2)

    async def main() -> tuple[VerifierFailed, tuple[str, float]]:
        await scorer.ready()
        with pytest.raises(VerifierFailed) as e:
            await scorer([1], NINE)
        return e.value, await scorer([9], NINE)

    try:
        failure, after = asyncio.run(main())
    finally:
        scorer.close()
    assert failure.error == "did not return within 0.2 s (reward.timeout_s); its scoring process was stopped"
    assert failure.response == "1"  # said before the verifier ran
    assert len(started) == 2 and started[0].exitcode == -9
    assert after == ("9", Scored(1.0))  # the new worker scores


def test_a_raising_verifier_in_a_worker_fails_the_scoring_and_the_worker_stays():
    scorer, started = pooled(lambda response, answer: 1 / 0 if response == "0" else 0.5, threading.Event())

    async def main() -> tuple[VerifierFailed, tuple[str, float]]:
        with pytest.raises(VerifierFailed) as e:
            await scorer([0], NINE)
        return e.value, await scorer([4, 2], NINE)

    try:
        failure, after = asyncio.run(main())
    finally:
        scorer.close()
    assert (failure.error, failure.response, after) == ("ZeroDivisionError: division by zero", "0", ("4 2", Scored(0.5)))
    assert len(started) == 1


def test_a_closed_scorer_scores_nothing_and_starts_no_worker():
    scorer, started = pooled(lambda response, answer: 1.0, threading.Event())

    async def main() -> None:
        await scorer.ready()
        scorer.close()  # the run is ending while scorings still come (a group's task not yet cancelled)
        with pytest.raises(RunError, match="scoring stopped"):
            await scorer([1], NINE)

    asyncio.run(main())
    assert len(started) == 1 and not started[0].is_alive()


class Exited:
    """The process of a worker that has exited."""

    exitcode = 1

    def is_alive(self) -> bool:
        return False

    def kill(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass


def test_a_worker_that_could_not_load_fails_ready_with_its_reason():
    def load():
        raise RunError("reward.function: no module 'x'")

    conn, theirs = multiprocessing.Pipe()
    thread = threading.Thread(target=serve, args=(theirs, load), daemon=True)
    thread.start()
    scorer = PooledScorer("", RewardConfig(), workers=1, start_worker=lambda: ScoringWorker(conn, Exited()))
    with pytest.raises(RunError, match="could not start: reward.function: no module 'x'"):
        asyncio.run(scorer.ready())
    thread.join()
    scorer.close()
