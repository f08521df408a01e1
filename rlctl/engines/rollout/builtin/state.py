"""What the built-in server's routes share: its flags, the engine once loaded, and SGLang's reply shapes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rlctl.engines.rollout.builtin.engine import Engine
from rlctl.engines.rollout.protocol import UPDATE_SESSION_SINCE, parse_version


@dataclass
class ServerState:
    args: argparse.Namespace
    """The command-line flags (server.parser())."""
    engine: Engine | None = None
    """None until the model is loaded: routes that need it answer 503 or do nothing until then."""
    tokenizer: Any = None
    """None when the model directory has no tokenizer: token ids only, like --skip-tokenizer-init."""
    loading_error: str | None = None
    tp_ranks: Any = None
    """--tp-size > 1: the TpRanks (tp_ranks.py) that receive weights beside rank 0."""
    flat: Any = None
    """The FlatParams (rlctl/engines/weightsync/flat.py) the model's parameters are views of, or None."""
    last_reply: float = 0.0
    """When a POST route last answered (time.monotonic()): SGLang's scheduler replied."""
    memory: Any = None
    """The MemoryTags (rlctl/engines/memory.py) of /release_memory_occupation, once the model is loaded."""

    @property
    def tp_size(self) -> int:
        return self.args.tp_size

    def ready(self) -> bool:
        return self.engine is not None

    def weights_released(self) -> bool:
        """The parameters are off the device (memory_routes.py): nothing may read or write them."""
        return self.memory is not None and "weights" in self.memory.released

    def foreign_master(self, address: Any, port: Any) -> str | None:
        """Why a weight group whose store is at address:port is not the run's trainer's, or None
        when it is (or the server was started without --weight-group-master: open, for ad-hoc use).
        With HOST:PORT both must be those; with HOST alone, the host."""
        want = self.args.weight_group_master
        if not want:
            return None
        host, _, pinned = want.rpartition(":") if want.rpartition(":")[2].isdigit() else (want, "", "")
        if address == host and (not pinned or str(port) == pinned):
            return None
        return (f"master_address {address}:{port} is not this run's trainer ({want}); refused "
                "(--weight-group-master)")

    def sessions_required(self) -> bool:
        """SGLang >= 0.5.21 refuses weight updates outside a session; older versions have none."""
        if not self.args.emulate_sglang:
            return True
        v = parse_version(self.args.emulate_sglang)
        return v is not None and v >= UPDATE_SESSION_SINCE


def status_ok(message: str) -> web.Response:
    """SGLang's reply to /pause_generation and /continue_generation: no `success` key."""
    return web.json_response({"message": message, "status": "ok"})


def ok(message: str = "") -> web.Response:
    return web.json_response({"success": True, "message": message})


def fail(message: str, status: int = 400) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=status)


def error(message: str, status: int = 400) -> web.Response:
    """SGLang's _create_error_response: what /generate and the memory routes answer when the call fails."""
    return web.json_response({"error": {"message": message}}, status=status)


RELEASED = "the model's memory is released; call /resume_memory_occupation first"
