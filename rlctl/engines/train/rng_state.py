"""A trainer rank's RNG states as JSON: trainer/rng-rank-R.json in a checkpoint.

    {"format": 1,
     "python": {"version": 3, "internal": [625 ints], "gauss_next": null},      random.getstate()
     "numpy":  {"kind": "MT19937", "keys": [624 ints], "pos": 624, "has_gauss": 0,
                "cached_gaussian": 0.0},                                      np.random.get_state()
     "torch":  {"dtype": "uint8", "shape": [5056], "base64": "..."},         torch.get_rng_state()
     "cuda":   [{...}, ...],                                  torch.cuda.get_rng_state_all(), if used
     "extra":  {"megatron_cuda": {"model-parallel-rng": {...}}}}   the engine's own uint8 states

Plain JSON, so loading it runs no code whatever the file holds (an earlier format was a torch
pickle). The torch states are the uint8 tensors they are, as base64 of their bytes; floats are
written as Python's repr, which reads back to the same float, so the states come back exactly.
"""

from __future__ import annotations

import base64
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlctl.engines.train.ckpt_files import TRAINER_DIR
from rlctl.errors import RunError

FORMAT = 1


def rng_file(path: str | Path, rank: int) -> Path:
    return Path(path) / TRAINER_DIR / f"rng-rank-{rank}.json"


def tensor_to_json(t: torch.Tensor) -> dict[str, Any]:
    """A uint8 RNG state tensor as {"dtype", "shape", "base64"}."""
    if t.dtype != torch.uint8:
        raise ValueError(f"an RNG state is a uint8 tensor, not {t.dtype}")
    data = t.detach().cpu().contiguous().numpy().tobytes()
    return {"dtype": "uint8", "shape": list(t.shape), "base64": base64.b64encode(data).decode("ascii")}


def tensor_from_json(d: Any) -> torch.Tensor:
    if not isinstance(d, dict) or d.get("dtype") != "uint8" or not isinstance(d.get("shape"), list):
        raise ValueError('a tensor is {"dtype": "uint8", "shape": [...], "base64": ...}')
    raw = base64.b64decode(d["base64"], validate=True)
    if len(raw) != math.prod(d["shape"]):
        raise ValueError(f"{len(raw)} bytes for shape {d['shape']}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(d["shape"]).clone()


def capture(**extra: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This process's RNG states (python, numpy if installed, torch CPU, CUDA if in use) and the
    engine's own named uint8 states, as JSON-ready data."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "format": FORMAT,
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "torch": tensor_to_json(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [tensor_to_json(t) for t in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:
        pass
    state["extra"] = {name: {k: tensor_to_json(t) for k, t in group.items()} for name, group in extra.items()}
    return state


@dataclass
class RngState:
    """A rank's RNG states read from their file and checked, not yet set: an engine reads every
    file of a checkpoint before it changes anything, so a refused checkpoint leaves it as it was."""

    python: tuple
    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    numpy: tuple | None
    extra: dict[str, dict[str, torch.Tensor]]

    def apply(self) -> dict[str, dict[str, torch.Tensor]]:
        """Set this process's RNG states; returns the engine's own (extra)."""
        random.setstate(self.python)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda)
        if self.numpy is not None:
            import numpy as np

            np.random.set_state(self.numpy)
        return self.extra


def decode(state: dict[str, Any]) -> RngState:
    """capture()'s data as RngState; ValueError, KeyError or TypeError if it is not that."""
    if state.get("format") != FORMAT:
        raise ValueError(f"format {state.get('format')!r}, not {FORMAT}")
    py = state["python"]
    internal = tuple(int(x) for x in py["internal"])
    cpu = tensor_from_json(state["torch"])
    if len(internal) != 625 or cpu.numel() != torch.get_rng_state().numel():
        raise ValueError("the python or torch state has the wrong size")
    numpy_state = None
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        keys = np.array(n["keys"], dtype=np.uint32)
        if n["kind"] != "MT19937" or keys.shape != (624,):
            raise ValueError("the numpy state is not MT19937's 624 keys")
        numpy_state = ("MT19937", keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))
    gauss_next = None if py["gauss_next"] is None else float(py["gauss_next"])
    return RngState(
        python=(int(py["version"]), internal, gauss_next),
        cpu=cpu,
        cuda=[tensor_from_json(t) for t in state["cuda"]] if "cuda" in state else None,
        numpy=numpy_state,
        extra={
            name: {k: tensor_from_json(t) for k, t in group.items()} for name, group in state.get("extra", {}).items()
        },
    )


def save_rng(path: str | Path, rank: int, **extra: dict[str, torch.Tensor]) -> None:
    """This rank's RNG states into path/trainer/rng-rank-R.json (extra: the engine's own named
    uint8 states, such as Megatron's CUDA RNG tracker's)."""
    f = rng_file(path, rank)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(capture(**extra)) + "\n")


def read_rng(path: str | Path, rank: int) -> RngState:
    """This rank's RNG states from path/trainer/rng-rank-R.json, checked (RunError naming the file
    otherwise), to apply() once the rest of the checkpoint is read. A checkpoint of the earlier
    pickle format is refused without its file being read."""
    f = rng_file(path, rank)
    if not f.is_file():
        if f.with_suffix(".pt").exists():
            raise RunError(
                f"{f.with_suffix('.pt')}: an RNG state pickled by an earlier rlctl, which is not loaded "
                "(a pickle can run code); start a new run from this checkpoint's policy with "
                f"model.path={Path(path) / 'hf'}"
            )
        raise RunError(f"{f} is missing: the checkpoint was written by fewer trainer ranks than train.ranks")
    try:
        return decode(json.loads(f.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RunError(f"{f}: not an RNG state rlctl can restore ({e})") from None


def load_rng(path: str | Path, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """read_rng(path, rank).apply(): restore this rank's RNG states; returns the engine's own."""
    return read_rng(path, rank).apply()
