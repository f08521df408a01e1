"""The pickles of a Megatron dist_checkpointing directory, vetted before Megatron reads them.

megatron-core 0.19.2 writes the Megatron engine's model and optimizer (trainer/megatron/ and
trainer/megatron-critic/) in torch.distributed.checkpoint's format: __R_0.distcp files,
metadata.json and .metadata. dist_checkpointing.load reads two kinds of pickle from them with
no restriction on what they may call:
- `.metadata`: torch's FileSystemReader.read_metadata() is a plain pickle.load (the index of
  every tensor and object: torch.distributed.checkpoint.metadata's dataclasses);
- the byte objects (Megatron's ShardedObjects: the common state, the optimizer's param groups,
  its bucket sizes), each a torch.save() of plain data stored inside a .distcp file:
  DefaultLoadPlanner.load_bytes() reads them with torch.load(weights_only=False).
The tensors themselves are read with weights_only=True. A legacy `common.pt` would be read with
torch.load's default (weights_only=True since torch 2.6); 0.19.2 no longer writes one.

Neither reader can be swapped from outside (load_common_state_dict makes its own), so rlctl reads
the same bytes first, restricted: `.metadata` with an unpickler that finds only the classes such
an index holds (METADATA_GLOBALS, torch's dtypes), and every byte object with
torch.load(weights_only=True); each must also lie in a file of the directory itself. Whatever
passes holds nothing that can run code, and Megatron's unrestricted reads of the same bytes then
build the same plain objects. Anything else refuses the checkpoint in one line, before Megatron
reads it. The checkpoint's manifest (rlctl/run/manifest.py) has been checked before this.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from rlctl.errors import RunError

METADATA_FILE = ".metadata"
LEGACY_COMMON = "common.pt"
METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
"""What torch.distributed.checkpoint's .metadata pickles reference (torch 2.13, as megatron-core
0.19.2 writes them): its dataclasses, torch.Size, layouts, and the checkpoint id as a path."""


class _MetadataUnpickler(pickle.Unpickler):
    """Finds only METADATA_GLOBALS and torch's dtypes; anything else stops the load."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it references {module}.{name}, which no checkpoint index holds")


def read_metadata(directory: Path) -> Any:
    """directory/.metadata, unpickled with only the classes a checkpoint index holds."""
    f = directory / METADATA_FILE
    try:
        with open(f, "rb") as fh:
            return _MetadataUnpickler(fh).load()
    except OSError as e:
        raise RunError(f"{f}: cannot read the checkpoint index ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - any failure of a crafted pickle is a refusal
        raise RunError(f"{f}: refused, not loaded: {e}") from None


def _storage_file(directory: Path, info: Any, key: Any) -> Path:
    """The file of the directory a stored item lies in; a RunError if it would lie elsewhere."""
    name = getattr(info, "relative_path", None)
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
        raise RunError(
            f"{directory / METADATA_FILE}: item {key} lies in {name!r}, not in a file of this directory; "
            "refused, not loaded"
        )
    if getattr(info, "transform_descriptors", None):
        raise RunError(
            f"{directory / METADATA_FILE}: item {key} is stored transformed "
            f"({info.transform_descriptors}), which rlctl does not write; refused, not loaded"
        )
    return directory / name


def check_dist_checkpoint(directory: str | Path) -> None:
    """Vet a dist_checkpointing directory before megatron.core.dist_checkpointing.load reads it
    (module docstring): a RunError naming the file and the item that would not pass."""
    directory = Path(directory)
    if (directory / LEGACY_COMMON).exists():
        raise RunError(
            f"{directory / LEGACY_COMMON}: a legacy common-state pickle, which rlctl never writes; refused, not loaded"
        )
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_metadata(directory)
    try:
        objects = {fqn for fqn, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
        stored = list(metadata.storage_data.items())
    except AttributeError as e:
        raise RunError(f"{directory / METADATA_FILE}: not a checkpoint index ({e}); refused, not loaded") from None
    for key, info in stored:
        f = _storage_file(directory, info, key)
        fqn = getattr(key, "fqn", None)
        if fqn not in objects:
            continue
        try:
            with open(f, "rb") as fh:
                fh.seek(int(info.offset))
                raw = fh.read(int(info.length))
            torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure of a crafted object is a refusal
            lines = str(e).strip().splitlines()
            why = next(
                (line for line in lines if "Unsupported global" in line), lines[0] if lines else type(e).__name__
            )
            why = why.removeprefix("WeightsUnpickler error: ").split(". Please use")[0].strip()  # not torch's advice
            raise RunError(
                f"{f}: object {fqn!r} does not load with torch.load(weights_only=True) ({why}); refused, not loaded"
            ) from None
