"""`rlctl export` copies what the checkpoint holds and nothing else: a symlink that leads out of the
checkpoint's directory (or a FIFO, or a loop) stops the copy with one line, and whatever stops it,
no temporary directory is left beside the target. The checkpoints here are built by hand (the copy
reads files, not models); tests/test_checkpoint.py exports a real run's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import rlctl_here
from rlctl.commands.export import write_export
from rlctl.errors import RunError

RUN_ID = "quick-20261201-120000-00aa"


def a_checkpoint(root: Path) -> Path:
    """A run directory with one checkpoint, step 4, whose hf/ holds a config and weights; its hf/."""
    run = root / "runs" / RUN_ID
    hf = run / "checkpoints" / "step-000004" / "hf"
    hf.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"id": RUN_ID}))
    (hf.parent / "controller.json").write_text('{"steps": 4}\n')
    (hf / "config.json").write_text('{"model_type": "qwen3"}\n')
    (hf / "model.safetensors").write_bytes(os.urandom(4096))
    return hf


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("plant", ["file", "directory", "parent"])
def test_a_symlink_out_of_the_checkpoint_stops_the_copy_and_leaves_nothing(tmp_path, plant):
    secret = tmp_path / "home" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("PRIVATE KEY\n")
    hf = a_checkpoint(tmp_path)
    if plant == "file":
        (hf / "tokenizer.json").symlink_to(secret)
    elif plant == "directory":
        (hf / "extra").symlink_to(secret.parent)
    else:
        (hf / "up").symlink_to("../../..")  # the run directory: outside the checkpoint too
    out = tmp_path / "exported" / "policy"
    with pytest.raises(RunError, match="leads out of the checkpoint") as info:
        write_export(hf, hf.parent, out)
    assert str(info.value).endswith("nothing exported") and "\n" not in str(info.value)
    assert not out.exists() and leftovers(out.parent) == []


def test_a_fifo_in_the_checkpoint_is_refused_not_waited_on(tmp_path):
    hf = a_checkpoint(tmp_path)
    os.mkfifo(hf / "pipe")
    with pytest.raises(RunError, match="is not a regular file or a directory"):
        write_export(hf, hf.parent, tmp_path / "policy")
    assert not (tmp_path / "policy").exists() and leftovers(tmp_path) == []


def test_a_symlink_loop_is_refused(tmp_path):
    hf = a_checkpoint(tmp_path)
    (hf / "sub").mkdir()
    (hf / "sub" / "again").symlink_to("..")
    with pytest.raises(RunError, match="a loop"):
        write_export(hf, hf.parent, tmp_path / "policy")
    assert leftovers(tmp_path) == []


def test_a_symlink_within_the_checkpoint_is_copied_as_its_file(tmp_path):
    hf = a_checkpoint(tmp_path)
    (hf / "sub").mkdir()
    (hf / "sub" / "tokenizer.json").write_text("{}\n")
    (hf / "tokenizer.json").symlink_to("sub/tokenizer.json")
    (hf / "state.json").symlink_to("../controller.json")  # inside the checkpoint's directory
    out = tmp_path / "policy"
    write_export(hf, hf.parent, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "state.json",
        "sub",
        "tokenizer.json",
    ]
    assert not (out / "tokenizer.json").is_symlink() and (out / "tokenizer.json").read_text() == "{}\n"
    assert (out / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    assert (out / "state.json").read_text() == '{"steps": 4}\n' and leftovers(tmp_path) == []


def test_the_command_refuses_a_checkpoint_with_a_symlink_out_in_one_line(tmp_path):
    from rlctl.run.manifest import write_manifest

    hf = a_checkpoint(tmp_path)
    write_manifest(hf.parent)  # as the run wrote it; the link is planted after
    (hf / "tokenizer.json").symlink_to("/etc/passwd")
    out = tmp_path / "policy"
    res = rlctl_here("export", RUN_ID, str(out), "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: ") and "tokenizer.json" in line and "root:" not in res.stdout + res.stderr
    assert not out.exists() and leftovers(tmp_path) == []
