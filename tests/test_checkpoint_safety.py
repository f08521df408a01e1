"""What a checkpoint may hold and where it may be, in-process: the RNG states as JSON come back
exactly and an RNG pickle is never read (rlctl/engines/train/rng_state.py); the trainer's paths
are confined to the run's checkpoints/ (rlctl/run/checkpoint.py); a checkpoint that does not match
its manifest is refused by resume and export (rlctl/run/manifest.py); a Megatron
dist_checkpointing directory whose pickles reach beyond plain data is refused before Megatron
reads it (rlctl/engines/train/dcp_check.py). The trainer service's routes are
tests/test_checkpoint_trainer.py."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import rlctl_here
from rlctl.run.checkpoint import CheckpointPathRefused, Checkpoint, confined_checkpoint_dir, prepare_resume
from rlctl.run.manifest import MANIFEST, check_manifest, write_manifest
from rlctl.engines.train.dcp_check import check_dist_checkpoint
from rlctl.engines.train.rng_state import load_rng, save_rng
from rlctl.errors import RunError
from rlctl.run.dir import RunDir, create_run_dir


class Planted:
    """Unpickled, it creates the file `marker`: what a crafted checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def draws() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(), torch.rand(4).tolist()


# -- RNG states as JSON ----------------------------------------------------------------------------


