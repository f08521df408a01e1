"""rollout.engine=sglang: SGLang servers behind the same client the built-in server uses.

rlctl talks to SGLang only over its HTTP API (rlctl/engines/rollout/client.py), so nothing here
imports sglang: this module builds the command that starts a server and knows which SGLang
versions the adapter speaks. Data parallelism is several servers (one per TP group; SGLang's
weight-update groups assume dp_size == 1); the controller spreads requests over them itself and
sends abort and pause to each one, since sglang_router does not forward those.

Versions: the request bodies and the weight-sync sequence follow SGLang 0.5.15 .. 0.5.23
(tests/test_sglang_contract.py checks them against the field lists of those versions). Servers
from 0.5.21 on refuse weight updates outside /begin_weight_update ... /end_weight_update; the
sender reads /server_info's version and opens that session only where it exists.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rlctl.engines.rollout.protocol import UPDATE_SESSION_SINCE, parse_version
from rlctl.process.auth import write_secret
from rlctl.errors import RunError
from rlctl.recipe import SGLANG_NEWEST as NEWEST_SPOKEN
from rlctl.recipe import SGLANG_OLDEST as OLDEST_SPOKEN
from rlctl.recipe import SGLangConfig


def colocated_flags(server_release: list[str]) -> list[str]:
    """A server that takes turns with the trainer (colocate.enabled): --enable-memory-saver, without
    which /release_memory_occupation frees nothing (its TorchMemorySaverAdapter is a no-op), and
    with released weights --enable-weights-cpu-backup, without which their bytes are gone when
    they come back (a turn back that is no weight sync resumes them as they were). Both
    ServerArgs fields of every supported release (tests/test_sglang_contract.py)."""
    return ["--enable-memory-saver", *(["--enable-weights-cpu-backup"] if "weights" in server_release else [])]


def launch_command(python: str, model_path: str, cfg: SGLangConfig, *, host: str, port: int, seed: int,
                   config: str, extra: list[str] | None = None) -> list[str]:
    """The command line of one SGLang server (the same on every node, its port from the plan).

    `config` is a 0600 YAML file of SGLang options holding the run's token as `api-key`
    (options_file below): SGLang's `--config FILE` reads it (server_args.py
    prepare_server_args, ConfigArgumentMerger, in 0.5.15 .. 0.5.23), so the key is never on a
    command line that `ps` shows."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--tp-size", str(cfg.tp_size),
           "--host", host, "--port", str(port), "--mem-fraction-static", str(cfg.mem_fraction_static),
           "--dtype", cfg.dtype, "--random-seed", str(seed)]
    if cfg.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    return cmd + [*(extra or []), "--config", config, *cfg.extra_args]


def options_file(path: Path, token: str) -> Path:
    """A YAML file of SGLang server options (its `--config FILE`) holding the api key, 0600. JSON
    quoting, which YAML reads the same, keeps the token a string whatever its characters."""
    write_secret(path, f"api-key: {json.dumps(token)}\n")
    return path


def speaks(version: str) -> str:
    """How the adapter talks to a server of this version: 'session' (>= 0.5.21: begin/end around
    weight updates), 'no-session', or raises for a version outside the range it was checked on."""
    v = parse_version(version)
    if v is None:
        raise RunError(f"SGLang server reports version {version!r}; the adapter speaks "
                       f"{'.'.join(map(str, OLDEST_SPOKEN))} to {'.'.join(map(str, NEWEST_SPOKEN))}")
    if not OLDEST_SPOKEN <= v[:3] <= NEWEST_SPOKEN:
        raise RunError(f"SGLang {version} is outside the versions rlctl's adapter was checked against "
                       f"({'.'.join(map(str, OLDEST_SPOKEN))} .. {'.'.join(map(str, NEWEST_SPOKEN))}); "
                       "use one of those, or rollout.engine=builtin")
    return "session" if v[:3] >= UPDATE_SESSION_SINCE else "no-session"


INSTALL = f"pip install 'sglang[all]>={'.'.join(map(str, OLDEST_SPOKEN))},<={'.'.join(map(str, NEWEST_SPOKEN))}'"


def require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        raise RunError(f"rollout.engine=sglang needs SGLang on the rollout nodes ({INSTALL}), "
                       "or set rollout.engine=builtin")
