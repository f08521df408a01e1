"""vLLM's sleep mode on built-in servers emulating vLLM (rlctl/engines/rollout/builtin/vllm_sleep.py),
driven by VllmClient as a colocated run's turns drive it: a sleep moves the weights and the KV cache
off the device only with --enable-sleep-mode, a partial wake keeps scheduling paused, and what
vLLM refuses or ignores is refused or ignored. The routes are held to vLLM's source by
tests/test_vllm_contract.py."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rlctl.engines.rollout.protocol import SamplingRequest
from rlctl.engines.rollout.vllm.client import VllmClient

pytestmark = pytest.mark.process
VERSION = "0.34.0"


@pytest.fixture
def sleepy(start_server, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    return lambda *extra: start_server(0, "--emulate-vllm", VERSION, *extra)


async def _resident(c: VllmClient) -> dict:
    async with c.session.get(c.url + "/rlctl/memory") as resp:
        return (await resp.json())["resident"]


async def _post(c: VllmClient, path: str) -> tuple[int, dict]:
    async with c.session.post(c.url + path) as resp:
        return resp.status, await resp.json()


def test_sleep_and_a_wake_in_two_parts_as_a_colocated_turn_does(sleepy):
    url = sleepy("--enable-sleep-mode")

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = VllmClient(url, s)
            out = await c.generate([1, 22], SamplingRequest(max_new_tokens=3, ignore_eos=True), "before")
            weights = (await _resident(c))["weights"]
            assert weights > 0 and not await c.is_sleeping()
            await c.release_memory_occupation(["kv_cache", "weights"])  # /sleep?level=1&mode=abort
            assert await c.is_sleeping() and (await _resident(c))["weights"] == 0
            assert await _post(c, "/sleep?level=1") == (200, {"status": "sleeping", "level": 1})  # again: no change
            assert not await c.wake_up(["weights"])  # the KV cache still sleeps: scheduling stays paused
            assert (await _resident(c))["weights"] == weights and await c.is_sleeping()
            assert await _post(c, "/wake_up?tags=weights") == (200, {"status": "sleeping", "tags": ["weights"]})
            assert await c.wake_up(["kv_cache"])  # nothing sleeps: awake, scheduling resumed
            assert not await c.is_sleeping()
            again = await c.generate([1, 22], SamplingRequest(max_new_tokens=3, ignore_eos=True), "after")
            assert len(again.output_ids) == len(out.output_ids) == 3

    asyncio.run(scenario())


def test_what_vllm_refuses_the_emulation_refuses(sleepy):
    url = sleepy("--enable-sleep-mode")

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = VllmClient(url, s)
            status, body = await _post(c, "/release_kv_cache_memory")  # no pause first
            assert status == 500 and "requires a completed pause first" in body["error"]["message"]
            for bad, field in (("/sleep?level=3", "level"), ("/sleep?mode=later", "mode"), ("/sleep?level=x", "level")):
                status, body = await _post(c, bad)
                assert status == 422 and body["detail"][0]["loc"] == ["query", field], (bad, body)
            await c.release_memory_occupation(["kv_cache"])  # a pause, then /release_kv_cache_memory
            assert await c.is_sleeping() and (await _resident(c))["weights"] > 0
            status, body = await _post(c, "/release_kv_cache_memory")  # something already asleep
            assert status == 500 and "requires all executor memory to be resident" in body["error"]["message"]
            assert await c.wake_up()

    asyncio.run(scenario())


def test_without_sleep_mode_a_sleep_moves_no_memory(sleepy):
    url = sleepy()

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = VllmClient(url, s)
            weights = (await _resident(c))["weights"]
            await c.sleep(1)
            assert await c.is_sleeping() and (await _resident(c))["weights"] == weights
            assert await c.wake_up()

    asyncio.run(scenario())
