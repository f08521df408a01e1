"""pipeline.check_weights after a sync: a server that died since the sync is lost like any dead
server (the sync that brings it back checks it); one that answers /health but not the check, or
whose tensors differ, fails the run."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from rlctl.control.controller import CheckedTrainer
from rlctl.errors import RunError

WANT = {"w": "aa", "b": "bb"}


class Trainer:
    async def sync_weights(self, version, pause_mode="abort"):
        return {"version": version}

    async def weight_checksums(self):
        return {"checksums": dict(WANT)}


class Server:
    def __init__(self, name, sums=None):
        self.name, self.url, self.sums = name, f"http://{name}", sums

    async def weight_checksums(self):
        if self.sums is None:
            raise aiohttp.ClientConnectionError(f"Cannot connect to host {self.name}")
        return {"checksums": self.sums}


def checked(servers, healthy):
    lost, events = set(), []

    async def lose_silent(names):
        lost.update(n for n in names if n not in healthy)

    t = CheckedTrainer(Trainer(), lambda: [s for s in servers if s.name not in lost],
                       lambda event, t, **kw: events.append((event, kw)), SimpleNamespace(now=lambda: 0.0),
                       lose_silent)
    return t, lost, events


def test_a_server_dead_since_the_sync_is_lost_and_the_others_are_checked():
    t, lost, events = checked([Server("a", dict(WANT)), Server("b"), Server("c", dict(WANT))], healthy={"a", "c"})
    asyncio.run(t.sync_weights(6))
    assert lost == {"b"}
    assert events == [("weights_checked", {"version": 6, "tensors": 2, "servers": 2})]


def test_a_server_that_answers_health_but_not_the_check_fails_the_run():
    t, lost, _ = checked([Server("a", dict(WANT)), Server("b")], healthy={"a", "b"})
    with pytest.raises(RunError, match="http://b did not answer the weight check after the sync to version 3"):
        asyncio.run(t.sync_weights(3))
    assert lost == set()


def test_a_server_whose_tensors_differ_fails_the_run():
    t, _, _ = checked([Server("a", {"w": "aa", "b": "xx"})], healthy={"a"})
    with pytest.raises(RunError, match=r"differs from the trainer in 1 of 2 tensors \(first: b\)"):
        asyncio.run(t.sync_weights(1))
