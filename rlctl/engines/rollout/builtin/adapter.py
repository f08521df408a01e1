"""BuiltinAdapter: rollout.engine=builtin as the rest of rlctl sees it (rlctl/engines/rollout/adapter.py).

The built-in server runs in the worker's own process (server.py), on the CPU or one GPU, and
speaks SGLang's protocol, or vLLM's with rollout.builtin.emulate_vllm: its emulations are its own
business, and the rest of rlctl sees only the protocol (rollout.protocol).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from rlctl.process.devices import process_device
from rlctl.process.auth import token_path
from rlctl.engines.rollout.adapter import RolloutAdapter, ServerStart, bound, record_key_id
from rlctl.recipe import Device, Launcher, Recipe, RolloutConfig, RolloutEngine, ServerProtocol, SyncBackend

if TYPE_CHECKING:
    from rlctl.engines.rollout.client import RolloutClient


class BuiltinAdapter(RolloutAdapter):
    engine = RolloutEngine.BUILTIN
    title = "the built-in server"
    expands_kv = True  # transformers' attention repeats the keys and values (repeat_kv)

    def tp_key(self) -> str | None:
        return None  # its extra TP ranks (builtin.tp_size) receive on the CPU and take no GPU

    def server_gpus(self, rollout: RolloutConfig, bind_cpu_servers: bool) -> int:
        """1 on cuda; a CPU server on a component that asks for GPUs is bound to 1 as well
        (harmless, and how the test cluster observes the binding)."""
        return int(rollout.device is Device.CUDA or bind_cpu_servers)

    def served_bytes(self, rollout: RolloutConfig) -> float:
        return 4.0  # it holds the trainer's fp32 weights

    def start(self, s: ServerStart) -> None:
        """Serve in this process: the socket first, then the key (a key in run.json is never that
        of a process without the port), the token file's path only in its arguments."""
        from rlctl.engines.rollout.builtin import server

        ro = s.recipe.rollout
        sock = bound(s.role)
        key_id = record_key_id(s.rd, s.role)
        args = server.parser().parse_args([  # a list in this process: the token file's path only, never the token
            "--model-path", s.model_path, "--host", s.host, "--port", str(s.role.port),
            "--api-key-file", str(token_path(s.rd.path)), "--key-scope", f"{s.role.name}/{key_id}",
            "--weight-group-master", s.plan.trainers[0].host,
            "--random-seed", str(s.seed),
            "--max-running-requests", str(ro.max_running_requests),
            "--threads", str(s.recipe.run.threads_per_process),
            "--device", s.device(),
            "--tp-size", str(ro.builtin.tp_size),
            *(["--emulate-sglang", ro.builtin.emulate_sglang] if ro.builtin.emulate_sglang else []),
            *(["--emulate-vllm", ro.builtin.emulate_vllm] if ro.builtin.emulate_vllm else []),
            *(["--enable-sleep-mode"] if ro.builtin.emulate_vllm and s.recipe.colocate.enabled else []),
        ])
        if ro.builtin.emulate_vllm:  # as a vLLM server rlctl starts (vllm/launch.py launch_env), unless told otherwise
            os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")
        os.environ.update(self.health_env(ro))  # as an SGLang server rlctl starts
        if ro.device is Device.CUDA:  # its KV cache grows by torch.cat each step: without it, reserved
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # blocks go unused
        server.serve(args, sock)

    async def check(self, rollout: RolloutConfig, clients: list[RolloutClient]) -> None:
        """Emulating vLLM, it is checked as a vLLM server is: the release it answers as, dev mode."""
        if rollout.protocol is ServerProtocol.VLLM:
            from rlctl.engines.rollout.vllm.adapter import VllmAdapter

            await VllmAdapter().check(rollout, clients)

    def sync_target(self, recipe: Recipe) -> dict[str, Any]:
        """Emulating vLLM, it holds the dtype the worker starts it with (vLLM has no route that says it)."""
        if recipe.rollout.protocol is ServerProtocol.VLLM:
            from rlctl.engines.rollout.builtin.server import parser

            return {"protocol": "vllm", "server": {"dtype": parser().get_default("dtype")}}
        return {"protocol": "sglang"}

    def sync_backend(self, recipe: Recipe) -> SyncBackend | None:
        return SyncBackend.IPC if colocated(recipe) else None


def colocated(recipe: Recipe) -> bool:
    """Is every rollout server on trainer rank 0's GPU? Local runs of TP-1 servers on CUDA, placed
    as the worker places them (rlctl/process/devices.py process_device)."""
    r = recipe.rollout
    if (recipe.launcher is not Launcher.LOCAL or recipe.train.device is not Device.CUDA or r.device is not Device.CUDA
            or r.builtin.tp_size != 1):
        return False
    trainer = process_device(Device.CUDA, 0, recipe.train.gpus)
    return all(process_device(Device.CUDA, i, r.gpus) == trainer for i in range(r.servers))
