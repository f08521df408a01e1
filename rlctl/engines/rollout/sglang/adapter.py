"""SGLangAdapter: rollout.engine=sglang as the rest of rlctl sees it (rlctl/engines/rollout/adapter.py)."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from rlctl.engines.rollout.adapter import DTYPE_BYTES, RolloutAdapter, ServerStart
from rlctl.engines.rollout.sglang.launch import (INSTALL, colocated_flags, launch_command, options_file, require_sglang,
                                                 speaks)
from rlctl.recipe import RolloutConfig, RolloutEngine

if TYPE_CHECKING:
    from rlctl.engines.rollout.client import RolloutClient

log = logging.getLogger("rlctl.control.controller")


class SGLangAdapter(RolloutAdapter):
    engine = RolloutEngine.SGLANG
    title = "SGLang"
    module = "sglang"
    install = INSTALL

    def served_bytes(self, rollout: RolloutConfig) -> float:
        return DTYPE_BYTES.get(str(rollout.sglang.dtype), 2.0)

    def memory_fraction(self, rollout: RolloutConfig) -> float | None:
        return rollout.sglang.mem_fraction_static

    def start(self, s: ServerStart) -> None:
        """The SGLang server takes this process over, the run's token its api key by a 0600
        --config file; what it logs passes a filter that hides the key (SGLang logs its
        server_args, api_key included)."""
        require_sglang()
        os.environ.update(self.health_env(s.recipe.rollout))  # its /health answers while paused
        s.bind_gpus(s.recipe.rollout.sglang.tp_size)
        key = s.own_key()
        config = options_file(s.rd.path / f"sglang-{s.role.name}.yaml", key)
        colocate = s.recipe.colocate
        s.exec(launch_command(sys.executable, s.model_path, s.recipe.rollout.sglang, host=s.host, port=s.role.port,
                              seed=s.seed, config=str(config),
                              extra=colocated_flags(colocate.server_release) if colocate.enabled else None), key)

    async def check(self, rollout: RolloutConfig, clients: list[RolloutClient]) -> None:
        for c in clients:
            info = await c.server_info()
            log.info("%s: SGLang %s (%s)", c.url, info.get("version"), speaks(str(info.get("version", ""))))
