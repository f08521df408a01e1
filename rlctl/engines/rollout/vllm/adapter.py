"""VllmAdapter: rollout.engine=vllm as the rest of rlctl sees it (rlctl/engines/rollout/adapter.py)."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from rlctl.engines.rollout.adapter import DTYPE_BYTES, RolloutAdapter, ServerStart
from rlctl.engines.rollout.vllm.launch import INSTALL, check_version, launch_command, launch_env, require_vllm
from rlctl.recipe import Recipe, RolloutConfig, RolloutEngine, SyncBackend

if TYPE_CHECKING:
    import aiohttp

    from rlctl.engines.rollout.client import RolloutClient
    from rlctl.engines.weightsync.sender import WeightSender

log = logging.getLogger("rlctl.control.controller")


class VllmAdapter(RolloutAdapter):
    engine = RolloutEngine.VLLM
    title = "vLLM"
    module = "vllm"
    install = INSTALL

    def served_bytes(self, rollout: RolloutConfig) -> float:
        return DTYPE_BYTES.get(str(rollout.vllm.dtype), 2.0)

    def memory_fraction(self, rollout: RolloutConfig) -> float | None:
        return rollout.vllm.gpu_memory_utilization

    def check_installed(self) -> None:
        super().check_installed()
        require_vllm()  # and a release rlctl speaks

    def trainer_requires(self) -> None:
        require_vllm()  # the weight group is vLLM's own (group.py)

    def start(self, s: ServerStart) -> None:
        """The vLLM server takes this process over, as SGLang's does; the run's token reaches it
        in its environment (VLLM_API_KEY, never on a command line) and guards every route but
        /health (auth.py); dev mode gives it the routes a trainer drives."""
        require_vllm()
        s.bind_gpus(s.recipe.rollout.vllm.tp_size)
        key = s.own_key()
        env = launch_env(key)
        os.environ.setdefault("VLLM_SERVER_DEV_MODE", env.pop("VLLM_SERVER_DEV_MODE"))
        os.environ.update(env)
        s.exec(launch_command(sys.executable, s.model_path, s.recipe.rollout.vllm, host=s.host, port=s.role.port,
                              seed=s.seed, sleep_mode=s.recipe.colocate.enabled), key)

    async def check(self, rollout: RolloutConfig, clients: list[RolloutClient]) -> None:
        for c in clients:
            version = await c.version()
            check_version(version)
            await c.is_paused()  # a dev route: a server without VLLM_SERVER_DEV_MODE=1 has none
            log.info("%s: vLLM %s (dev mode)", c.url, version)

    def sync_target(self, recipe: Recipe) -> dict[str, Any]:
        """vLLM has no route that says the dtype its weights are held in: the recipe says it."""
        return {"protocol": "vllm", "server": {"dtype": str(recipe.rollout.vllm.dtype),
                                               "model_path": os.path.expanduser(recipe.model.path)}}

    def sync_backend(self, recipe: Recipe) -> SyncBackend | None:
        return SyncBackend.NCCL  # vLLM's workers receive over NCCL only

    def client(self, url: str, session: aiohttp.ClientSession, token: str | None, **kwargs: Any) -> RolloutClient:
        from rlctl.engines.rollout.vllm.client import VllmClient

        return VllmClient(url, session, token, **kwargs)

    def sender(self, clients: list[RolloutClient], *, server: dict[str, Any] | None, device: str | None,
               **common: Any) -> WeightSender:
        from rlctl.engines.rollout.vllm.sender import VllmWeightSender

        return VllmWeightSender(clients, server=server, device=device, **common)
