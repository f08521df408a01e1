"""The controller's trainer (rlctl/control/controller.py compose_trainer): layers around the trainer's client
in one order, each a TrainerLayer that passes on every call it does not change."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest

from conftest import QUICKSTART
from rlctl.control.controller import CheckedTrainer, compose_trainer
from rlctl.control.failover import FailoverTrainer
from rlctl.pipelines.interfaces import RunTrainer, TrainerLayer
from rlctl.plex.gates import PooledTrainer
from rlctl.recipe import load_recipe


class Client:
    """Records the calls that reach the trainer's client."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append(name)
            return {"version": 1, "checksums": {}}
        return call


def protocol_methods() -> set[str]:
    return {n for cls in RunTrainer.__mro__ if cls.__module__ == RunTrainer.__module__
            for n, f in vars(cls).items() if inspect.iscoroutinefunction(f)}


def test_a_layer_passes_on_every_call_of_the_trainers_protocol():
    names = protocol_methods()
    assert {"accumulate", "train", "sync_weights", "save_checkpoint", "save_policy", "load_checkpoint",
            "weight_checksums"} <= names
    client = Client()
    layer = TrainerLayer(client)
    for name in sorted(names):
        args = {"sync_weights": (3,), "accumulate": ([],), "train": ([],)}.get(name, ("p",) if name.startswith(("save_", "load_")) else ())
        asyncio.run(getattr(layer, name)(*args))
    assert sorted(client.calls) == sorted(names)


class Lease:
    def slice(self, job, needs, kind):
        raise AssertionError("not called here")


@pytest.mark.parametrize("check,pooled", [(False, False), (True, False), (False, True), (True, True)])
def test_the_layers_come_in_one_order(check, pooled):
    recipe = load_recipe(QUICKSTART, [f"pipeline.check_weights={str(check).lower()}"])
    watch = SimpleNamespace(clients=[SimpleNamespace(name="rollout-0"), SimpleNamespace(name="rollout-1")],
                            lose_silent=None)
    lease = SimpleNamespace(job="run-a", slice=Lease().slice) if pooled else None
    client = Client()
    trainer = compose_trainer(recipe, None, None, client, watch, lambda *a, **k: None, SimpleNamespace(now=float),
                              lease)
    layers = []
    while isinstance(trainer, TrainerLayer):
        layers.append(type(trainer))
        trainer = trainer.inner
    assert trainer is client
    assert layers == [*([PooledTrainer] if pooled else []), *([CheckedTrainer] if check else []), FailoverTrainer]
