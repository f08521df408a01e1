"""Function-level time slicing of shared devices among several runs' models (the pool's core).

A pool hosts several jobs' models on its devices, each model on a fixed set of devices (placed
once, never migrated). A job's calls (a generate, a forward/backward, an optimizer step, a weight
sync) each need some of its models in at least some memory state:

    active     weights and working memory (KV cache, or gradients and optimizer state)
    weights    weights only (working memory released)
    offloaded  nothing on the device (weights in host memory)

A device runs one job's calls at a time (the job *holds* it while any of them run; any number of
that job's calls may run together). `_dispatch` decides who holds each device next, and moves
models between states (`Mover`: the engines' release/resume calls, or simulated copies) so that
the next holder's models fit the device's memory. The rules (docs/pool.md says why):
- A call is granted on all its devices at once, or waits: no partial holds (a kind in `beside`
  whose models are in place holds none: it runs beside the holders; a weight sync on CPU).
- Waiting calls are taken in order: those of a job that holds one of their devices; the job with
  the least device time per unit of share since it joined (JobState.vtime); weight syncs, then
  training, then generates; calls that need no move; the oldest. A call that cannot run reserves
  its free devices.
- Once a job's turn on a device (its slices, with gaps under `linger_s` between them) has lasted
  its quantum while another job waits, its new generates there wait. The quantum is `quantum_s`
  x share, or longer where handing the device over costs moves: a turn lasts at least the moves
  the switch needs (as long as they took last time) / `switch_overhead`, so that moving models
  takes at most that fraction of a device's time.
  Until then a device it just left waits for its next call before a job whose models must be
  moved in takes it, as long as those moves would take (at least `linger_s`): models are not
  moved out and back at every call boundary. Where no move is needed, the device waits
  `linger_s` only for a job more than a quantum behind its share of device time that usually
  comes back within it: a run's calls come one after another, so without waiting the jobs would
  take strict turns call by call, whatever their shares.
- Moves demote models of jobs not running there, least recently used first, working memory
  before weights; they count as the moved model's job's device time.

Everything reads time through a `Clock` and runs on one asyncio loop, so the same code schedules
a live pool (rlctl/launchers/pool/) and a simulated one in virtual time (rlctl/sim/pool.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from rlctl.errors import RunError
from rlctl.plex.state import KIND_RANK as _KIND_RANK
from rlctl.plex.state import RANK as _RANK
from rlctl.plex.state import Clock, Emit, JobState, Model, Mover, State
from rlctl.plex.state import Waiting as _Waiting

__all__ = ["Clock", "Emit", "Model", "Mover", "SliceScheduler", "State"]


class SliceScheduler:
    def __init__(self, devices: dict[int, float], clock: Clock, mover: Mover, emit: Emit | None = None,
                 quantum_s: float = 5.0, switch_overhead: float = 0.1, beside: frozenset[str] = frozenset()) -> None:
        self.capacity = dict(devices)
        """device -> memory cap in bytes."""
        self.clock = clock
        self.mover = mover
        self.emit = emit or (lambda kind, t, **f: None)
        self.quantum_s = quantum_s
        self.switch_overhead = switch_overhead
        self.jobs: dict[str, JobState] = {}
        self.models: dict[tuple[str, str], Model] = {}
        self.holder: dict[int, str | None] = dict.fromkeys(devices)
        self.busy_s: dict[int, float] = dict.fromkeys(devices, 0.0)
        self._waiting: dict[tuple[str, tuple[str, ...], str], _Waiting] = {}
        self._order = itertools.count()
        self._timers: dict[tuple[str, int], asyncio.TimerHandle] = {}
        self.linger_s = 0.05 * quantum_s
        """How long a device waits for its last holder's next call, while that holder's turn is
        shorter than its quantum, before a job whose models must be moved in may take it."""
        self.turn: dict[int, tuple[str, float]] = {}
        """device -> (job, when its turn began): its slices with gaps under linger_s between them."""
        self.last_end: dict[int, float] = {}
        self.beside = beside
        """Kinds of call that hold no device when their models are in place (a sync on CPU)."""

    # -- jobs and models ---------------------------------------------------------------------

    def add_job(self, name: str, models: list[Model], share: float = 1.0) -> None:
        for m in models:
            for d in m.devices:
                if m.resident(State.ACTIVE) > self.capacity[d]:
                    raise RunError(f"{name}/{m.name} needs {m.resident(State.ACTIVE) / 2**30:.1f} GiB on device {d}, "
                                   f"which has {self.capacity[d] / 2**30:.1f} GiB")
        self.jobs[name] = JobState(name, share, v0=min((j.vtime for j in self.jobs.values()), default=0.0))
        for m in models:  # active where there is room, else offloaded (the caller makes it so)
            room = all(self.resident(d) + m.resident(State.ACTIVE) <= self.capacity[d] for d in m.devices)
            m.state = m.target = State.ACTIVE if room else State.OFFLOADED
            self.models[(name, m.name)] = m
        self.emit("job_added", self.clock.now(), job=name, share=share,
                  models={m.name: list(m.devices) for m in models})

    def remove_job(self, name: str) -> None:
        """Forget a job that has ended (or died): its waiting calls fail, its holds end."""
        job = self.jobs.pop(name)
        for key in [k for k, w in self._waiting.items() if w.job == name]:
            for fut in self._waiting.pop(key).futures:
                if not fut.done():
                    fut.set_exception(RunError(f"job {name} left the pool"))
        for d in list(job.holds):
            self._end_slice(job, d)
        for key in [k for k in self.models if k[0] == name]:
            del self.models[key]
        self.emit("job_removed", self.clock.now(), job=name, used_s=job.used)
        self._dispatch()

    def resident(self, device: int) -> float:
        return sum(m.resident() for m in self.models.values() if device in m.devices)
    # -- calls -------------------------------------------------------------------------------

    @asynccontextmanager
    async def slice(self, job: str, needs: list[tuple[str, State]], kind: str) -> AsyncIterator[None]:
        """Run the body as one call of `job` that needs these of its models in at least these
        states (a generate its server active; a weight sync only the weights on both sides)."""
        if job not in self.jobs:
            raise RunError(f"job {job} is not in the pool")
        needed = tuple((self.models[(job, m)], state) for m, state in needs)
        if kind in self.beside and all(m.moving is None and _RANK[m.state] <= _RANK[st] for m, st in needed):
            async with self._beside(job, needed):
                yield
            return
        await self._acquire(job, needed, kind)
        try:
            await self._ready(needed)
            yield
        finally:
            self._release(job, needed)

    @asynccontextmanager
    async def _beside(self, job: str, needed: tuple[tuple[Model, State], ...]) -> AsyncIterator[None]:
        """A call that holds no device: its models stay put (not demoted) while it runs; its time is its job's."""
        start = self.clock.now()
        for m, _ in needed:  # in use: not demoted
            m.users += 1
        try:
            yield
        finally:
            now, devices = self.clock.now(), sorted({d for m, _ in needed for d in m.devices})
            for m, _ in needed:
                m.users, m.last_used = m.users - 1, now
            if job in self.jobs:
                self.jobs[job].used += (now - start) * len(devices)
            for d in devices:
                self.emit("slice", now, job=job, device=d, start=start, seconds=now - start, beside=True)
            self._dispatch()

    async def _acquire(self, job: str, needed: tuple[tuple[Model, State], ...], kind: str) -> None:
        key = (job, tuple((m.name, st) for m, st in needed), kind)
        waiting = self._waiting.get(key)
        if waiting is None:
            devices = frozenset(d for m, _ in needed for d in m.devices)
            waiting = self._waiting[key] = _Waiting(job, needed, kind, devices, next(self._order))
        now = self.clock.now()
        for d in waiting.devices:
            self.jobs[job].came_back(d, now)
        fut = asyncio.get_running_loop().create_future()
        waiting.futures.append(fut)
        self._dispatch()
        await fut

    async def _ready(self, needed: tuple[tuple[Model, State], ...]) -> None:
        for m, state in needed:
            while m.moving is not None:
                await asyncio.shield(m.moving)  # raises what a failed move raised
            if _RANK[m.state] > _RANK[state]:
                raise RunError(f"{m.job}/{m.name} could not be made {state.value} (it is {m.state.value})")

    def _release(self, job_name: str, needed: tuple[tuple[Model, State], ...]) -> None:
        now = self.clock.now()
        for m, _ in needed:
            m.last_used = now
            m.users -= 1
        job = self.jobs.get(job_name)
        if job is None:
            return
        for d in {d for m, _ in needed for d in m.devices}:
            job.holds[d] -= 1
            if job.holds[d] == 0:
                self._end_slice(job, d)
        self._dispatch()

    def _end_slice(self, job: JobState, device: int) -> None:
        start = job.since.pop(device)
        job.holds.pop(device, None)
        job.yielding.discard(device)
        now = job.left[device] = self.clock.now()
        job.used += now - start
        self.busy_s[device] += now - start
        self.holder[device] = None
        self.last_end[device] = now
        self.emit("slice", now, job=job.name, device=device, start=start, seconds=now - start)

    def _priority(self, w: _Waiting) -> tuple:
        job = self.jobs[w.job]
        continuing = any(self.holder[d] == w.job for d in w.devices)
        moves = sum(_RANK[m.target] > _RANK[st] for m, st in w.needs)
        return (not continuing, job.vtime, _KIND_RANK.get(w.kind, 1), moves, w.order)

    def _dispatch(self) -> None:
        reserved: dict[int, _Waiting] = {}
        for w in sorted(self._waiting.values(), key=self._priority):
            if w.job not in self.jobs or not w.futures:
                continue
            if w.kind == "generate" and self.jobs[w.job].yielding & w.devices:
                continue  # held back for another job's turn: it reserves nothing
            plan = self._grantable(w, reserved)
            if plan is not None:
                self._grant(w, plan)
            elif not any(self._lingering(d, w) for d in w.devices):  # a lingering device stays its holder's
                for d in w.devices:
                    reserved.setdefault(d, w)
        self._waiting = {k: w for k, w in self._waiting.items() if w.futures}
        self._check_quanta()

    def _grantable(self, w: _Waiting, reserved: dict[int, _Waiting]) -> list[tuple[Model, State]] | None:
        """The moves that let w run now, or None when it must wait."""
        for d in w.devices:
            if self.holder[d] not in (None, w.job) or reserved.get(d, w) is not w:
                return None
        plan = self._evictions(w)
        if plan is not None and any(self._lingering(d, w) for d in w.devices):
            return None  # kept a moment for the job that just left it
        return plan

    def _lingering(self, d: int, w: _Waiting) -> bool:
        """Is device d kept a moment for its last holder (another job)? Where w needs moves, as
        long as they would take (at least linger_s) while the holder's turn lasts: idling that
        long costs at most what switching now would (ski rental). Where it needs none, linger_s
        for a holder owed device time that usually comes back sooner (anticipatory scheduling)."""
        last, began = self.turn.get(d, (None, 0.0))
        if self.holder[d] is not None or last in (None, w.job) or last not in self.jobs:
            return False
        now, end = self.clock.now(), self.last_end.get(d, 0.0)
        moves = self._evictions(w) or any(_RANK[m.target] > _RANK[st] for m, st in w.needs)
        switch = self._switch_s(w)
        wait = max(self.linger_s, switch)
        if now - end >= wait or end - began >= self._quantum(last, switch) or not moves and not self._owed(last, w.job, d):
            return False
        if (last, d) not in self._timers:  # look again when the moment is over
            loop = asyncio.get_running_loop()
            self._timers[(last, d)] = loop.call_at(loop.time() + end + wait - now, self._quantum_due, last, d, None)
        return True

    def _owed(self, last: str, other: str, d: int) -> bool:
        """Is `last` more than a quantum of device time behind `other` for their shares, and
        does it usually come back to d within linger_s?"""
        a, b = self.jobs[last], self.jobs[other]
        return b.vtime - a.vtime > self.quantum_s and a.think.get(d, float("inf")) < self.linger_s

    def _quantum(self, holder: str, switch_s: float) -> float:
        """How long the holder's turn lasts while another job waits: its share of the quantum,
        and at least the switch's moves / switch_overhead."""
        return self.jobs[holder].share * max(self.quantum_s, switch_s / self.switch_overhead)

    def _switch_s(self, w: _Waiting) -> float:
        """Seconds of moves w needs before it runs (each as long as that move took last time;
        one never made yet counts nothing)."""
        moves = (self._evictions(w, busy_too=True) or []) + [(m, st) for m, st in w.needs if _RANK[m.target] > _RANK[st]]
        return sum(m.move_s.get((m.target, to), 0.0) for m, to in moves)

    def _evictions(self, w: _Waiting, busy_too: bool = False) -> list[tuple[Model, State]] | None:
        """The demotions that make room for w's models on its devices (least recently used
        first), or None when no set of them does. busy_too: as if the models in use were not."""
        plan: list[tuple[Model, State]] = []
        state = {m: m.target for m in self.models.values()}
        for m, st in w.needs:
            state[m] = min(state[m], st, key=_RANK.__getitem__)
        for d in sorted(w.devices):
            on_d = [m for m in self.models.values() if d in m.devices]
            others = sorted((m for m in on_d if m not in w.models and (busy_too or self._movable(m))),
                            key=lambda m: m.last_used)
            for step in (State.WEIGHTS, State.OFFLOADED):
                for m in others:
                    if sum(x.resident(state[x]) for x in on_d) <= self.capacity[d]:
                        break
                    if m.resident(step) < m.resident(state[m]):
                        state[m] = step
                        plan.append((m, step))
            if sum(x.resident(state[x]) for x in on_d) > self.capacity[d]:
                return None
        return plan

    @staticmethod
    def _movable(m: Model) -> bool:
        return m.moving is None and m.users == 0

    def _grant(self, w: _Waiting, evictions: list[tuple[Model, State]]) -> None:
        job = self.jobs[w.job]
        futures = [f for f in w.futures if not f.done()]  # a cancelled caller no longer waits
        w.futures.clear()
        if not futures:
            return
        now = self.clock.now()
        for d in w.devices:
            if self.holder[d] is None:
                self.holder[d] = w.job
                job.since[d] = now
                job.holds[d] = 0
                last, _ = self.turn.get(d, (None, 0.0))
                if last != w.job or now - self.last_end.get(d, 0.0) > self.linger_s and not self._others_waiting(d, w.job):
                    self.turn[d] = (w.job, now)  # a new turn, unless it comes back to a device kept for it
            job.holds[d] += len(futures)
        for m in w.models:
            m.users += len(futures)
        moves = evictions + [(m, st) for m, st in w.needs if _RANK[m.target] > _RANK[st]]
        if moves:
            self._start_moves(moves)
        for fut in futures:
            fut.set_result(None)

    def _start_moves(self, moves: list[tuple[Model, State]]) -> None:
        """Run the moves one after the other (demotions first, so the memory is free before the
        promotions need it); every moved model is `moving` until they are all done."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        prior = {m.moving for m, _ in moves if m.moving is not None}
        for m, to in moves:
            m.moving = done
            m.target = to

        async def run() -> None:
            if prior:
                await asyncio.wait(prior)
            try:
                for m, to in moves:
                    await self._move(m, to)
            except Exception as e:  # the calls that need these models fail with it
                done.set_exception(e)
            else:
                done.set_result(None)
            finally:
                for m, _ in moves:
                    if m.moving is done:
                        m.moving = None
                        m.target = m.state

        loop.create_task(run())
        done.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)  # retrieved here too

    async def _move(self, m: Model, to: State) -> None:
        start, before, said = self.clock.now(), m.state, None
        try:
            if m.state is not to:
                said = await self.mover(m, to)
                m.state = to
                m.move_s[(before, to)] = self.clock.now() - start
        finally:
            seconds = self.clock.now() - start
            job = self.jobs.get(m.job)
            if job is not None:
                job.used += seconds * len(m.devices)
                job.moved += seconds * len(m.devices)
            self.emit("move", self.clock.now(), job=m.job, model=m.name, devices=list(m.devices), start=start,
                      seconds=seconds, to=to.value, ok=m.state is to, **{"from": before.value}, **(said or {}))

    def _check_quanta(self) -> None:
        """Mark holders whose turn is over while another job waits; wake up when one will be."""
        now = self.clock.now()
        for d, holder in self.holder.items():
            if holder is None or d in self.jobs[holder].yielding:
                continue
            due = self._due(d, holder)
            if due is None:
                continue
            if now >= due:
                self.jobs[holder].yielding.add(d)
            elif (holder, d) not in self._timers:
                loop = asyncio.get_running_loop()
                began = self.turn.get(d, (holder, 0.0))[1]
                self._timers[(holder, d)] = loop.call_at(loop.time() + due - now, self._quantum_due, holder, d, began)

    def _others_waiting(self, d: int, job: str) -> list[_Waiting]:
        """Calls of other jobs waiting for device d."""
        return [w for w in self._waiting.values() if d in w.devices and w.job != job and w.futures]

    def _due(self, d: int, holder: str) -> float | None:
        """When the holder's turn on d ends, if another job waits for d."""
        waiting = self._others_waiting(d, holder)
        if not waiting:
            return None
        began = self.turn.get(d, (holder, self.jobs[holder].since[d]))[1]
        return began + self._quantum(holder, min(self._switch_s(w) for w in waiting))

    def _quantum_due(self, holder: str, device: int, since: float | None) -> None:
        """The turn that began at `since` may be over: marked when it is, to within a millisecond
        (a timer per rounding hair would never let time move); a longer quantum gets a new timer."""
        del self._timers[(holder, device)]
        job = self.jobs.get(holder)
        if job is not None and since is not None and device in job.since and self.turn.get(device, ("", None))[1] == since:
            due = self._due(device, holder)
            if due is not None and self.clock.now() >= due - 1e-3:
                job.yielding.add(device)
        self._dispatch()
