"""What rlctl asks of a rollout engine, in one interface: RolloutAdapter.

Each engine has one adapter that owns everything rlctl knows about it (the built-in server in
builtin/adapter.py, SGLang in sglang/adapter.py, vLLM in vllm/adapter.py), and
rlctl/engines/rollout/registry.py maps `rollout.engine` to it. The rest of rlctl (the worker that
starts a server, the controller that connects to it, the trainer that sends it weights, the Slurm
script, the planner) asks the adapter and never which engine a run uses; only the recipe's schema
(rlctl/recipe/rollout.py) names them too, for its own checks. A new engine is one more package with
an adapter, one line in the registry, and its section of the recipe.

Two things belong to the protocol a server speaks (rollout.protocol: SGLang's or vLLM's) rather
than to its engine, since the built-in server speaks either: the HTTP client and the trainer's
weight sender. The adapter of the engine whose protocol it is provides them (registry.speaker).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from rlctl.process.devices import gpu_group, process_device
from rlctl.process.auth import listen_address, listening_socket, new_key_id, read_token, redact_output, role_key
from rlctl.errors import RunError
from rlctl.process.topology import Role, Topology
from rlctl.recipe import Launcher, Recipe, RolloutConfig, RolloutEngine, ServerProtocol, SyncBackend
from rlctl.run.dir import RunDir

if TYPE_CHECKING:
    import aiohttp

    from rlctl.engines.rollout.client import RolloutClient
    from rlctl.engines.weightsync.sender import WeightSender

log = logging.getLogger("rlctl.worker")

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "auto": 2.0, "half": 2.0}
"""Bytes of a weight held in a server's --dtype (auto: the checkpoint's, bf16 for the models served)."""


def run_token(rd: RunDir) -> str:
    """The run's token, or a RunError saying what is wrong with its file."""
    try:
        return read_token(rd.path)
    except ValueError as e:
        raise RunError(str(e)) from None


def record_key_id(rd: RunDir, role: Role) -> str:
    """This start's key_id (rlctl/process/auth.py role_key), recorded in run.json for the others."""
    key_id = new_key_id()
    rd.record_process(role.name, key_id=key_id)
    return key_id


def bound(role: Role) -> socket.socket:
    """This process's listening socket, before it draws its key: a port someone else holds ends
    the process here (EADDRINUSE), and the launcher starts it again (rlctl/launchers/local.py)."""
    try:
        return listening_socket(role.listen, role.port)
    except OSError as e:
        raise RunError(f"{role.name} cannot listen on {role.listen}:{role.port}: {e.strerror or e}; "
                       "another process holds the port") from None


@dataclass
class ServerStart:
    """Rollout server `role.index` of a run, as its worker process starts it."""

    rd: RunDir
    recipe: Recipe
    plan: Topology
    role: Role
    model_path: str
    placed: dict | None = None
    """launcher=pool: the device and CPUs the pool chose for this server."""

    @property
    def seed(self) -> int:
        return self.recipe.run.seed * 1000 + self.role.index

    @property
    def host(self) -> str:
        return listen_address(self.role.listen)

    def device(self) -> str:
        """The torch device of a server that runs in this process: the pool's, else the recipe's."""
        ro = self.recipe.rollout
        return self.placed["device"] if self.placed else process_device(ro.device, self.role.index, ro.gpus)

    def bind_gpus(self, tp_size: int) -> None:
        """A local server of an engine that takes whole GPUs gets its own tp_size of them as
        CUDA_VISIBLE_DEVICES; under Slurm the batch script has bound the task's GPUs already."""
        if self.recipe.launcher is Launcher.LOCAL:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu_group(self.recipe.rollout.gpus, tp_size, self.role.index)
            log.info("rollout server %d on GPUs %s", self.role.index, os.environ["CUDA_VISIBLE_DEVICES"])

    def own_key(self) -> str:
        """An engine that binds its port itself gets its key before it starts: the key_id is
        recorded before the port is bound (docs/security.md says what that leaves open)."""
        return role_key(run_token(self.rd), self.role.name, record_key_id(self.rd, self.role))

    def exec(self, cmd: list[str], key: str) -> NoReturn:
        """The engine's server takes this process over (same pid, log and parent-death signal);
        what it prints passes a filter that hides its key."""
        log.info("exec %s", " ".join(cmd))
        redact_output(key)
        os.execv(cmd[0], cmd)
        raise AssertionError("unreachable")


