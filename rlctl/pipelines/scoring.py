"""Scoring a response: detokenize it and verify it against the reference answer.

The scheduler takes scoring as an injected async callable (`Score`), so that the same code runs
on a real event loop and under the simulation's virtual-time loop (rlctl/sim/loop.py), which
cannot wait on other threads or processes: a simulation scores inline, a real run in worker
processes off the event loop.

A verifier that raises, or (in a worker process) runs past reward.timeout_s, fails scoring with
VerifierFailed (rlctl/rewards/failures.py), which the scheduler turns into a failed run or a zero
reward (reward.on_error).
"""

from __future__ import annotations

import asyncio
import os
import traceback
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from rlctl.errors import RunError
from rlctl.process.lifetime import die_with_parent
from rlctl.rewards.failures import VerifierFailed
from rlctl.rewards.verifiers import Scored, Verify

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from rlctl.data import Prompt

    from rlctl.recipe import Recipe, RewardConfig

Score = Callable[[list[int], "Prompt"], Awaitable[tuple[str, Scored]]]
"""(response token ids, its prompt) -> (response text, the verdict); VerifierFailed when the
verifier fails on it. The verifier sees the prompt's answer, its prompt and its row's fields."""

SCORING_WORKERS = 2


def inline_scorer(detokenize: Callable[[list[int]], str], verify: Verify) -> Score:
    """Scores on the calling task, without yielding to the loop: for simulated engines, whose
    scoring costs nothing. No timeout: nothing can stop a verifier that runs on the loop itself."""

    async def score(output_ids: list[int], prompt: Prompt) -> tuple[str, Scored]:
        text = detokenize(output_ids)
        kind, *said = scoring_reply(text, _job(prompt), verify)
        if kind == "error":
            raise VerifierFailed(text, *said)
        return text, Scored(*said)

    return score


def _job(prompt: Prompt) -> tuple[str, Any, dict[str, Any]]:
    """What a verifier is given besides the response: (answer, prompt, the row's fields), plain
    values (they go over a worker's pipe)."""
    return prompt.answer, prompt.prompt, dict(prompt.fields)


def scoring_reply(text: str, job: tuple[str, Any, dict[str, Any]], verify: Verify) -> tuple[Any, ...]:
    """What a scoring says: ("reward", value, named scores) or ("error", the traceback's last
    line, the traceback)."""
    try:
        scored = verify(text, *job)
    except Exception as e:  # noqa: BLE001 - the verifier is the user's code: any error is a reward error
        trace = "".join(traceback.format_exception(type(e), e, _past_own_frames(e.__traceback__)))
        return "error", error_line(e), trace
    return "reward", scored.reward, scored.scores


def _past_own_frames(tb: TracebackType | None) -> TracebackType | None:
    """A verifier's traceback from its first frame outside this module and rlctl's verifiers."""
    from rlctl.rewards import verifiers

    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in (__file__, verifiers.__file__):
        tb = tb.tb_next
    return tb


def error_line(e: BaseException) -> str:
    """The last line of e's traceback (`ZeroDivisionError: division by zero`); of a message on
    several lines, the first."""
    kind = type(e).__qualname__ if type(e).__module__ == "builtins" else f"{type(e).__module__}.{type(e).__qualname__}"
    message = str(e).strip().splitlines()
    return f"{kind}: {message[0]}" if message else kind