def test_rng_states_come_back_exactly_from_json(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # a cached gaussian in python's state
    np.random.randn()
    tracker = {"model-parallel-rng": torch.randint(0, 256, (16,), dtype=torch.uint8)}
    save_rng(tmp_path, 0, megatron_cuda=tracker)
    expected = draws()
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    assert draws() != expected
    extra = load_rng(tmp_path, 0)
    assert draws() == expected
    assert extra["megatron_cuda"]["model-parallel-rng"].equal(tracker["model-parallel-rng"])
    state = json.loads((tmp_path / "trainer" / "rng-rank-0.json").read_text())  # plain JSON, nothing else
    assert {"python", "numpy", "torch", "extra"} <= state.keys()


def test_an_rng_pickle_of_the_earlier_format_is_refused_without_being_read(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "trainer").mkdir()
    torch.save({"python": Planted(marker)}, tmp_path / "trainer" / "rng-rank-0.pt")
    with pytest.raises(RunError, match=r"rng-rank-0.pt: an RNG state pickled by an earlier rlctl.*model.path="):
        load_rng(tmp_path, 0)
    assert not marker.exists()


def test_an_rng_file_that_is_not_a_state_is_one_line(tmp_path):
    save_rng(tmp_path, 0)
    f = tmp_path / "trainer" / "rng-rank-0.json"
    state = json.loads(f.read_text())
    state["torch"]["shape"] = [3]
    f.write_text(json.dumps(state))
    with pytest.raises(
        RunError, match=r"rng-rank-0.json: not an RNG state rlctl can restore \(.*bytes for shape \[3\]"
    ):
        load_rng(tmp_path, 0)


# -- where the trainer may write and read ----------------------------------------------------------


def test_the_trainer_writes_only_temporary_and_reads_only_step_directories_of_its_run(tmp_path):
    run, other = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    for r in (run, other):
        (r / "checkpoints").mkdir(parents=True)
    ckpts = run / "checkpoints"
    tmp = ckpts / ".tmp-step-000004-123"
    assert confined_checkpoint_dir(run, str(tmp), "save") == tmp.resolve()
    assert confined_checkpoint_dir(run, str(ckpts / "step-000004"), "load") == (ckpts / "step-000004").resolve()
    assert confined_checkpoint_dir(run, str(ckpts / ".tmp-final-9"), "policy") == (ckpts / ".tmp-final-9").resolve()
    refused = {
        "save": [
            str(ckpts / "step-000004"),  # a complete checkpoint is never written over
            str(other / "checkpoints" / ".tmp-step-000004-123"),
            str(ckpts / ".tmp-step-000004-123" / ".." / ".." / ".." / "b" / "checkpoints" / ".tmp-step-000004-1"),
            str(ckpts / ".tmp-step-000004-123" / "trainer"),
            str(ckpts),
            "/etc/cron.d/x",
            "checkpoints/.tmp-step-000004-123",  # relative: resolved against who knows what
        ],
        "policy": [
            str(tmp),  # the final policy is written only where it is then renamed from
            str(run / "final"),
            str(other / "checkpoints" / ".tmp-final-9"),
            str(ckpts / ".tmp-final-9" / "hf"),
        ],
        "load": [
            str(tmp),
            str(other / "checkpoints" / "step-000004"),
            str(ckpts / "step-4"),
            str(tmp_path / "step-000004"),
        ],
    }
    for purpose, paths in refused.items():
        for p in paths:
            with pytest.raises(CheckpointPathRefused, match="checkpoints only in .*symbolic links and .. resolved"):
                confined_checkpoint_dir(run, p, purpose)


def test_a_symbolic_link_inside_checkpoints_does_not_lead_the_trainer_out(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    link = run / "checkpoints" / ".tmp-step-000002-7"
    link.symlink_to(tmp_path / "outside")
    with pytest.raises(CheckpointPathRefused, match=rf"{link} \(that is {tmp_path / 'outside'}\): refused"):
        confined_checkpoint_dir(run, str(link), "save")
    (run / "checkpoints" / "step-000002").symlink_to(tmp_path / "outside")
    with pytest.raises(CheckpointPathRefused):
        confined_checkpoint_dir(run, str(run / "checkpoints" / "step-000002"), "load")


# -- the manifest ------------------------------------------------------------------------------------


def a_checkpoint(path: Path) -> Path:
    (path / "hf").mkdir(parents=True)
    (path / "trainer").mkdir()
    (path / "hf" / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (path / "hf" / "config.json").write_text("{}\n")
    (path / "trainer" / "engine.json").write_text('{"version": 4}\n')
    (path / "controller.json").write_text('{"steps": 2, "t": 1.5}\n')
    write_manifest(path)
    return path


def test_a_checkpoint_matches_the_manifest_written_with_it(tmp_path):
    ckpt = a_checkpoint(tmp_path / "step-000002")
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert sorted(files) == ["controller.json", "hf/config.json", "hf/model.safetensors", "trainer/engine.json"]
    assert files["hf/model.safetensors"]["bytes"] == 256 * 64
    check_manifest(ckpt)


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda c: flip_byte(c / "hf" / "model.safetensors"), "hf/model.safetensors has other bytes"),
        (lambda c: (c / "trainer" / "rng-rank-0.pt").write_bytes(b"x"), "trainer/rng-rank-0.pt is not in the manifest"),
        (lambda c: (c / "trainer" / "engine.json").unlink(), "trainer/engine.json is missing"),
        (lambda c: (c / "controller.json").write_text("{}\n"), "controller.json has 3 bytes, the manifest 23"),
        (lambda c: (c / MANIFEST).unlink(), "no manifest.json, so it is not loaded"),
        (lambda c: (c / "hf" / "extra").symlink_to("/etc"), "hf/extra is a symbolic link"),
    ],
)
def test_a_checkpoint_changed_after_it_was_written_is_refused_in_one_line(tmp_path, change, why):
    ckpt = a_checkpoint(tmp_path / "step-000002")
    change(ckpt)
    with pytest.raises(RunError) as e:
        check_manifest(ckpt)
    assert str(e.value).startswith(f"{ckpt}: ") and why in str(e.value) and "\n" not in str(e.value)


def flip_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data))


def test_resume_and_export_refuse_a_tampered_checkpoint_and_change_nothing(tmp_path):
    runs = tmp_path / "runs"
    rd = create_run_dir(runs, "r", "run: {}\n", {"launcher": "local", "steps_total": 4, "plan": None})
    ckpt = a_checkpoint(rd.path / "checkpoints" / "step-000002")
    flip_byte(ckpt / "hf" / "model.safetensors")
    before = rd.path.joinpath("run.json").read_text()
    with pytest.raises(RunError, match="hf/model.safetensors has other bytes"):
        prepare_resume(RunDir(rd.path), Checkpoint(2, ckpt))
    assert rd.path.joinpath("run.json").read_text() == before
    res = rlctl_here("export", rd.id, str(tmp_path / "out"), "--runs-dir", str(runs), cwd=tmp_path)
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "hf/model.safetensors has other bytes" in res.stderr and not (tmp_path / "out").exists()


