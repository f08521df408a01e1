"""The trainer service's checkpoint routes over real HTTP, with the run's token (a real trainer
process): /save_checkpoint and /load_checkpoint take only the run's own checkpoints/ (403 naming
the path and the rule, which the controller's client raises as a RunError), and a checkpoint
that was tampered with, or that holds a pickle where the RNG state goes, is refused without
running anything, leaving the trainer as it was."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil

import aiohttp
import pytest
import torch

from conftest import free_port, wait_http
from rlctl.run.checkpoint import save_checkpoint, save_final_policy
from rlctl.run.manifest import check_manifest
from rlctl.run.manifest import write_manifest
from rlctl.engines.train.client import TrainerClient
from rlctl.errors import RunError
from test_checkpoint_safety import Planted, flip_byte

pytestmark = pytest.mark.process

TOKEN = "the-runs-token"


def _trainer(port: int, model_dir: str, run_dir: str) -> None:
    from aiohttp import web

    from rlctl.engines.train.service import TrainerService
    from rlctl.engines.train.torch_engine import TorchTrainEngine
    from rlctl.recipe import TrainConfig

    torch.set_num_threads(1)
    engine = TorchTrainEngine(model_dir, TrainConfig(lr=1e-2), temperature=1.0, rank=0, world_size=1)
    service = TrainerService(engine, 1, token=TOKEN, run_dir=run_dir)
    web.run_app(service.app(), host="127.0.0.1", port=port, print=None, access_log=None)


@pytest.fixture
def trainer(tiny_model_dir, tmp_path):
    """(URL, run directory) of a one-rank trainer service whose run directory is tmp_path/run."""
    import multiprocessing as mp

    run, port = tmp_path / "run", free_port()
    run.mkdir()
    proc = mp.get_context("spawn").Process(target=_trainer, args=(port, str(tiny_model_dir), str(run)), daemon=True)
    proc.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        yield url, run
    finally:
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def samples() -> list[dict]:
    from test_trainer import make_samples

    return [dataclasses.asdict(s) for s in make_samples(6)]


def refused(status: int, *words: str):
    return pytest.raises(RunError, match=rf"HTTP {status}:.*{'.*'.join(words)}")


@pytest.mark.timeout(300)
def test_the_checkpoint_routes_take_only_the_runs_own_checkpoints(trainer, tmp_path):
    url, run = trainer
    outside = tmp_path / "outside"
    outside.mkdir()
    ckpts = run / "checkpoints"

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = TrainerClient(url, s, TOKEN)
            await c.train(samples())
            saved = await save_checkpoint(run, 1, c, {"t": 0.0}, keep=0)  # the controller's way: tmp dir, then rename
            assert saved["path"] == str(ckpts / "step-000001") and (ckpts / "step-000001" / "manifest.json").is_file()
            rule = "checkpoints only in"
            with refused(403, str(outside), "refused", rule, r"\.tmp-step-NNNNNN-PID"):
                await c.save_checkpoint(str(outside))
            with refused(403, "refused", rule):
                await c.save_checkpoint(str(ckpts / ".tmp-step-000002-1" / ".." / ".." / ".." / "outside"))
            (ckpts / ".tmp-step-000002-1").symlink_to(outside)
            with refused(403, f"that is {outside}", rule):
                await c.save_checkpoint(str(ckpts / ".tmp-step-000002-1"))
            assert list(outside.iterdir()) == []  # nothing was written there
            shutil.copytree(ckpts / "step-000001", outside / "step-000001")
            with refused(403, str(outside / "step-000001"), "reads", rule, "step-NNNNNN"):
                await c.load_checkpoint(str(outside / "step-000001"))
            with refused(403, "reads", rule):
                await c.load_checkpoint(str(ckpts / ".tmp-step-000002-1"))
            assert (await c.load_checkpoint(str(ckpts / "step-000001")))["version"] == 1.0
            with refused(403, str(outside), "refused", rule, r"\.tmp-final-PID"):  # the final policy's route too
                await c.save_policy(str(outside))
            final = await save_final_policy(run, 1, 1, c)
            assert final["path"] == str(run / "final") and (run / "final" / "hf" / "model.safetensors").is_file()
            assert not (run / "final" / "trainer").exists()  # the policy alone: no optimizer state
            check_manifest(run / "final")

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_a_crafted_checkpoint_is_refused_without_running_code_and_the_trainer_stays_as_it_was(trainer, tmp_path):
    url, run = trainer
    ckpts = run / "checkpoints"
    marker = tmp_path / "ran"

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = TrainerClient(url, s, TOKEN)
            await c.train(samples())
            await save_checkpoint(run, 1, c, {"t": 0.0}, keep=0)
            await c.train(samples())
            before = await c.weight_checksums()
            assert before["version"] == 2

            # A pickle where the RNG state goes, with a manifest that lists it: the file is never unpickled.
            pickled = shutil.copytree(ckpts / "step-000001", ckpts / "step-000002")
            (pickled / "trainer" / "rng-rank-0.json").unlink()
            torch.save({"python": Planted(marker)}, pickled / "trainer" / "rng-rank-0.pt")
            write_manifest(pickled)
            with refused(400, "rng-rank-0.pt: an RNG state pickled by an earlier rlctl", "model.path="):
                await c.load_checkpoint(str(pickled))

            # A tampered safetensors file: refused by the manifest before anything is loaded.
            tampered = shutil.copytree(ckpts / "step-000001", ckpts / "step-000003")
            flip_byte(tampered / "hf" / "model.safetensors")
            with refused(400, "step-000003: hf/model.safetensors has other bytes", "is not loaded"):
                await c.load_checkpoint(str(tampered))

            assert not marker.exists()
            assert await c.weight_checksums() == before  # the refused loads changed nothing

    asyncio.run(scenario())
