"""Evaluating a held-out set on the rollout servers: k responses to every prompt at the weights
the servers hold, each scored by the set's verifier, summed up as mean@k and pass@k.

Like the rest of the scheduler this is asyncio over a ServerSet and an injected Score, so the same
code evaluates on real servers and on simulated ones. With rollout.multi_turn each response is a
trajectory, run by the same MultiTurn loop as training's (tools, turns, limits) and scored on its
last model turn. When an evaluation runs, and that the servers hold one weight version while it
does, is the pipeline's part (rlctl/pipelines/base.py); the Evaluator below runs each set when due
and records it; the controller makes it for a run (rlctl/control/evaluation.py), the simulation
for a simulated one (rlctl/sim/run.py).
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
from rlctl.pipelines.episode import MultiTurn
from rlctl.pipelines.groups import Generated, Group, Sample
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
    turns: int = 0
    """A trajectory's model turns (0: a single response)."""
    tool_calls: int = 0
    tool_calls_ok: int = 0


class EvalTurns:
    """What MultiTurn.sample needs of a runner (episode.TurnRunner), for an evaluation: each turn
    straight to the servers under the evaluation's bound on requests in flight, no admission, and
    the tool calls' events left out (the evaluation is one span; its record counts the calls)."""

    def __init__(self, servers: ServerSet, sampling: SamplingRequest, score: Score, gate: asyncio.Semaphore,
                 clock: Clock, tag: str) -> None:
        self.servers, self.sampling, self.score, self.gate, self.clock = servers, sampling, score, gate, clock
        self.tag = tag
        self.admission = _NoAdmission()
        self.failed: set[tuple[int, int]] = set()
        """(prompt, response) pairs the verifier failed on."""

    def emit(self, kind: str, t: float, **fields: Any) -> None:
        pass

    def request(self, prompt: str) -> SamplingRequest:
        return self.sampling

    async def generate(self, group: Group, index: int, text: str, input_ids: list[int], request: SamplingRequest,
                       rid: str) -> Generated:
        async with self.gate:
            t0 = self.clock.now()
            server, out = await self.servers.generate(input_ids, request, f"{self.tag}-{rid}")
        return Generated(server.name, out.output_ids, out.logprobs, [version_of(out, server)], out.completion_tokens,
                         str(out.finish_reason.get("type", "")), t0, self.clock.now())

    async def scored(self, group: Group, index: int, scored_ids: list[int], sample: Sample) -> Sample:
        try:
            sample.text, scored = await self.score(scored_ids, group.prompt)
            sample.reward = scored.reward
        except VerifierFailed as failure:
            sample.text, sample.reward = failure.response, 0.0
            self.failed.add((group.id, index))
        return sample


class _NoAdmission:
    def finished(self, prompt: str, tokens: int) -> None:
        pass


async def generate_eval(prompts: list[Prompt], ids: list[list[int]], servers: ServerSet, sampling: SamplingRequest,
                        k: int, score: Score, in_flight: int, tag: str = "eval", multi_turn: MultiTurn | None = None,
                        clock: Clock | None = None) -> list[EvalResponse]:
    """k responses to each prompt (`ids`: each prompt's token ids), at most `in_flight` requests
    on the servers at once, in prompt order; trajectories with `multi_turn` (and the `clock` their
    turns are timed by). A response the verifier fails on scores 0 (marked `error`): an evaluation
    reports, it does not end the run."""
    gate = asyncio.Semaphore(max(1, in_flight))
    turns = EvalTurns(servers, sampling, score, gate, clock, tag) if multi_turn is not None and clock is not None else None

    async def trajectory(n: int, j: int) -> EvalResponse:
        assert multi_turn is not None and turns is not None
        prompt = prompts[n]
        s = await multi_turn.sample(turns, Group(n, -1, prompt, ids[n]), j, prompt.text)
        return EvalResponse(n, prompt.source, s.reward, s.n_tokens, s.finish_reason, s.weight_version, s.trajectory,
                            (n, j) in turns.failed, len(s.turns), len(s.tool_calls), sum(c["ok"] for c in s.tool_calls))

    async def one(n: int, j: int) -> EvalResponse:
        if turns is not None:
            return await trajectory(n, j)
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
    if any(r.turns for r in responses):  # trajectories: how they used their tools
        calls = sum(r.tool_calls for r in responses)
        out.update(turns_mean=statistics.fmean(r.turns for r in responses),
                   tool_calls_per_response=calls / len(responses),
                   tool_call_ok_ratio=sum(r.tool_calls_ok for r in responses) / calls if calls else 0.0)
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
                 own_scorers: list[PooledScorer] | None = None, multi_turn: MultiTurn | None = None) -> None:
        self.cfg, self.sets, self.servers, self.multi_turn = cfg, sets, servers, multi_turn
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
                                            self.in_flight, tag=f"eval-{s.label}-{steps_done}",
                                            multi_turn=self.multi_turn, clock=self.clock)
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
