"""Scheduling pieces every pipeline mode shares: the group runner and the producer (a run's samples
and groups are in rlctl/pipelines/groups.py, a trajectory's turns in rlctl/pipelines/episode.py).

Everything here is asyncio over two small interfaces (rlctl/pipelines/interfaces.py), `Rollout`
(one server: generate, abort; rlctl/pipelines/servers.py spreads requests over them) and `Trainer`
(train one batch, sync weights), reads time only through a `Clock`, and scores through an
injected `Score` (rlctl/pipelines/scoring.py). Real runs plug in HTTP clients, the run's clock
and scoring in worker processes; a simulation plugs in cost-model engines, virtual time and
inline scoring, and the scheduling code stays the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rlctl.data import Prompt
from rlctl.engines.rollout.protocol import GenerateOutput, SamplingRequest, weight_version_number
from rlctl.errors import RunError
from rlctl.pipelines.admission import Admission
from rlctl.pipelines.groups import Generated, Group, Sample, trajectory_fields
from rlctl.pipelines.interfaces import Clock, EventSink
from rlctl.pipelines.servers import ServerSet
from rlctl.pipelines.scoring import Score
from rlctl.rewards.failures import RewardErrors, VerifierFailed

if TYPE_CHECKING:
    from rlctl.pipelines.episode import MultiTurn


class GroupRunner:
    """Generates and scores the samples of one group, each request admitted by `admission`.
    A response the verifier fails on goes to `reward_errors` (by default: the run fails)."""

    def __init__(self, servers: ServerSet, admission: Admission, sampling: SamplingRequest, group_size: int,
                 tokenize: Callable[[Prompt], list[int]], score: Score, clock: Clock, emit: EventSink,
                 lengths: Callable[[str], int] | None = None, resume_aborted: bool = False,
                 reward_errors: RewardErrors | None = None, multi_turn: MultiTurn | None = None) -> None:
        self.servers = servers
        self.admission = admission
        self.sampling = sampling
        self.group_size = group_size
        self.tokenize = tokenize
        self.score = score
        self.clock = clock
        self.emit = emit
        self.lengths = lengths
        self.resume_aborted = resume_aborted
        self.reward_errors = reward_errors or RewardErrors()
        self.rids_of: dict[int, set[str]] = {}
        self.multi_turn = multi_turn
        """rollout.multi_turn: each sample a trajectory of turns (rlctl/pipelines/episode.py)."""

    def new_group(self, group_id: int, step: int, prompt: Prompt) -> Group:
        return Group(group_id, step, prompt, self.tokenize(prompt))

    async def run(self, group: Group) -> Group:
        self.rids_of[group.id] = set()
        try:
            group.samples = list(await asyncio.gather(*(self._sample(group, i) for i in range(self.group_size))))
        finally:
            del self.rids_of[group.id]
        return group

    def request(self, prompt: str) -> SamplingRequest:
        """The sampling of one request for `prompt` (its own length under the long-tail workload)."""
        if self.lengths is None:
            return self.sampling
        s = self.sampling  # built directly: dataclasses.replace costs 3x as much, per sample
        return SamplingRequest(self.lengths(prompt), s.temperature, s.top_p, s.top_k, s.stop_token_ids, True)

    async def _sample(self, group: Group, index: int) -> Sample:
        text = group.prompt.text  # made anew on every read for chat messages: once per sample
        if self.multi_turn is not None:
            return await self.multi_turn.sample(self, group, index, text)
        request = self.request(text)
        turn = await self.generate(group, index, text, group.prompt_ids, request, f"g{group.id}-s{index}")
        if turn.finish_reason != "abort":
            self.admission.finished(text, turn.n_tokens)
        return await self.scored(group, index, turn.output_ids, Sample(
            group=group.id, index=index, prompt_ids=group.prompt_ids, output_ids=turn.output_ids,
            logprobs=turn.logprobs, text="", reward=0.0, versions=turn.versions, n_tokens=turn.n_tokens,
            server=turn.server, t_start=turn.t_start, t_end=turn.t_end, finish_reason=turn.finish_reason))

    async def generate(self, group: Group, index: int, text: str, input_ids: list[int], request: SamplingRequest,
                       rid: str) -> Generated:
        """One response (one model turn) to input_ids: admitted, sent to a server, and, where an
        abort stopped it and resume_aborted is set, resumed from the tokens it has."""
        output: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        n_tokens = 0
        t0: float | None = None
        segment = 0
        while True:
            await self.admission.acquire((group.id, index), text)
            if t0 is None:
                t0 = self.clock.now()
                if not group.admitted:
                    group.admitted = True
                    self.emit("group_admitted", t0, step=group.step, group=group.id, prompt=group.prompt.index)
            segment_rid = f"{rid}-{segment}"
            self.rids_of[group.id].add(segment_rid)
            if n_tokens:  # resuming a partial rollout: continue from the tokens it has
                remaining = dataclasses.replace(request, max_new_tokens=request.max_new_tokens - n_tokens)
                context = input_ids + output
            else:
                remaining, context = request, input_ids
            try:
                server, out = await self.servers.generate(context, remaining, segment_rid)
            finally:
                self.rids_of[group.id].discard(segment_rid)
                self.admission.release()
            output += out.output_ids
            logprobs += out.logprobs
            n_tokens += out.completion_tokens
            if out.completion_tokens or not versions:
                versions.append(version_of(out, server))
            reason = str(out.finish_reason.get("type", ""))
            # Partial rollout: a request aborted by a weight update resumes from where it stopped.
            if reason != "abort" or not self.resume_aborted or group.cancelled or n_tokens >= request.max_new_tokens:
                break
            segment += 1
        # the server's part ends here; waiting for a scoring slot is not its busy time
        return Generated(server.name, output, logprobs, versions, n_tokens, reason, t0, self.clock.now())

    async def scored(self, group: Group, index: int, scored_ids: list[int], sample: Sample) -> Sample:
        """The sample with its reward: scored_ids (its response, or a trajectory's last model
        turn) verified against the prompt's answer."""
        try:
            sample.text, scored = await self.score(scored_ids, group.prompt)
            sample.reward, sample.scores = scored.reward, scored.scores
        except VerifierFailed as failure:
            sample.text, sample.scores = failure.response, {}
            sample.reward = self.reward_errors.failed(
                failure, self.emit, self.clock.now(), prompt=group.prompt.text, answer=group.prompt.answer,
                step=group.step, group=group.id, sample=index)
        return sample


