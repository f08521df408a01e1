"""Evaluating a held-out set on the rollout servers: k responses to every prompt at the weights
the servers hold, each scored by the set's verifier, summed up as mean@k and pass@k.

Like the rest of the scheduler this is asyncio over a ServerSet and an injected Score, so the same
code evaluates on real servers and on simulated ones. When an evaluation runs, and that the
servers hold one weight version while it does, is the pipeline's part (rlctl/pipelines/base.py);
the Evaluator below runs each set when due and records it; the controller makes it for a run
(rlctl/control/evaluation.py), the simulation for a simulated one (rlctl/sim/run.py).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlctl.data import Prompt, read_file_prompts
from rlctl.engines.rollout.protocol import SamplingRequest
from rlctl.pipelines.core import version_of
from rlctl.pipelines.interfaces import Clock, EventSink
from rlctl.pipelines.scoring import PooledScorer, Score
from rlctl.pipelines.servers import ServerSet
from rlctl.recipe import EvalConfig, EvalSet, Recipe
from rlctl.rewards.failures import VerifierFailed

log = logging.getLogger("rlctl.pipelines.evaluation")


@dataclass(frozen=True)
class EvalResponse:
    """One response to one prompt of a set, scored."""

    prompt: int
    """The prompt's position in the set."""
    source: str
    reward: float
    tokens: int
    finish_reason: str
    version: int
    """The weight version the server generated it with."""
    text: str = ""
    error: bool = False
    """The verifier failed on it (raised or timed out): scored 0 and counted."""


async def generate_eval(prompts: list[Prompt], ids: list[list[int]], servers: ServerSet, sampling: SamplingRequest,
                        k: int, score: Score, in_flight: int, tag: str = "eval") -> list[EvalResponse]:
    """k responses to each prompt (`ids`: each prompt's token ids), at most `in_flight` requests
    on the servers at once, in prompt order. A response the verifier fails on scores 0 (marked
    `error`): an evaluation reports, it does not end the run."""
    gate = asyncio.Semaphore(max(1, in_flight))

    async def one(n: int, j: int) -> EvalResponse:
        prompt = prompts[n]
        async with gate:
            server, out = await servers.generate(ids[n], sampling, f"{tag}-p{n}-s{j}")
        version = version_of(out, server)
        reason = str(out.finish_reason.get("type", ""))
        try:
            text, scored = await score(out.output_ids, prompt)
        except VerifierFailed as failure:
            return EvalResponse(n, prompt.source, 0.0, out.completion_tokens, reason, version, failure.response, True)
        return EvalResponse(n, prompt.source, scored.reward, out.completion_tokens, reason, version, text)

    return list(await asyncio.gather(*(one(n, j) for n in range(len(prompts)) for j in range(k))))


def eval_metrics(responses: list[EvalResponse], k: int, correct_at: float = 1.0) -> dict[str, Any]:
    """What an evaluation says, over every prompt and, where prompts name their source, per source:
    - mean@k: the mean reward of all responses;
    - pass@1: the chance that one response is correct (reward >= correct_at), estimated from the
      k per prompt (the mean over prompts of correct / k);
    - pass@k: the share of prompts with at least one correct response among their k;
    - response_len_mean, truncated (the share cut at max_new_tokens), errors (verifier failures).
    `by_source` holds mean@k, pass@1 and pass@k per source, when any prompt has one."""
    out = _summary(responses, k, correct_at)
    out.update(prompts=len({r.prompt for r in responses}), k=k,
               response_len_mean=statistics.fmean(r.tokens for r in responses) if responses else 0.0,
               truncated=sum(r.finish_reason == "length" for r in responses) / max(1, len(responses)),
               errors=sum(r.error for r in responses))
    sources = sorted({r.source for r in responses if r.source})
    if sources:
        out["by_source"] = {s: _summary([r for r in responses if r.source == s], k, correct_at) for s in sources}
    return out


