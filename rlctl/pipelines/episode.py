"""One sample as a trajectory of turns (rollout.multi_turn): the model writes, its tool calls run,
their results are appended, and the model goes on from there.

Each model turn is a request like any other: it waits for admission (frontier and longest admit
turn by turn, by the sample's key), goes to the least busy server, and is resumed after an abort
where partial rollouts are on, so every guarantee of the pipeline modes holds per turn: its
weight version is recorded (Sample.versions has one per turn segment, Sample.turns says which
turn), and async's staleness is counted from the oldest. A tool call holds no admission slot: a
trajectory waiting on its tools leaves its place to other requests.

The trajectory ends when a model turn calls no tool (`stop`: it answered), is cut at its
max_new_tokens or the trajectory's max_tokens (`length`), is aborted (`abort`), or calls tools in
its last allowed turn (`turns`: the calls go unanswered). The reward is the reward section's, on
the last model turn's tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from rlctl.agents.calls import Parser, ToolCall
from rlctl.agents.tools import ToolResult
from rlctl.errors import RunError
from rlctl.pipelines.groups import Generated, Group, Sample

if TYPE_CHECKING:
    from rlctl.engines.rollout.protocol import SamplingRequest
    from rlctl.pipelines.admission import Admission
    from rlctl.pipelines.interfaces import Clock, EventSink

Tools = Callable[[Any, ToolCall], Awaitable[ToolResult]]
"""(environment, call) -> its result, off the event loop (rlctl/agents/tools.py ToolRunner)."""


class TurnFormat(Protocol):
    def ids(self, results: list[str]) -> list[int]: ...


class TurnRunner(Protocol):
    """What a trajectory needs of the group runner (rlctl/pipelines/core.py GroupRunner)."""

    admission: Admission
    clock: Clock
    emit: EventSink

    def request(self, prompt: str) -> SamplingRequest: ...

    async def generate(self, group: Group, index: int, text: str, input_ids: list[int], request: SamplingRequest,
                       rid: str) -> Generated: ...

    async def scored(self, group: Group, index: int, scored_ids: list[int], sample: Sample) -> Sample: ...


Calls = Callable[[Generated], list[ToolCall]]
"""The tool calls a model turn made (none: the trajectory ends with it)."""


def parsed_calls(parse: Parser, detokenize: Callable[[list[int]], str]) -> Calls:
    """A real model's calls: those its turn wrote, read by the chat format's parser, when the
    turn ended by itself (a turn cut at its length or aborted calls nothing)."""
    return lambda g: parse(detokenize(g.output_ids)) if g.finish_reason == "stop" else []


class MultiTurn:
    """Runs GroupRunner's samples as trajectories. A simulation (rlctl/sim/tools.py) plugs in
    calls drawn at random, tools that take virtual time and results of a number of tokens."""

    def __init__(self, make_env: Callable[[], Any], calls: Calls, turns: TurnFormat, tools: Tools,
                 detokenize: Callable[[list[int]], str], *, max_turns: int, max_tokens: int) -> None:
        self.make_env = make_env
        self.calls = calls
        self.turns = turns
        self.tools = tools
        self.detokenize = detokenize
        self.max_turns = max_turns
        self.max_tokens = max_tokens

    def environment(self, group: Group) -> Any:
        """A new environment for one trajectory, reset to its data row (on the event loop: an
        environment's reset is expected to be quick; its steps run in the tool workers)."""
        p = group.prompt
        try:
            env = self.make_env()
            reset = getattr(env, "reset", None)
            if callable(reset):
                reset({**p.fields, "prompt": p.prompt, "answer": p.answer})
        except Exception as e:  # noqa: BLE001 - the user's environment may raise anything
            raise RunError(f"rollout.multi_turn.environment: making or resetting one for prompt {p.index} raised "
                           f"{type(e).__name__}: {e}; fix the environment") from None
        return env

    async def sample(self, runner: TurnRunner, group: Group, index: int, text: str) -> Sample:
        env = self.environment(group)
        output: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        turns: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        last: list[int] = []
        generated = 0
        reason = "stop"
        base = runner.request(text)
        for turn in range(self.max_turns):
            budget = self.max_tokens - len(output)
            if budget <= 0:
                reason = "length"
                break
            request = dataclasses.replace(base, max_new_tokens=min(base.max_new_tokens, budget))
            g = await runner.generate(group, index, text, group.prompt_ids + output, request,
                                      f"g{group.id}-s{index}-t{turn}")
            output += g.output_ids
            logprobs += g.logprobs
            mask += [1] * len(g.output_ids)
            versions += g.versions
            generated += g.n_tokens
            last = g.output_ids
            reason = g.finish_reason
            turns.append({"server": g.server, "versions": g.versions, "t_start": g.t_start, "t_end": g.t_end,
                          "tokens": g.n_tokens})
            found = self.calls(g) if reason != "abort" else []
            if not found:
                break
            if turn == self.max_turns - 1:
                reason = "turns"
                break
            results = await self._call(runner, group, index, turn, env, found, calls)
            env_ids = self.turns.ids([r.text for r in results])
            if len(output) + len(env_ids) >= self.max_tokens:
                reason = "length"
                break
            output += env_ids
            logprobs += [0.0] * len(env_ids)
            mask += [0] * len(env_ids)
        if reason != "abort":
            runner.admission.finished(text, generated)
        sample = Sample(group=group.id, index=index, prompt_ids=group.prompt_ids, output_ids=output, logprobs=logprobs,
                        text="", reward=0.0, versions=versions, n_tokens=generated, server=turns[0]["server"],
                        t_start=turns[0]["t_start"], t_end=turns[-1]["t_end"], finish_reason=reason,
                        loss_mask=mask, turns=turns, tool_calls=calls, trajectory=self.detokenize(output))
        return await runner.scored(group, index, last, sample)

    async def _call(self, runner: TurnRunner, group: Group, index: int, turn: int, env: Any,
                    found: list[ToolCall], calls: list[dict[str, Any]]) -> list[ToolResult]:
        """Run one turn's calls (at once; the runner bounds how many run), each in an event."""
        t0 = runner.clock.now()
        results = await asyncio.gather(*(self.tools(env, c) for c in found))
        for c, r in zip(found, results):
            start = t0 + r.queued
            call = {"name": c.name or "unparsed", "ok": r.ok, "seconds": round(r.seconds, 6), "t_start": start}
            calls.append(call)
            runner.emit("tool_call", start, step=group.step, group=group.id, sample=index, turn=turn,
                        name=call["name"], ok=r.ok, seconds=call["seconds"], queued=round(r.queued, 6),
                        **({"timed_out": True} if r.timed_out else {}),
                        **({"error": r.text[:200]} if not r.ok else {}))
        return results
