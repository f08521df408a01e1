"""A paused SGLang server is alive: its health check, read from SGLang's source, taught to the
built-in server's emulation, and followed by the controller's watch (rlctl/control/failover.py).

SGLang's /health generates one token and answers 503 when nothing comes back within
SGLANG_HEALTH_CHECK_TIMEOUT (20 s): a paused server generates nothing. rlctl starts its servers
with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false and asks /health while they are paused,
/health_generate while they generate."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from rlctl.engines.rollout.protocol import HEALTH_GENERATION_ENV, HEALTH_TIMEOUT_ENV, HEALTH_TIMEOUT_S
from rlctl.engines.rollout.registry import rollout_adapter
from rlctl.recipe import RolloutEngine
from sglang_health import env_field, false_spellings, generation_switch, health_paths, health_timeout, keyless_prefixes
from sglang_source import SUPPORTED

# -- SGLang's source ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", SUPPORTED)
def test_sglang_health_generates_unless_switched_off_for_health_alone(sglang, version):
    src = sglang(version)
    assert health_paths(src) == {"/health", "/health_generate"}  # one handler: the generation
    assert generation_switch(src) == (f"not envs.{HEALTH_GENERATION_ENV}.get() and request.url.path == '/health'")
    assert env_field(src, HEALTH_GENERATION_ENV) == ("EnvBool", True)  # generating out of the box
    assert "false" in false_spellings(src)
    assert health_timeout(src) == (HEALTH_TIMEOUT_ENV, HEALTH_TIMEOUT_S)
    assert "/health" in keyless_prefixes(src)  # both routes answer a probe without the run's key


@pytest.mark.parametrize("engine", [RolloutEngine.SGLANG, RolloutEngine.BUILTIN])
def test_rlctl_starts_sglang_servers_with_a_health_that_does_not_generate(engine):
    from rlctl.recipe import RolloutConfig

    adapter, rollout = rollout_adapter(engine), RolloutConfig(engine=engine)
    assert adapter.health_env(rollout) == {HEALTH_GENERATION_ENV: "false"}
    assert (adapter.health_route(rollout, paused=False), adapter.health_route(rollout, paused=True)) == (
        "/health_generate", "/health")


def test_vllm_health_is_asked_paused_or_not():
    from rlctl.recipe import RolloutConfig

    adapter, rollout = rollout_adapter(RolloutEngine.VLLM), RolloutConfig(engine=RolloutEngine.VLLM)
    assert adapter.health_env(rollout) == {}
    assert {adapter.health_route(rollout, paused=p) for p in (False, True)} == {"/health"}


# -- the emulation and the watch, real servers -----------------------------------------------------

async def _status(s: aiohttp.ClientSession, url: str) -> tuple[int, float]:
    start = time.monotonic()
    async with s.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
        return resp.status, time.monotonic() - start


@pytest.mark.process
def test_a_paused_emulated_sglang_answers_its_health_as_sglang_does(start_server, monkeypatch):
    from rlctl.engines.rollout.client import RolloutClient

    monkeypatch.setenv(HEALTH_TIMEOUT_ENV, "2")
    monkeypatch.delenv(HEALTH_GENERATION_ENV, raising=False)
    generating = start_server(0)  # as SGLang out of the box
    monkeypatch.setenv(HEALTH_GENERATION_ENV, "false")
    started = start_server(1)  # as rlctl starts it

    async def scenario():
        async with aiohttp.ClientSession() as s:
            for url in (generating, started):
                await RolloutClient(url, s).pause_generation("abort")
            status, took = await _status(s, generating + "/health")
            assert status == 503 and took >= 1.9, (status, took)  # waited the timeout for a generation
            assert (await _status(s, generating + "/health_generate"))[0] == 503
            status, took = await _status(s, started + "/health")
            assert status == 200 and took < 1.0, (status, took)  # alive, and says so at once
            assert (await _status(s, started + "/health_generate"))[0] == 503
            assert (await _status(s, started + "/ready"))[0] == 503  # SGLang's is_ready: not paused
            # Any reply of the scheduler meanwhile is a sign of life (SGLang's last_receive_tstamp).
            probe = asyncio.create_task(_status(s, started + "/health_generate"))
            while not probe.done():  # a reply sent after the probe arrived answers it; until then, again
                await RolloutClient(started, s).flush_cache()
                await asyncio.wait([probe], timeout=0.2)
            assert probe.result()[0] == 200
            await RolloutClient(started, s).continue_generation()
            status, took = await _status(s, started + "/health_generate")
            assert status == 200 and took < 1.0, (status, took)
            assert (await _status(s, started + "/ready"))[0] == 200

    asyncio.run(scenario())


@pytest.mark.process
def test_the_watch_keeps_a_paused_server_and_loses_it_when_it_asks_the_generating_route(
        start_server, tmp_path, monkeypatch):
    """Three times the stall timeout paused: a watch that knows it (as the FailoverTrainer tells it
    around every sync) keeps the server; one that asks /health_generate, as it does while servers
    generate, loses it once the timeout has passed."""
    from conftest import QUICKSTART
    from rlctl.control.failover import ServerWatch
    from rlctl.engines.rollout.client import RolloutClient
    from rlctl.pipelines.servers import ServerSet
    from rlctl.recipe import load_recipe
    from rlctl.run.dir import RunClock, create_run_dir

    monkeypatch.setenv(HEALTH_TIMEOUT_ENV, "1")
    monkeypatch.setenv(HEALTH_GENERATION_ENV, "false")
    url = start_server()
    recipe = load_recipe(QUICKSTART, ["rollout.stall_timeout_s=2"])
    rd = create_run_dir(tmp_path / "runs", "watch", "", {})
    events: list[tuple[str, dict]] = []

    async def scenario():
        async with aiohttp.ClientSession() as s:
            client = RolloutClient(url, s, name="rollout-0")
            await client.pause_generation("abort")
            watches = []
            for told in (True, False):
                server_set = ServerSet([client])
                watch = ServerWatch(server_set, [client], recipe, rd, lambda kind, t, **f: events.append((kind, f)),
                                    RunClock())
                if told:
                    watch.pause(["rollout-0"])
                watches.append(watch)
            deadline = time.monotonic() + 3 * recipe.rollout.stall_timeout_s
            while time.monotonic() < deadline:
                for watch in watches:
                    watch.check_once()
                await asyncio.sleep(0.2)
            for watch in watches:
                for probe in watch.probes.values():
                    probe.cancel()
            return [w.server_set.lost for w in watches]

    told, untold = asyncio.run(scenario())
    assert told == set() and untold == {"rollout-0"}
    (lost,) = [f for kind, f in events if kind == "server_lost"]
    assert lost["reason"].startswith("/health_generate has not answered 200"), lost


def test_the_watch_asks_a_lost_or_paused_server_the_route_that_does_not_generate(tmp_path):
    """A server that should be generating is asked /health_generate; a paused one, and a lost one
    (started again, it has none of the run's weights; a pool may hold it moved out, where the
    generating check waits out SGLang's 20 s health timeout), the route that does not generate."""
    from rlctl.control.failover import ServerWatch
    from rlctl.engines.rollout.client import RolloutClient
    from rlctl.pipelines.servers import ServerSet
    from rlctl.run.dir import RunClock, create_run_dir

    from conftest import QUICKSTART
    from rlctl.recipe import load_recipe

    recipe = load_recipe(QUICKSTART, [])
    clients = [RolloutClient(f"http://127.0.0.1:{9 + i}", None, name=f"rollout-{i}") for i in range(3)]
    server_set = ServerSet(clients)
    watch = ServerWatch(server_set, clients, recipe, create_run_dir(tmp_path / "runs", "watch", "", {}),
                        lambda kind, t, **f: None, RunClock())
    watch.pause(["rollout-1"])
    server_set.lose("rollout-2", "killed")
    assert [watch.probe_route(c.name) for c in clients] == ["/health_generate", "/health", "/health"]
