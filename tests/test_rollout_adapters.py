"""The rollout engines' adapters (rlctl/engines/rollout/adapter.py, registry.py): one per engine,
each the only place that knows its engine, answering for the recipe as the code before them did."""

from __future__ import annotations

import asyncio
import os

import pytest

from conftest import QUICKSTART
from rlctl.control.controller import sync_backend, sync_target
from rlctl.engines.rollout.builtin.adapter import BuiltinAdapter
from rlctl.engines.rollout.client import RolloutClient
from rlctl.engines.rollout.registry import ADAPTERS, SPEAKERS, rollout_adapter, rollout_client, speaker
from rlctl.engines.rollout.sglang.adapter import SGLangAdapter
from rlctl.engines.rollout.vllm.adapter import VllmAdapter
from rlctl.engines.rollout.vllm.client import VllmClient
from rlctl.errors import RunError
from rlctl.launchers.slurm.placement import server_gpus
from rlctl.planner.launch import NotLaunchable, launch_overrides
from rlctl.planner.placement import Placement
from rlctl.costs.shape import serving_bytes
from rlctl.recipe import RolloutEngine, ServerProtocol, SyncBackend, load_recipe

GPU = ["rollout.device=cuda", "train.device=cuda"]


def recipe(*overrides: str):
    return load_recipe(QUICKSTART, list(overrides), check_paths=False)


def test_every_engine_and_protocol_has_its_adapter():
    assert set(ADAPTERS) == set(RolloutEngine) and set(SPEAKERS) == set(ServerProtocol)
    for engine, adapter in ADAPTERS.items():
        assert adapter.engine is engine and rollout_adapter(str(engine)) is adapter
    assert isinstance(speaker("sglang"), SGLangAdapter) and isinstance(speaker(ServerProtocol.VLLM), VllmAdapter)
    with pytest.raises(ValueError, match="unknown rollout protocol 'grpc'"):
        speaker("grpc")


def test_the_protocol_decides_the_client():
    """The built-in server emulating vLLM gets vLLM's client; the client is the protocol's."""
    assert recipe("rollout.builtin.emulate_vllm=0.33.0").rollout.protocol is ServerProtocol.VLLM
    assert recipe().rollout.protocol is ServerProtocol.SGLANG

    async def clients():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            return (type(rollout_client("vllm", "http://h:1", session, None)),
                    type(rollout_client(ServerProtocol.SGLANG, "http://h:1", session, None)))
    assert asyncio.run(clients()) == (VllmClient, RolloutClient)


def test_what_the_trainer_is_told_and_how_weights_go():
    assert sync_target(recipe()) == {"protocol": "sglang"}
    assert sync_target(recipe(*GPU, "rollout.engine=sglang", "model.init=null", "model.path=~/m")) == {"protocol": "sglang"}
    real = sync_target(recipe(*GPU, "rollout.engine=vllm", "model.init=null", "model.path=~/m"))
    assert real == {"protocol": "vllm", "server": {"dtype": "bfloat16", "model_path": os.path.expanduser("~/m")}}
    assert sync_backend(recipe(*GPU, "rollout.engine=vllm", "model.init=null", "model.path=~/m")) is SyncBackend.NCCL
    assert sync_backend(recipe(*GPU, "rollout.engine=sglang", "model.init=null", "model.path=~/m")) is SyncBackend.GLOO
    assert sync_backend(recipe(*GPU, "rollout.engine=sglang", "model.init=null", "model.path=~/m",
                               "train.gpus=[0]", "rollout.gpus=[0]")) is SyncBackend.GLOO  # IPC: the built-in server only
    assert sync_backend(recipe(*GPU, "train.gpus=[0]", "rollout.gpus=[0]")) is SyncBackend.IPC


def test_gpus_bytes_and_memory_of_each_engine():
    sg = recipe(*GPU, "rollout.engine=sglang", "rollout.sglang.tp_size=2", "rollout.sglang.dtype=float32",
                "model.init=null", "model.path=~/m")
    vl = recipe(*GPU, "rollout.engine=vllm", "rollout.vllm.tp_size=4", "model.init=null", "model.path=~/m")
    assert (server_gpus(sg), server_gpus(vl), server_gpus(recipe()), server_gpus(recipe(*GPU))) == (2, 4, 0, 1)
    assert (serving_bytes(sg), serving_bytes(vl), serving_bytes(recipe())) == (4.0, 2.0, 4.0)
    assert rollout_adapter(sg.rollout.engine).memory_fraction(sg.rollout) == sg.rollout.sglang.mem_fraction_static
    assert rollout_adapter(vl.rollout.engine).memory_fraction(vl.rollout) == vl.rollout.vllm.gpu_memory_utilization
    assert BuiltinAdapter().memory_fraction(recipe().rollout) is None and BuiltinAdapter.expands_kv


def test_a_placement_of_servers_with_tp_names_the_engines_key():
    p = Placement(mode="sync", rollout_gpus=8, trainer_gpus=8, rollout_tp=2, train_tp=1, micro_batch_tokens=4096)
    sg = recipe(*GPU, "rollout.engine=sglang", "model.init=null", "model.path=~/m")
    assert "rollout.sglang.tp_size=2" in launch_overrides(sg, p, 64, 8)
    with pytest.raises(NotLaunchable, match="the built-in server runs on one GPU"):
        launch_overrides(recipe(*GPU), p, 64, 8)


def test_an_engine_that_is_not_installed_is_named_with_its_install_command():
    with pytest.raises(RunError, match=r"rollout.engine=sglang needs sglang, which is not installed here: "
                                       r"pip install 'sglang\[all\]>=0\.5\.15,<=0\.5\.23'"):
        SGLangAdapter().check_installed()
    BuiltinAdapter().check_installed()  # rlctl's own
