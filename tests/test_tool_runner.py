"""Tool calls run off the controller's event loop, a bounded number at a time, each bounded in
time, and a stuck environment ends in a stated failure (rlctl/agents/tools.py). Real threads and
real timeouts: the process tier."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rlctl.agents.calls import ToolCall
from rlctl.agents.tools import ToolRunner
from rlctl.errors import RunError

pytestmark = pytest.mark.process


class Held:
    """An environment whose steps wait until released, counting how many run at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        """Released once by every step that starts."""
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.threads: set[int] = set()

    def step(self, name: str, arguments: dict) -> str:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.get_ident())
        self.started.release()
        try:
            if not self.release.wait(30):
                raise TimeoutError("never released")
            if name == "fail":
                raise ValueError("bad  input\non two lines")
            return "x" * int(arguments.get("n", 1))
        finally:
            with self.lock:
                self.running -= 1


def test_calls_run_on_worker_threads_at_most_workers_at_once():
    env, runner = Held(), ToolRunner(workers=2, timeout_s=30, max_output_chars=10)

    async def main():
        calls = [asyncio.ensure_future(runner(env, ToolCall("t", {"n": 3}))) for _ in range(5)]
        for _ in range(2):  # the loop stays free while the steps wait: it waits here for two to start
            assert await asyncio.to_thread(env.started.acquire, timeout=30), "a step never started"
        assert env.running == 2 and not env.started.acquire(blocking=False)  # and no third one
        env.release.set()
        return await asyncio.gather(*calls), threading.get_ident()

    results, loop_thread = asyncio.run(main())
    assert [r.text for r in results] == ["xxx"] * 5 and all(r.ok for r in results)
    assert env.most == 2 and loop_thread not in env.threads
    assert max(r.queued for r in results) > 0  # three of them waited for a worker


def test_a_failing_step_and_long_output_are_the_calls_answer():
    env, runner = Held(), ToolRunner(workers=1, timeout_s=30, max_output_chars=60)
    env.release.set()
    fail = asyncio.run(runner(env, ToolCall("fail")))
    assert (fail.ok, fail.text) == (False, "error: ValueError: bad input on two lines")
    long = asyncio.run(runner(env, ToolCall("t", {"n": 500})))
    assert long.ok and long.text == "x" * 60 + "... [cut at 60 characters]"
    unread = asyncio.run(runner(env, ToolCall("", error="the call is not JSON")))
    assert (unread.ok, unread.text) == (False, "error: the call is not JSON")


def test_a_step_past_its_timeout_is_answered_and_a_runner_whose_workers_are_all_stuck_fails():
    env, runner = Held(), ToolRunner(workers=1, timeout_s=0.2, max_output_chars=100)

    async def main():
        first = await runner(env, ToolCall("t"))
        assert first.timed_out and not first.ok and first.text == "error: the tool call ran past 0.2 s"
        with pytest.raises(RunError, match="every one of the 1 tool workers holds a call running past 0.2 s"):
            await runner(env, ToolCall("t"))

    try:
        asyncio.run(main())
    finally:
        env.release.set()