class PooledScorer:
    """Scores in `workers` worker processes, one response per worker at a time, so that a slow
    verifier (sympy, a user function that sleeps or calls a service) never stalls the event loop
    and the requests in flight on it.

    Processes rather than threads: a verifier is mostly pure Python (math-verify's sympy, user
    code), which in a thread would hold the GIL the event loop needs; math-verify bounds a parse
    or a comparison with a signal-based timeout, which works only in a process's main thread,
    where a worker runs its scorings; and a verifier that never returns can be stopped only with
    its process. The response is detokenized here, on the loop, with the controller's tokenizer,
    and the worker is sent its text: a worker loads no tokenizer, so it imports neither
    transformers nor torch, and starts (or is replaced) without their import time. Each builds
    the verifier from the recipe once, when it starts (spawned, not forked: the controller
    already runs threads and sockets). The workers start at once, so they load while the
    controller waits for its servers. A worker whose verifier runs past reward.timeout_s, or
    whose process dies, is replaced by a new one."""

    def __init__(self, detokenize: Callable[[list[int]], str], reward: RewardConfig, workers: int = SCORING_WORKERS,
                 *, start_worker: Callable[[], ScoringWorker] | None = None) -> None:
        """detokenize: response ids to the text the verifier reads (the special tokens skipped).
        start_worker: a worker serving another way than a spawned process (tests)."""
        self._detokenize = detokenize
        self._start = start_worker or (lambda: ScoringWorker.spawn(reward))
        self.timeout_s = reward.timeout_s
        self._workers = [self._start() for _ in range(workers)]
        self._idle: asyncio.Queue[ScoringWorker] | None = None
        """Workers free to score: the scorings beyond them wait here."""
        self._closed = False

    async def ready(self) -> None:
        """Return once every worker has loaded (RunError if one could not)."""
        for w in self._workers:
            await w.started()

    async def __call__(self, output_ids: list[int], prompt: Prompt) -> tuple[str, Scored]:
        # A caller cancelled mid-scoring (its group was aborted) leaves the scoring to finish, so
        # that the worker's replies are read and it goes back to the idle ones.
        scoring = asyncio.ensure_future(self._score(output_ids, _job(prompt)))
        scoring.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(scoring)

    async def _score(self, output_ids: list[int], job: tuple[str, Any, dict[str, Any]]) -> tuple[str, Scored]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for w in self._workers:
                self._idle.put_nowait(w)
        text = self._detokenize(output_ids)
        worker = await self._idle.get()
        try:
            if self._closed:  # the run is ending: no scoring on a stopped worker, and no new one
                raise RunError("scoring stopped: the run is ending")
            await worker.started()
            worker.conn.send((text, *job))
            deadline = asyncio.get_running_loop().time() + self.timeout_s
            kind, *said = await worker.reply(deadline)
            if kind == "reward":
                return text, Scored(*said)
            raise VerifierFailed(text, *said)
        except TimeoutError:
            worker = self._replace(worker)
            raise VerifierFailed(text, f"did not return within {self.timeout_s:g} s (reward.timeout_s); its "
                                       "scoring process was stopped") from None
        except (EOFError, OSError):
            if self._closed:
                raise RunError("scoring stopped: the run is ending") from None
            code = worker.process.exitcode
            worker = self._replace(worker)
            raise VerifierFailed(text, f"its scoring process died while verifying (exit code {code})") from None
        finally:
            self._idle.put_nowait(worker)

    def _replace(self, worker: ScoringWorker) -> ScoringWorker:
        worker.stop()
        if self._closed:
            return worker
        new = self._start()
        self._workers[self._workers.index(worker)] = new
        return new

    def close(self) -> None:
        """Stop every worker, a scoring in progress or not, and start none after. (A worker left
        running would hold up the controller's exit: multiprocessing joins its children then.)"""
        self._closed = True
        for w in self._workers:
            w.stop()


class RoutedScorer:
    """data.sources with a reward section of their own: each response is scored by its prompt's
    source's scorer, the rest by the run's (`default`)."""

    def __init__(self, default: PooledScorer, by_source: dict[str, PooledScorer]) -> None:
        self.default, self.by_source = default, by_source

    async def ready(self) -> None:
        for scorer in (self.default, *self.by_source.values()):
            await scorer.ready()

    async def __call__(self, output_ids: list[int], prompt: Prompt) -> tuple[str, Scored]:
        return await self.by_source.get(prompt.source, self.default)(output_ids, prompt)

    def close(self) -> None:
        for scorer in (self.default, *self.by_source.values()):
            scorer.close()