# -- Megatron's dist_checkpointing directories ---------------------------------------------------------


def dist_checkpoint(path: Path, objects: object) -> Path:
    """A torch.distributed.checkpoint directory as megatron-core writes one: tensors, and byte
    objects stored as the torch.save() bytes Megatron packs them into (MCoreSavePlanner)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class AsMegatron(DefaultSavePlanner):
        def transform_object(self, write_item, object):  # noqa: A002 - torch's name
            return object

    packed = io.BytesIO()
    torch.save(objects, packed)
    state = {"decoder.weight": torch.randn(4, 8), "common_state": packed}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), planner=AsMegatron(), no_dist=True)
    return path


def test_a_dist_checkpoint_of_plain_data_passes(tmp_path):
    groups = [
        {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "wd_mult": 1.0, "default_config": True}]},
        {0: {torch.float32: [[128, 64]]}},
    ]
    check_dist_checkpoint(dist_checkpoint(tmp_path / "megatron", groups))


def test_a_dist_checkpoint_index_that_would_run_code_is_refused_unread(tmp_path):
    part = dist_checkpoint(tmp_path / "megatron", [{"lr": 1.0}])
    marker = tmp_path / "ran"
    (part / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(RunError, match=r"\.metadata: refused, not loaded: it references io.open"):
        check_dist_checkpoint(part)
    assert not marker.exists()


def test_a_dist_checkpoint_object_that_would_run_code_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    part = dist_checkpoint(tmp_path / "megatron", [Planted(marker)])
    assert not marker.exists()
    with pytest.raises(
        RunError,
        match=r"object 'common_state' does not load with .*weights_only=True.*Unsupported global: GLOBAL io.open was not an allowed global by default\)",
    ):
        check_dist_checkpoint(part)
    assert not marker.exists()


def test_a_dist_checkpoint_item_outside_its_directory_or_a_legacy_common_pt_is_refused(tmp_path):
    part = dist_checkpoint(tmp_path / "megatron", [{"lr": 1.0}])
    from rlctl.engines.train.dcp_check import read_metadata

    metadata = read_metadata(part)
    for info in metadata.storage_data.values():
        info.relative_path = os.path.join("..", "elsewhere.distcp")
    (part / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(RunError, match=r"lies in '\.\./elsewhere\.distcp', not in a file of this directory"):
        check_dist_checkpoint(part)
    torch.save({"args": None}, part / "common.pt")
    with pytest.raises(RunError, match="common.pt: a legacy common-state pickle"):
        check_dist_checkpoint(part)


def test_export_takes_the_newest_of_the_checkpoints_and_the_final_policy(tmp_path):
    """A completed run's RUN/final/ is what `rlctl export RUN` takes when it is newer than every
    checkpoint; --step picks either; a run with neither says how to get one."""
    from rlctl.errors import UsageError
    from rlctl.run.checkpoint import FINAL, FINAL_FILE, find_checkpoint

    run = tmp_path / "run"
    with pytest.raises(UsageError, match="no checkpoint and no final policy; a run that completes writes"):
        find_checkpoint(run)
    a_checkpoint(run / "checkpoints" / "step-000002")
    (run / FINAL / "hf").mkdir(parents=True)
    (run / FINAL / FINAL_FILE).write_text('{"steps": 4, "version": 16}\n')
    newest = find_checkpoint(run)
    assert newest.is_final and newest.steps == 4 and newest.hf == run / FINAL / "hf"
    assert not find_checkpoint(run, 2).is_final and find_checkpoint(run, 4).is_final
    with pytest.raises(UsageError, match="has no checkpoint at step 3; it has 2, 4"):
        find_checkpoint(run, 3)
