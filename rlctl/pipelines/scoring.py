"""Scoring a response: detokenize it and verify it against the reference answer.

The scheduler takes scoring as an injected async callable (`Score`), so that the same code runs
on a real event loop and under the simulation's virtual-time loop (rlctl/sim/loop.py), which
cannot wait on other threads or processes: a simulation scores inline, a real run in a pool of
worker processes off the event loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING

from rlctl.errors import RunError

if TYPE_CHECKING:
    from rlctl.recipe import RewardConfig

Score = Callable[[list[int], str], Awaitable[tuple[str, float]]]
"""(response token ids, reference answer) -> (response text, reward)."""

SCORING_WORKERS = 2


def inline_scorer(detokenize: Callable[[list[int]], str], verify: Callable[[str, str], float]) -> Score:
    """Scores on the calling task, without yielding to the loop: for simulated engines, whose
    scoring costs nothing."""

    async def score(output_ids: list[int], answer: str) -> tuple[str, float]:
        text = detokenize(output_ids)
        return text, verify(text, answer)

    return score


class PooledScorer:
    """Scores in `workers` worker processes, at most `workers` responses at a time, so that a slow
    verifier (sympy, a user function that sleeps or calls a service) never stalls the event loop
    and the requests in flight on it.

    Processes rather than threads: a verifier is mostly pure Python (math-verify's sympy, user
    code), which in a thread would hold the GIL the event loop needs; and math-verify bounds a
    parse or a comparison with a signal-based timeout, which works only in a process's main
    thread, where a pool worker runs its tasks. Each worker loads the tokenizer and builds the
    verifier from the recipe once, when it starts (spawned, not forked: the controller already
    runs threads and sockets). The pool starts at once, so the workers load while the controller
    waits for its servers."""

    def __init__(self, model_path: str, reward: RewardConfig, workers: int = SCORING_WORKERS) -> None:
        import multiprocessing

        self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start_worker, initargs=(model_path, reward))
        self._starting = [self._pool.submit(os.getpid) for _ in range(workers)]  # every worker now, not at the first scoring
        self._slots = asyncio.Semaphore(workers)
        """Bounds the scorings handed to the pool: the rest wait here, not in its queue."""

    async def ready(self) -> None:
        """Return once every worker has loaded (a worker that fails to raises here)."""
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in self._starting))
        except BrokenProcessPool:
            raise RunError("a scoring worker process could not start; see the controller's log") from None

    async def __call__(self, output_ids: list[int], answer: str) -> tuple[str, float]:
        async with self._slots:
            try:
                return await asyncio.get_running_loop().run_in_executor(self._pool, _score, output_ids, answer)
            except BrokenProcessPool:
                raise RunError("a scoring worker process died (killed, or the verifier crashed it); "
                               "see the controller's log") from None

    def close(self) -> None:
        """Drop scorings not started; those running finish in their workers, which then exit."""
        self._pool.shutdown(wait=False, cancel_futures=True)


_worker: dict[str, Callable] = {}
"""In a worker process: its detokenize and verify functions."""


def _start_worker(model_path: str, reward: RewardConfig) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # decoding needs no thread pool; the cores are the engines'
    from transformers import AutoTokenizer

    from rlctl.rewards.verifiers import make_verifier

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    _worker["detokenize"] = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    _worker["verify"] = make_verifier(reward)


def _score(output_ids: list[int], answer: str) -> tuple[str, float]:
    text = _worker["detokenize"](output_ids)
    return text, _worker["verify"](text, answer)