class RolloutAdapter:
    """One rollout engine, as the rest of rlctl sees it. The defaults are those of an engine that
    speaks SGLang's protocol on GPUs of its own, in the recipe's section named after it."""

    engine: ClassVar[RolloutEngine]
    title: ClassVar[str]
    """The engine's name in messages: "SGLang"."""
    expands_kv: ClassVar[bool] = False
    """Its attention repeats a layer's keys and values to every query head (costs/memory.py)."""

    # The recipe, as the engine reads it.
    def protocol(self, rollout: RolloutConfig) -> ServerProtocol:
        return rollout.protocol

    def tp_size(self, rollout: RolloutConfig) -> int:
        """GPUs (and weight-sync ranks) each server takes."""
        return rollout.server_tp

    def tp_key(self) -> str | None:
        """The recipe key of a server's TP size, or None where a server runs on one GPU."""
        return f"rollout.{self.engine}.tp_size"

    def server_gpus(self, rollout: RolloutConfig, bind_cpu_servers: bool) -> int:
        """GPUs a Slurm task of one server is bound to (rlctl/launchers/slurm/script.py)."""
        return self.tp_size(rollout)

    def served_bytes(self, rollout: RolloutConfig) -> float:
        """Bytes a weight takes on the servers (the planner's model of their memory)."""
        return 2.0

    def memory_fraction(self, rollout: RolloutConfig) -> float | None:
        """The share of a GPU a server takes for weights and KV cache, None: the planner's default."""
        return None

    # Where it runs.
    module: ClassVar[str | None] = None
    """The Python package its servers run from, where it is not rlctl's own."""
    install: ClassVar[str] = ""
    """The command that installs that package, in a release rlctl speaks."""

    def check_installed(self) -> None:
        """`rlctl launch` of a local run, before anything starts: the engine is installed here,
        in a release rlctl speaks."""
        import importlib.util

        if self.module and importlib.util.find_spec(self.module) is None:
            raise RunError(f"rollout.engine={self.engine} needs {self.module}, which is not installed here: {self.install}")

    def trainer_requires(self) -> None:
        """What trainer rank 0 needs installed to send this engine weights (checked as it starts)."""

    def start(self, s: ServerStart) -> None:
        """Run server s in this process, or exec the engine's own server in its place."""
        raise NotImplementedError

    # A running server, from the controller and the trainer.
    async def check(self, rollout: RolloutConfig, clients: list[RolloutClient]) -> None:
        """The servers answer /health: check that they speak a release rlctl speaks."""

    def health_route(self, rollout: RolloutConfig, paused: bool) -> str:
        """The route the controller's watch asks (no credential) to tell a live server from a
        frozen or broken one. SGLang's protocol: /health_generate while it generates, /health
        while it is paused (a paused SGLang server's generation check answers 503: protocol.py);
        vLLM's /health checks its engine without generating."""
        if self.protocol(rollout) is ServerProtocol.VLLM:
            return "/health"
        return "/health" if paused else "/health_generate"

    def health_env(self, rollout: RolloutConfig) -> dict[str, str]:
        """The environment a server of this engine starts with for health_route to hold: an
        SGLang-protocol server's /health must not generate."""
        if self.protocol(rollout) is ServerProtocol.VLLM:
            return {}
        from rlctl.engines.rollout.protocol import HEALTH_GENERATION_ENV

        return {HEALTH_GENERATION_ENV: "false"}

    def sync_target(self, recipe: Recipe) -> dict[str, Any]:
        """What the trainer must know of the servers it sends weights to, beyond their URLs."""
        return {"protocol": self.protocol(recipe.rollout)}

    def sync_backend(self, recipe: Recipe) -> SyncBackend | None:
        """train.sync_backend=auto: the backend this engine needs, None where the run's placement
        decides (rlctl/control/controller.py sync_backend)."""
        return None

    # The protocol's side: the adapters of SGLang and vLLM, the two protocols.
    def client(self, url: str, session: aiohttp.ClientSession, token: str | None, **kwargs: Any) -> RolloutClient:
        """An HTTP client of a server that speaks this engine's protocol."""
        from rlctl.engines.rollout.client import RolloutClient

        return RolloutClient(url, session, token, **kwargs)

    def sender(self, clients: list[RolloutClient], *, server: dict[str, Any] | None, device: str | None,
               **common: Any) -> WeightSender:
        """Trainer rank 0's weight sender to servers of this engine's protocol. `server`: what the
        controller said of them (sync_target); `device`: the trainer's GPU, if any."""
        from rlctl.engines.weightsync.sender import WeightSender

        return WeightSender(clients, **common)
