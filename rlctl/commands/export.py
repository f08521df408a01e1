"""`rlctl export RUN [--step N] DIR`: a checkpoint's policy, or a completed run's final policy
(RUN/final/, written at its end: run.save_final), as a plain Hugging Face model directory
(config.json, safetensors, tokenizer files), loadable by transformers and servable by SGLang or
vLLM. Without --step: the newest of them.

What is copied is the checkpoint's own: a symlink in it is followed only while it stays inside the
checkpoint's directory (one leading out, to /etc/passwd or another user's files, stops the export
with one line), and only regular files and directories are copied (a FIFO would block the copy).
The copy is made in a temporary directory beside DIR and renamed into place: DIR is complete or
absent, and the temporary directory is removed whatever stops the copy.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import typer

from rlctl.errors import RunError, UsageError


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def copy_within(src: Path, dst: Path, root: Path) -> None:
    """Copy the directory `src` into the existing directory `dst`, following symlinks that resolve
    inside `root` and refusing (RunError) one that leads out of it, a loop, or anything that is
    neither a regular file nor a directory."""
    top = os.path.realpath(root)
    if not _inside(os.path.realpath(src), top):
        raise RunError(f"{src} leads out of the checkpoint ({os.path.realpath(src)}); nothing exported")
    stack = [(src, dst)]
    while stack:
        here, there = stack.pop()
        for entry in sorted(os.scandir(here), key=lambda e: e.name):
            real = os.path.realpath(entry.path)
            if not _inside(real, top):
                raise RunError(
                    f"{entry.path} is a symlink that leads out of the checkpoint (to {real}); nothing exported"
                )
            mode = os.stat(real).st_mode
            target = there / entry.name
            if stat.S_ISDIR(mode):
                if _inside(os.path.realpath(here), real):
                    raise RunError(f"{entry.path} is a symlink to a directory that holds it (a loop); nothing exported")
                target.mkdir()
                shutil.copystat(real, target)
                stack.append((Path(entry.path), target))
            elif stat.S_ISREG(mode):
                shutil.copy2(real, target)
            else:
                raise RunError(f"{entry.path} is not a regular file or a directory; nothing exported")


def write_export(src: Path, root: Path, out: Path) -> None:
    """Copy the directory `src` (copy_within `root`) to `out`, an empty or absent directory: into a
    temporary directory beside it, renamed into place at the end. Whatever stops the copy (a
    refusal, a full disk, Ctrl-C), the temporary directory is removed; an OSError becomes one line."""
    tmp: Path | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        copy_within(src, tmp, root)
        shutil.copystat(src, tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise RunError(
                f"export to {out} failed: {e.strerror or e} ({e.filename or out}); nothing exported"
            ) from None
        raise


def export(
    run: str = typer.Argument(..., help="A run id, name or run directory."),
    out: Path = typer.Argument(..., help="The directory to write (must not exist, or be empty)."),
    step: int | None = typer.Option(None, "--step", help="The checkpoint (or final policy) after this many steps "
                                    "(default: the newest)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
) -> None:
    """Write a checkpoint's policy, or the final policy, as a Hugging Face model directory."""
    from rlctl.run.checkpoint import find_checkpoint
    from rlctl.run.manifest import check_manifest
    from rlctl.run.find import find_run

    rd = find_run(run, runs_dir)
    ckpt = find_checkpoint(rd.path, step)
    check_manifest(ckpt.path)  # what is copied is what was saved (rlctl/run/manifest.py)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty directory; give a new directory")
    write_export(ckpt.hf, ckpt.path, out)
    what = "the final policy" if ckpt.is_final else "the checkpoint"
    typer.echo(f"exported {what} after {ckpt.steps} steps of {rd.id} ({ckpt.hf})", err=True)
    print(out)
