"""The trainer's part of a checkpoint, as files (rlctl/run/checkpoint.py has the layout and the
atomic rename; this module writes and reads what goes inside):

    hf/                       the policy as a Hugging Face model directory: config.json,
                              *.safetensors, the tokenizer files of the run's model directory
    trainer/engine.json       engine, weight version (optimizer steps taken), ranks
    trainer/optimizer.pt      torch engine: the optimizer's state_dict (rank 0; the ranks are replicas)
    trainer/megatron/         Megatron engine: model + distributed optimizer (megatron.core.dist_checkpointing)
    trainer/critic.pt         torch engine, PPO: the critic's state_dict and its optimizer's
    trainer/rng-rank-R.json   every rank: python random, numpy and torch (CPU, CUDA) RNG states, as
                              JSON (rlctl/engines/train/rng_state.py)

Nothing here is unpickled beyond what torch.load(weights_only=True) reads (tensors and plain
containers): weights are safetensors, the RNG states and engine.json are JSON, and the
Megatron engine's dist_checkpointing files are vetted first (rlctl/engines/train/dcp_check.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rlctl.errors import RunError

HF_DIR = "hf"
TRAINER_DIR = "trainer"
ENGINE_FILE = "engine.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")
WRITTEN_BY_EXPORT = ("config.json", "generation_config.json", "model.safetensors.index.json",
                     "pytorch_model.bin.index.json")
SHARD_BYTES = 4 << 30


def trainer_dir(path: str | Path) -> Path:
    out = Path(path) / TRAINER_DIR
    out.mkdir(parents=True, exist_ok=True)
    return out


def copy_model_files(model_path: str | Path, hf_dir: Path, with_config: bool = False) -> None:
    """The model directory's files other than its weights (tokenizer, chat template, custom code),
    so that hf/ works as a model path; config.json too when the caller writes no config itself."""
    hf_dir.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(model_path).iterdir()):
        if not f.is_file() or f.name.endswith(WEIGHT_SUFFIXES) or f.name.startswith("."):
            continue
        if f.name in WRITTEN_BY_EXPORT and not (with_config and f.name in ("config.json", "generation_config.json")):
            continue
        shutil.copy2(f, hf_dir / f.name)


def write_safetensors(weights: Iterable[tuple[str, torch.Tensor]], hf_dir: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """HF-named tensors as model.safetensors, or model-0000i-of-0000n.safetensors shards with
    model.safetensors.index.json when they exceed shard_bytes (as transformers writes them)."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
    hf_dir.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    index: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(hf_dir / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (hf_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2) + "\n")


def read_safetensors(hf_dir: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f), device=device))
    if not state:
        raise RunError(f"{hf_dir}: no *.safetensors files in the checkpoint")
    return state


def write_engine_info(path: str | Path, **info: Any) -> None:
    (trainer_dir(path) / ENGINE_FILE).write_text(json.dumps(info, indent=2) + "\n")


def read_engine_info(path: str | Path) -> dict[str, Any]:
    f = Path(path) / TRAINER_DIR / ENGINE_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"{f}: not a trainer checkpoint ({e})") from None
