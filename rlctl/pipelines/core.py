"""Scheduling pieces every pipeline mode shares: groups, the rollout pool, the event log.

Everything here is asyncio over two small interfaces, `Rollout` (generate one sample) and
`Trainer` (train one batch, sync weights), and reads time only through a `Clock`. Real runs plug
in HTTP clients and the monotonic clock; a simulation plugs in cost-model engines and virtual
time, and the scheduling code stays the same.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Callable

from rlctl.algos.grpo import group_advantages
from rlctl.data import Prompt
from rlctl.engines.rollout.client import GenerateOutput, SamplingRequest


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class Rollout(Protocol):
    """One rollout server, as the scheduler sees it."""

    name: str

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str,
                       return_logprob: bool = True) -> GenerateOutput: ...


class Trainer(Protocol):
    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]: ...

    async def sync_weights(self, version: int) -> dict[str, Any]: ...


class EventSink(Protocol):
    def __call__(self, kind: str, t: float, **fields: Any) -> None: ...


@dataclass
class Sample:
    group: int
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    text: str
    reward: float
    weight_version: int
    server: str
    t_start: float
    t_end: float
    finish_reason: str


@dataclass
class Group:
    """The G samples of one prompt; complete when all are generated and scored."""

    id: int
    step: int
    prompt: Prompt
    prompt_ids: list[int]
    samples: list[Sample] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def all_equal(self) -> bool:
        return len(set(self.rewards)) <= 1

    def train_samples(self) -> list[dict[str, Any]]:
        """JSON rows for the trainer, with group-normalized advantages."""
        advantages = group_advantages(self.rewards)
        return [
            {"prompt_ids": s.prompt_ids, "response_ids": s.output_ids, "advantage": a,
             "logprobs": s.logprobs, "weight_version": s.weight_version}
            for s, a in zip(self.samples, advantages, strict=False)
        ]


class RolloutPool:
    """Spreads requests over the servers: each new request goes to the least-busy server, and no
    server holds more than `concurrency` requests at once (data parallelism = several servers)."""

    def __init__(self, servers: list[Rollout], concurrency: int) -> None:
        self.servers = servers
        self.concurrency = concurrency
        self.in_flight = {s.name: 0 for s in servers}
        self._free = asyncio.Condition()

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str) -> tuple[Rollout, GenerateOutput]:
        async with self._free:
            await self._free.wait_for(lambda: min(self.in_flight.values()) < self.concurrency)
            server = min(self.servers, key=lambda s: self.in_flight[s.name])
            self.in_flight[server.name] += 1
        try:
            return server, await server.generate(input_ids, sampling, rid)
        finally:
            async with self._free:
                self.in_flight[server.name] -= 1
                self._free.notify_all()


class GroupRunner:
    """Generates and scores the samples of one group."""

    def __init__(self, pool: RolloutPool, sampling: SamplingRequest, group_size: int,
                 tokenize: Callable[[str], list[int]], detokenize: Callable[[list[int]], str],
                 verify: Callable[[str, str], float], clock: Clock, emit: EventSink) -> None:
        self.pool = pool
        self.sampling = sampling
        self.group_size = group_size
        self.tokenize = tokenize
        self.detokenize = detokenize
        self.verify = verify
        self.clock = clock
        self.emit = emit

    def new_group(self, group_id: int, step: int, prompt: Prompt) -> Group:
        return Group(group_id, step, prompt, self.tokenize(prompt.text))

    async def run(self, group: Group) -> Group:
        self.emit("group_admitted", self.clock.now(), step=group.step, group=group.id, prompt=group.prompt.index)
        group.samples = list(await asyncio.gather(*(self._sample(group, i) for i in range(self.group_size))))
        s = group.samples
        self.emit(
            "group_completed", self.clock.now(), step=group.step, group=group.id,
            rewards=[x.reward for x in s], lengths=[len(x.output_ids) for x in s],
            versions=[x.weight_version for x in s], servers=[x.server for x in s],
            starts=[x.t_start for x in s], ends=[x.t_end for x in s],
        )
        return group

    async def _sample(self, group: Group, index: int) -> Sample:
        t0 = self.clock.now()
        server, out = await self.pool.generate(group.prompt_ids, self.sampling, f"g{group.id}-s{index}")
        text = self.detokenize(out.output_ids)
        return Sample(
            group=group.id, index=index, prompt_ids=group.prompt_ids, output_ids=out.output_ids,
            logprobs=out.logprobs, text=text, reward=self.verify(text, group.prompt.answer),
            weight_version=int(out.weight_version), server=server.name, t_start=t0, t_end=self.clock.now(),
            finish_reason=str(out.finish_reason.get("type", "")),
        )