def _summary(responses: list[EvalResponse], k: int, correct_at: float) -> dict[str, float]:
    by_prompt: dict[int, list[float]] = {}
    for r in responses:
        by_prompt.setdefault(r.prompt, []).append(r.reward)
    if not by_prompt:
        return {f"mean@{k}": 0.0, "pass@1": 0.0, f"pass@{k}": 0.0}
    correct = [[x >= correct_at for x in rewards] for rewards in by_prompt.values()]
    return {f"mean@{k}": statistics.fmean(r.reward for r in responses),
            "pass@1": statistics.fmean(sum(c) / len(c) for c in correct),
            f"pass@{k}": statistics.fmean(float(any(c)) for c in correct)}


@dataclass
class LoadedSet:
    """A set as an evaluation runs it: its prompts rendered, its sampling and scoring settled."""

    label: str
    prompts: list[Prompt]
    ids: list[list[int]]
    """Each prompt's token ids, rendered once."""
    sampling: SamplingRequest
    k: int
    score: Score


def set_sampling(recipe: Recipe, s: EvalSet) -> SamplingRequest:
    """The set's sampling: its own keys where given, the run's rollout.sampling for the rest."""
    r = recipe.rollout.sampling
    return SamplingRequest(max_new_tokens=s.max_new_tokens or r.max_new_tokens,
                           temperature=r.temperature if s.temperature is None else s.temperature,
                           top_p=r.top_p if s.top_p is None else s.top_p, top_k=r.top_k,
                           stop_token_ids=list(r.stop_token_ids))


def read_set(s: EvalSet) -> list[Prompt]:
    """The set's prompts, the first `limit` of them when it is set."""
    prompts = read_file_prompts(s.path, s.prompt_key, s.answer_key)
    return prompts[: s.limit] if s.limit else prompts


class Evaluator:
    """Evaluates every set when due (the pipeline's Evaluate) and records what it found."""

    def __init__(self, cfg: EvalConfig, sets: list[LoadedSet], servers: ServerSet, in_flight: int, emit: EventSink,
                 clock: Clock, record: Callable[[dict[str, Any]], None], wall_clock: Callable[[], float],
                 own_scorers: list[PooledScorer] | None = None) -> None:
        self.cfg, self.sets, self.servers = cfg, sets, servers
        self.in_flight, self.emit, self.clock, self.record, self.wall_clock = in_flight, emit, clock, record, wall_clock
        self.own_scorers = own_scorers or []
        """Scorers of the sets with a reward section of their own (stopped by close())."""

    def due(self, steps_done: int, steps: int) -> bool:
        c = self.cfg
        if steps_done == 0:
            return c.before
        return bool(c.every and steps_done % c.every == 0) or (c.at_end and steps_done == steps)

    async def ready(self) -> None:
        for scorer in self.own_scorers:
            await scorer.ready()

    async def __call__(self, steps_done: int, version: int) -> None:
        step = {"step": steps_done - 1} if steps_done else {}  # the step it follows (a resume trims by it)
        for s in self.sets:
            t0 = self.clock.now()
            self.emit("eval_start", t0, set=s.label, steps=steps_done, version=version, prompts=len(s.prompts),
                      k=s.k, **step)
            responses = await generate_eval(s.prompts, s.ids, self.servers, s.sampling, s.k, s.score,
                                            self.in_flight, tag=f"eval-{s.label}-{steps_done}")
            found = eval_metrics(responses, s.k, self.cfg.correct_at)
            seconds = self.clock.now() - t0
            headline = {k: v for k, v in found.items() if k.startswith(("mean@", "pass@"))}
            self.emit("eval_end", self.clock.now(), set=s.label, steps=steps_done, version=version,
                      seconds=seconds, **headline, **step)
            self.record({"set": s.label, "steps": steps_done, "version": version, "time": self.wall_clock(),
                         "seconds": seconds, "versions": sorted({r.version for r in responses}), **found})
            log.info("eval %s after %d steps (version %d): %s (%.1f s)", s.label, steps_done, version,
                     ", ".join(f"{k} {v:.3f}" for k, v in headline.items()), seconds)

    def close(self) -> None:
        for scorer in self.own_scorers:
            scorer.close()
