"""A checkpoint's manifest: every file it holds, with its size and sha256, written when the
checkpoint is saved and checked before anything of it is loaded.

    checkpoints/step-000004/manifest.json
      {"format": 1, "files": {"controller.json": {"bytes": 312, "sha256": "..."},
                              "hf/model.safetensors": {...}, "trainer/engine.json": {...}, ...}}

The controller writes it after the trainer has written its part and before the directory is
renamed into place (rlctl/run/checkpoint.py). `rlctl resume`, a Slurm job's next attempt, the
trainer's /load_checkpoint and `rlctl export` check it: a file missing, one more, another size or
other bytes, or a symbolic link anywhere in the checkpoint, and the checkpoint is refused with one
line naming it and the first file that differs. It tells a checkpoint that was changed or broken
after it was written from the one rlctl wrote; it is no signature (whoever can write the run
directory can write a manifest too): that nothing in a checkpoint is unpickled is what keeps a
crafted file from running code (docs/security.md).

Sizes are compared first, for every file, so a truncated file is named without hashing the
others; sha256 reads at disk speed (about 1-2 s per GB).

Nothing here imports torch: `rlctl resume` and `rlctl export` check checkpoints through it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rlctl.errors import RunError

MANIFEST = "manifest.json"
FORMAT = 1


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _listing(ckpt_dir: Path) -> dict[str, Path]:
    """Every file under ckpt_dir but the manifest, by its path relative to ckpt_dir ('/'-separated);
    a symbolic link (rlctl writes none) is a RunError naming it."""
    found: dict[str, Path] = {}
    for d, dirs, files in os.walk(ckpt_dir):
        for name in sorted(dirs + files):
            path = Path(d) / name
            rel = path.relative_to(ckpt_dir).as_posix()
            if path.is_symlink():
                raise RunError(
                    f"{ckpt_dir}: {rel} is a symbolic link; a checkpoint holds plain files only, and this "
                    "one is not loaded"
                )
            if name in files and rel != MANIFEST:
                found[rel] = path
    return found


def write_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """Record every file of ckpt_dir (its size and sha256) in ckpt_dir/manifest.json; returns it."""
    files = {
        rel: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for rel, p in sorted(_listing(ckpt_dir).items())
    }
    manifest = {"format": FORMAT, "files": files}
    (ckpt_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _read_manifest(ckpt_dir: Path) -> dict[str, dict[str, Any]]:
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        raise RunError(
            f"{ckpt_dir}: no {MANIFEST}, so it is not loaded (a checkpoint written before rlctl recorded "
            "one, or not by rlctl); its policy, hf/, is a Hugging Face model directory: start a new run "
            "from it with model.path"
        )
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        ):
            raise ValueError(f"not format {FORMAT} with bytes and sha256 per file")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise RunError(f"{path}: not a checkpoint manifest ({e}); the checkpoint is not loaded") from None
    return files


def first_difference(ckpt_dir: Path) -> str | None:
    """How ckpt_dir differs from its manifest, for the first file that does ("hf/x: missing"),
    or None when every file is as recorded."""
    recorded = _read_manifest(ckpt_dir)
    present = _listing(ckpt_dir)
    for rel in sorted(set(recorded) | set(present)):
        if rel not in present:
            return f"{rel} is missing"
        if rel not in recorded:
            return f"{rel} is not in the manifest"
        size = present[rel].stat().st_size
        if size != recorded[rel]["bytes"]:
            return f"{rel} has {size} bytes, the manifest {recorded[rel]['bytes']}"
    for rel in sorted(recorded):
        if file_sha256(present[rel]) != recorded[rel]["sha256"]:
            return f"{rel} has other bytes than the manifest's sha256"
    return None


def check_manifest(ckpt_dir: Path) -> None:
    """A RunError in one line when ckpt_dir does not match its manifest (or has none)."""
    ckpt_dir = Path(ckpt_dir)
    why = first_difference(ckpt_dir)
    if why is not None:
        raise RunError(
            f"{ckpt_dir}: {why}: the checkpoint does not match its {MANIFEST} and is not loaded; move it "
            "out of checkpoints/ to resume from an earlier one"
        )
