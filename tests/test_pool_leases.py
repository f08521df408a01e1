"""A pool's slices as leases (rlctl/launchers/pool/slices.py): renewed while their call runs,
taken back once not renewed for pool.lease_s, so that a frozen run or a client that keeps a slice
cannot hold the pool's devices for ever."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from rlctl.launchers.pool.slices import Leases


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def grant(leases: Leases, job: str) -> tuple[str, asyncio.Event, concurrent.futures.Future]:
    done, task = asyncio.Event(), concurrent.futures.Future()  # all a lease does with its task is cancel it
    return leases.grant(job, "generate", done, task), done, task


def test_a_lease_not_renewed_for_lease_s_is_taken_back_and_its_slice_ends():
    clock = Clock()
    leases = Leases(lease_s=10.0, clock=clock)
    a, a_done, _ = grant(leases, "run-a")
    b, b_done, _ = grant(leases, "run-b")
    clock.t = 8.0
    assert leases.renew("run-a", a)  # a's controller renews; b's is frozen
    assert not leases.renew("run-a", b)  # nor can one job renew another's
    clock.t = 10.5
    assert [lease.job for lease in leases.expired()] == ["run-b"] and b_done.is_set() and not a_done.is_set()
    assert [h["job"] for h in leases.held()] == ["run-a"]
    assert leases.held()[0]["lease_left_s"] == 7.5 and leases.held()[0]["held_s"] == 10.5
    assert not leases.renew("run-b", b) and leases.end("run-b", b) is None  # taken back: gone for good
    clock.t = 18.5
    assert [lease.job for lease in leases.expired()] == ["run-a"]


def test_a_released_lease_ends_its_slice_and_a_leaving_job_cancels_its_calls():
    leases = Leases(lease_s=10.0, clock=Clock())
    a, a_done, _ = grant(leases, "run-a")
    assert leases.end("run-b", a) is None  # not b's to give back
    assert leases.end("run-a", a) is not None and a_done.is_set() and leases.held() == []
    _, _, task = grant(leases, "run-a")
    leases.drop_job("run-a")
    assert task.cancelled() and leases.held() == []


class _GoneServer:
    """A rollout client whose server has stopped listening."""

    async def release_memory_occupation(self, tags):
        from rlctl.errors import ServerUnreachable

        raise ServerUnreachable("http://127.0.0.1:1/release_memory_occupation: server unreachable")

    resume_memory_occupation = release_memory_occupation


class _DyingJob:
    """A pool job whose engine's exit is reported a few polls after it stopped listening, as a
    warm-started engine's exit reaches the pool (through its forker's message)."""

    def __init__(self, reported_after: int | None) -> None:
        self.ended, self.started, self.polls, self.reported_after = None, {"rollout-0"}, 0, reported_after

    def exited(self):
        self.polls += 1
        return ("rollout-0", -9) if self.reported_after is not None and self.polls > self.reported_after else None


@pytest.mark.parametrize("reported_after", [3, None])
def test_a_move_of_an_engine_that_just_died_waits_for_its_exit_instead_of_failing_the_slice(monkeypatch, reported_after):
    """A server killed a moment ago refuses the move's release call before its exit is reported: the
    move is nothing to do once the exit is reported (the pool restarts or lets it go), and an
    error only when no exit is reported (a server that does not listen but lives)."""
    from rlctl.errors import ServerUnreachable
    from rlctl.launchers.pool import jobs
    from rlctl.plex.state import Model, State

    monkeypatch.setattr(jobs, "EXIT_NOTICE_S", 0.3)
    job = _DyingJob(reported_after)
    mover = jobs.EngineMover({"a": job}, session_factory=lambda: None)
    monkeypatch.setattr(mover, "_client", lambda job, model: _GoneServer())
    move = mover(Model("a", "rollout-0", (0,), 1.0, 1.0, state=State.ACTIVE), State.OFFLOADED)
    if reported_after is None:
        with pytest.raises(ServerUnreachable):
            asyncio.run(move)
    else:
        assert asyncio.run(move) is None and job.polls == reported_after + 1
