"""rollout.engine=vllm: vLLM's OpenAI server, in dev mode, behind the same controller as SGLang.

rlctl talks to vLLM only over HTTP (vllm_client.py), so nothing here imports vllm: this module
builds the command and environment that start a server and knows which vLLM releases the adapter
speaks. Facts below are read from vLLM's own source, 0.33.0 and 0.34.0 (tests/vllm_source.py reads
the wheels; tests/test_vllm_contract.py checks every one):

- `vllm serve MODEL` is `python -m vllm.entrypoints.cli.main serve MODEL` (the wheel's console script).
- The routes a trainer needs (pause, resume, abort_requests, the weight-transfer routes) are
  registered only when VLLM_SERVER_DEV_MODE=1 (entrypoints/launchers/api_server/routers.py).
- Weight transfer over NCCL needs `--weight-transfer-config '{"backend": "nccl"}'`.
- vLLM's own api key (VLLM_API_KEY, read from the environment when --api-key is not given) guards
  only paths under /v1, /v2, /inference and /cohere (serve/middleware/authenticate.py): the dev
  routes would be open to anyone who reaches the port, and it lets every OPTIONS request through.
  `--middleware` adds rlctl's TokenDoor (auth.py), which asks every route but /health, with
  any method, for the same token.
- Data parallelism is several servers, one per TP group, as with SGLang: the controller spreads
  requests itself and pauses and aborts each server.
"""

from __future__ import annotations

import importlib.util
import json

from rlctl.engines.rollout.protocol import parse_version
from rlctl.errors import RunError
from rlctl.recipe import VLLM_NEWEST, VLLM_OLDEST, VllmConfig

DOOR = "rlctl.engines.rollout.vllm.auth.TokenDoor"
"""The ASGI middleware vLLM imports (--middleware) to guard every route with the run's token."""
SPOKEN = f"{'.'.join(map(str, VLLM_OLDEST))} .. {'.'.join(map(str, VLLM_NEWEST))}"
INSTALL = f"pip install 'vllm>={'.'.join(map(str, VLLM_OLDEST))},<={'.'.join(map(str, VLLM_NEWEST))}'"


def launch_command(python: str, model_path: str, cfg: VllmConfig, *, host: str, port: int, seed: int,
                   sleep_mode: bool = False) -> list[str]:
    """The command line of one vLLM server (the same on every node, its port from the plan). It
    holds no secret: the token goes in the environment (launch_env). `sleep_mode`: a colocated
    server, whose /sleep moves memory only with --enable-sleep-mode."""
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", model_path,
           "--host", host, "--port", str(port), "--tensor-parallel-size", str(cfg.tp_size),
           "--dtype", cfg.dtype, "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
           "--seed", str(seed), "--weight-transfer-config", json.dumps({"backend": "nccl"}),
           "--middleware", DOOR]
    if cfg.max_model_len:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if sleep_mode:
        cmd.append("--enable-sleep-mode")
    return cmd + list(cfg.extra_args)


def launch_env(token: str) -> dict[str, str]:
    """What a vLLM server's environment adds: dev mode (the trainer's routes) and the run's token."""
    return {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": token}


def check_version(version: str) -> tuple[int, int, int]:
    """The release a server reports (GET /version), or a RunError naming the releases rlctl speaks."""
    v = parse_version(version)
    if v is None or not VLLM_OLDEST <= v[:3] <= VLLM_NEWEST:
        raise RunError(f"vLLM {version} is outside the releases rlctl's adapter was checked against ({SPOKEN}); "
                       f"{INSTALL}, or use rollout.engine=sglang or builtin")
    return v[0], v[1], v[2]


def require_vllm() -> None:
    """vLLM is importable here, and a release rlctl speaks: checked before a server or the
    trainer starts (by the installed package's metadata; importing vLLM takes seconds)."""
    from importlib import metadata

    if importlib.util.find_spec("vllm") is None:
        raise RunError(f"rollout.engine=vllm needs vLLM where its servers and trainer rank 0 run ({INSTALL}), "
                       "or set rollout.engine=builtin")
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise RunError(f"a vllm package is importable here but not installed as one (no metadata); {INSTALL}") from None
    check_version(version)