def run_scorer(detokenize: Callable[[list[int]], str], recipe: Recipe) -> PooledScorer | RoutedScorer:
    """The run's scoring processes: the reward section's, and one set per data source with a
    verifier of its own. Each verifier is built here first, so that one that cannot load fails
    the controller's start, saying why, not a worker."""
    from rlctl.rewards.verifiers import make_verifier

    own = {s.label: s.reward for s in recipe.data.sources if s.reward is not None}
    for reward in (recipe.reward, *own.values()):
        make_verifier(reward)
    default = PooledScorer(detokenize, recipe.reward)
    if not own:
        return default
    return RoutedScorer(default, {label: PooledScorer(detokenize, reward) for label, reward in own.items()})


class Process(Protocol):
    """What a scorer needs of a worker's process (multiprocessing.Process has it)."""

    exitcode: int | None

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class ScoringWorker:
    """One scoring process (`serve`) and the pipe to it. It says ("ready", pid) or ("failed",
    why) once loaded, then takes (response text, answer, prompt, fields) and answers with scoring_reply()."""

    def __init__(self, conn: Connection, process: Process) -> None:
        self.conn, self.process = conn, process
        self._loaded: asyncio.Future[None] | None = None

    @classmethod
    def spawn(cls, reward: RewardConfig) -> ScoringWorker:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        conn, theirs = ctx.Pipe()
        # Not a daemon, so that a verifier may start processes of its own (a code sandbox).
        process = ctx.Process(target=_serve_recipe, args=(theirs, reward, os.getpid()), name="rlctl-scoring")
        process.start()
        theirs.close()
        return cls(conn, process)

    async def started(self) -> None:
        """Return once the worker has loaded; RunError if it could not."""
        if self._loaded is None:
            self._loaded = asyncio.ensure_future(self._first_reply())
        await asyncio.shield(self._loaded)

    async def _first_reply(self) -> None:
        try:
            kind, said = await self.reply(None)
        except (EOFError, OSError):
            raise RunError(f"a scoring worker process exited as it started (exit code {self.process.exitcode}); "
                           "see the controller's log") from None
        if kind != "ready":
            raise RunError(f"a scoring worker process could not start: {said}")

    async def reply(self, deadline: float | None) -> tuple[Any, ...]:
        """The worker's next message, waited for on the loop until `deadline` (the loop's time;
        TimeoutError after it). EOFError: the process is gone."""
        if not self.conn.poll():
            loop = asyncio.get_running_loop()
            readable = loop.create_future()
            fd = self.conn.fileno()
            loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
            try:
                await asyncio.wait_for(readable, None if deadline is None else max(0.0, deadline - loop.time()))
            finally:
                loop.remove_reader(fd)
        return self.conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.conn.close()  # a worker waiting for work ends at once
        self.process.join(5)


def serve(conn: Connection, load: Callable[[], Verify]) -> None:
    """A scoring worker's loop: load the verifier, say so, then score the responses (their text)
    that come until the controller goes away."""
    try:
        verify = load()
    except Exception as e:  # noqa: BLE001 - said to the controller, which fails the run with it
        conn.send(("failed", str(e) if isinstance(e, RunError) else error_line(e)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            text, *job = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(scoring_reply(text, tuple(job), verify))


def _serve_recipe(conn: Connection, reward: RewardConfig, parent: int) -> None:
    """A spawned scoring process: the recipe's verifier. It dies with the controller that spawned
    it, however that ends (a SIGKILL included: rlctl/process/lifetime.py)."""
    die_with_parent(parent)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # no thread pool for a verifier: the cores are the engines'

    def load() -> Verify:
        from rlctl.rewards.verifiers import make_verifier

        return make_verifier(reward)

    serve(conn, load)