def version_of(out: GenerateOutput, server: Any) -> int:
    """The weight version a server stamped its generation with; RunError naming the server when it
    is none of the run's (SGLang's "default" before its first update)."""
    try:
        return weight_version_number(out.weight_version)
    except ValueError as e:
        raise RunError(f"{getattr(server, 'name', server)}: {e}") from None


def named_scores(samples: list[Sample]) -> dict[str, list[float | None]]:
    """Each named score over a group's samples, in sample order (None where a sample lacks it)."""
    names = sorted({name for x in samples for name in x.scores})
    return {name: [x.scores.get(name) for x in samples] for name in names}


class GroupProducer:
    """Opens groups, generates them, and hands every complete trainable group to the trainer side.

    A rollout batch (sync, rolloutpipe) asks for `target` trainable groups generated in one step;
    async asks for an endless stream with at most `limit` groups open or waiting. Whether a
    complete group is trainable is dynamic sampling's call: a group whose rewards are all equal
    has zero advantage everywhere. Groups still open when the batch is full are cancelled (their
    requests aborted on the servers); groups completing beyond the target are surplus. Both are
    recorded as dropped, so every admitted group ends in exactly one event. A group cancelled
    before any of its requests was admitted cost nothing and is in no event.
    """

    def __init__(self, runner: GroupRunner, prompts: Iterator[Prompt], *, dynamic_sampling: bool,
                 clock: Clock, emit: EventSink, max_equal_in_a_row: int | None = None) -> None:
        self.runner = runner
        self.max_equal_in_a_row = max_equal_in_a_row
        """Dynamic sampling: this many groups in a row dropped for all-equal rewards end the run."""
        self.equal_in_a_row = 0
        self.prompts = prompts
        self.dynamic_sampling = dynamic_sampling
        self.clock = clock
        self.emit = emit
        self.step = 0
        self.target: int | None = None
        self.delivered = 0
        self.next_group = 0
        self.open: dict[int, tuple[Group, asyncio.Task[Group]]] = {}
        self.failure: BaseException | None = None
        """The first error a group ended with: it ends the producer too, instead of a new group."""
        self.on_completed: Callable[[Group], None] | None = None
        """Given every group that completes (trained or dropped), e.g. to write its samples."""
        self._ready: asyncio.Queue[Group | BaseException] = asyncio.Queue()
        self._changed = asyncio.Event()

    async def run_batch(self, step: int, target: int, over_provision: float = 0.0) -> None:
        """Deliver `target` trainable groups for this step, keeping enough groups open that
        drops are replaced early (over_provision); cancel the leftovers when the batch is full."""
        self.step, self.target, self.delivered = step, target, 0

        def want() -> int:
            remaining = target - self.delivered
            return math.ceil(remaining * (1.0 + over_provision)) if remaining > 0 else 0

        await self._run(want, lambda: self.delivered >= target)

    async def run_stream(self, limit: int, stop: asyncio.Event) -> None:
        """async: keep at most `limit` groups open or ready, until stop is set."""
        self.target = None
        await self._run(lambda: max(0, limit - self._ready.qsize()), stop.is_set, stop)

    async def _run(self, want: Callable[[], int], done: Callable[[], bool], stop: asyncio.Event | None = None) -> None:
        try:
            while not done():
                if self.failure is not None:
                    raise self.failure
                while len(self.open) < want():
                    self._open()
                self._changed.clear()
                waiters = [asyncio.ensure_future(self._changed.wait())]
                if stop is not None:
                    waiters.append(asyncio.ensure_future(stop.wait()))
                _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
        finally:
            await self.cancel_open()

    def _open(self) -> None:
        group = self.runner.new_group(self.next_group, self.step, next(self.prompts))
        self.next_group += 1
        task = asyncio.get_running_loop().create_task(self.runner.run(group))
        self.open[group.id] = (group, task)
        task.add_done_callback(lambda t, g=group: self._finished(g, t))

    def _finished(self, group: Group, task: asyncio.Task[Group]) -> None:
        self.open.pop(group.id, None)
        self._changed.set()
        if task.cancelled() or group.cancelled:
            return
        if task.exception() is not None:
            self.failure = self.failure or task.exception()
            self._ready.put_nowait(task.exception())  # the consumer raises it
            return
        s = group.samples
        now = self.clock.now()
        self.emit(
            "group_completed", now, step=group.step, group=group.id, prompt_tokens=len(group.prompt_ids),
            rewards=[x.reward for x in s], lengths=[x.n_tokens for x in s],
            versions=[x.weight_version for x in s], segments=[len(x.versions) for x in s],
            servers=[x.server for x in s], starts=[x.t_start for x in s], ends=[x.t_end for x in s],
            **({"scores": named_scores(s)} if any(x.scores for x in s) else {}),
            **({"source": group.prompt.source} if group.prompt.source else {}),
            **trajectory_fields(s),
        )
        if self.on_completed is not None:
            self.on_completed(group)
        if self.dynamic_sampling and group.all_equal:
            self.emit("group_dropped", now, step=group.step, group=group.id, reason="all_equal")
            self.equal_in_a_row += 1
            if self.max_equal_in_a_row and self.equal_in_a_row >= self.max_equal_in_a_row and self.failure is None:
                self.failure = RunError(
                    f"dynamic sampling dropped {self.equal_in_a_row} groups in a row whose rewards were all equal "
                    f"(reward {group.rewards[0]:g}; rollout.max_gen_batches): the policy may have collapsed (a too "
                    "high train.lr) or the reward gives every response the same score")
                self._ready.put_nowait(self.failure)
        elif self.target is not None and self.delivered >= self.target:
            self.equal_in_a_row = 0
            self.emit("group_dropped", now, step=group.step, group=group.id, reason="surplus")
        else:
            self.equal_in_a_row = 0
            self.delivered += 1
            self._ready.put_nowait(group)

    async def get(self) -> Group:
        """The next complete trainable group, in completion order."""
        item = await self._ready.get()
        self._changed.set()
        if isinstance(item, BaseException):
            raise item
        return item

    def take_ready(self, limit: int) -> list[Group]:
        """Up to `limit` more complete trainable groups that are ready now, without waiting."""
        out: list[Group] = []
        while len(out) < limit and not self._ready.empty():
            item = self._ready.get_nowait()
            self._changed.set()
            if isinstance(item, BaseException):
                raise item
            out.append(item)
        return out

    def unfinished(self) -> list[Group]:
        """Groups opened and not yet trained or dropped: open, or complete and waiting (a checkpoint
        does not keep them; a resume records them as dropped)."""
        return [g for g, _ in self.open.values() if g.admitted] + [g for g in list(self._ready._queue) if isinstance(g, Group)]  # type: ignore[attr-defined]

    def drop_ready(self, reason: str) -> None:
        """Record the complete groups nobody will train (async, at the end of the run)."""
        while not self._ready.empty():
            item = self._ready.get_nowait()
            if isinstance(item, Group):
                self.emit("group_dropped", self.clock.now(), step=item.step, group=item.id, reason=reason)

    async def cancel_open(self) -> None:
        groups = [g for g, _ in self.open.values()]
        tasks = [t for _, t in self.open.values()]
        for g in groups:
            g.cancelled = True
        await self.runner.servers.abort([rid for g in groups for rid in self.runner.rids_of.get(g.id, ())])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in groups:
            if g.admitted:
                self.emit("group_dropped", self.clock.now(), step=g.step, group=g.id, reason="aborted")
