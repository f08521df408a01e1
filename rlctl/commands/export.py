"""`rlctl export RUN [--step N] DIR`: a checkpoint's policy as a plain Hugging Face model
directory (config.json, safetensors, tokenizer files), loadable by transformers and servable by
SGLang or vLLM."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import typer

from rlctl.errors import UsageError


def export(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    out: Path = typer.Argument(..., help="The directory to write (must not exist, or be empty)."),
    step: int | None = typer.Option(None, "--step", help="The checkpoint after this many steps (default: the newest)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
) -> None:
    """Write a checkpoint's policy as a Hugging Face model directory."""
    from rlctl.checkpoint import find_checkpoint
    from rlctl.rundir import find_run

    rd = find_run(run, runs_dir)
    ckpt = find_checkpoint(rd.path, step)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty directory; give a new directory")
    # Copied beside the target and renamed: DIR is complete or absent.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.copytree(ckpt.hf, tmp)
    if out.exists():
        out.rmdir()
    os.rename(tmp, out)
    typer.echo(f"exported step {ckpt.steps} of {rd.id} ({ckpt.hf})", err=True)
    print(out)
