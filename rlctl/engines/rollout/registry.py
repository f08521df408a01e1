"""The rollout engines rlctl runs, each by its adapter (rlctl/engines/rollout/adapter.py).

    rollout_adapter(recipe.rollout.engine).start(...)     # the engine's business
    speaker(recipe.rollout.protocol).client(url, ...)    # the protocol's: client, weight sender

A new engine: its package with an adapter, and one entry in ADAPTERS.
"""

from __future__ import annotations

from typing import Any

from rlctl.engines.rollout.adapter import RolloutAdapter
from rlctl.engines.rollout.builtin.adapter import BuiltinAdapter
from rlctl.engines.rollout.sglang.adapter import SGLangAdapter
from rlctl.engines.rollout.vllm.adapter import VllmAdapter
from rlctl.recipe import RolloutEngine, ServerProtocol

ADAPTERS: dict[RolloutEngine, RolloutAdapter] = {
    RolloutEngine.BUILTIN: BuiltinAdapter(),
    RolloutEngine.SGLANG: SGLangAdapter(),
    RolloutEngine.VLLM: VllmAdapter(),
}
SPEAKERS: dict[ServerProtocol, RolloutAdapter] = {
    ServerProtocol.SGLANG: ADAPTERS[RolloutEngine.SGLANG],
    ServerProtocol.VLLM: ADAPTERS[RolloutEngine.VLLM],
}
"""The engine whose HTTP protocol each one is: its adapter makes clients and weight senders for
every server that speaks it, the built-in server included."""


def rollout_adapter(engine: RolloutEngine) -> RolloutAdapter:
    return ADAPTERS[RolloutEngine(engine)]


def speaker(protocol: ServerProtocol | str) -> RolloutAdapter:
    """The adapter of the engine whose protocol this is; a ValueError for one rlctl does not speak."""
    try:
        return SPEAKERS[ServerProtocol(protocol)]
    except ValueError:
        raise ValueError(f"unknown rollout protocol {protocol!r}") from None


def rollout_client(protocol: ServerProtocol | str, url: str, session: Any, token: str | None, **kwargs: Any):
    """The client of a server that speaks `protocol`."""
    return speaker(protocol).client(url, session, token, **kwargs)
