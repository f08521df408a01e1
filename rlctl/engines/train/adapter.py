"""What rlctl asks of a train engine, in one interface: TrainerAdapter, one per `train.engine`.

The worker builds a trainer rank through it, `rlctl launch` checks through it that the engine is
installed, the Slurm script and the pool ask it whether a rank needs a GPU, and the planner asks it
what a parameter costs and which tensor-parallel sizes exist. Nothing here imports torch,
transformers or Megatron until a rank is built; the engines themselves are torch_engine.py and
megatron_engine.py.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, ClassVar

from rlctl.errors import RunError
from rlctl.recipe import Device, MegatronConfig, MegatronDtype, PipelineMode, Recipe, TrainConfig, TrainEngine

if TYPE_CHECKING:
    from rlctl.engines.train.base import TrainEngine as Engine


def behaviour_versions(recipe: Recipe) -> int:
    """Weight versions a trained sample can come from: the last synced one, or in async up to
    pipeline.max_staleness + 1 of them (rlctl/engines/train/behaviour.py keeps a copy of each)."""
    return recipe.pipeline.max_staleness + 1 if recipe.pipeline.mode is PipelineMode.ASYNC else 1


class TrainerAdapter:
    engine: ClassVar[TrainEngine]
    module: ClassVar[str | None] = None
    """The package it trains with, where it is not an install of rlctl's own."""
    install: ClassVar[str] = ""
    cuda_only: ClassVar[bool] = False
    """Its ranks run on GPUs whatever train.device says (a pool of CPUs cannot take it)."""

    def device(self, train: TrainConfig) -> Device:
        """Where its ranks run."""
        return Device.CUDA if self.cuda_only else train.device

    def tp_key(self) -> str | None:
        """The recipe key of its tensor-parallel size, None where it has none."""
        return None

    def param_bytes(self, train: TrainConfig) -> tuple[float, float, float, float]:
        """(parameter, gradient, optimizer-not-sharded, optimizer-sharded-over-dp) bytes per parameter."""
        raise NotImplementedError

    def layer_config(self, train: TrainConfig) -> MegatronConfig | None:
        """Its layers' attention and recompute settings, which the planner prices
        (rlctl/costs/activations.py, measured on this engine) and `rlctl launch` checks a
        micro-batch against; None: autograd keeps every layer's activations, attention fused."""
        return None

    def step_bytes(self, train: TrainConfig) -> float:
        """Bytes per parameter a rank steps that the optimizer step holds on top of its state."""
        return 0.0

    def pool_bytes(self, recipe: Recipe, params: float) -> tuple[float, float]:
        """(resident, working) bytes of one rank in a shared pool: what it keeps on its device
        while another run's turn, and what it releases then (rlctl/engines/memory.py)."""
        raise NotImplementedError

    def check_installed(self) -> None:
        if self.module and importlib.util.find_spec(self.module.split(".")[0]) is None:
            raise RunError(f"train.engine={self.engine} needs {self.module}, which is not installed here: {self.install}")

    def forms_group(self, world: int) -> bool:
        """Does a rank join a torch.distributed group (the weight broadcast's source and data
        parallelism need one from two ranks)?"""
        return world > 1

    def backend(self, train: TrainConfig) -> str:
        return "nccl" if self.device(train) is Device.CUDA else "gloo"

    def before_group(self, device: str) -> None:
        """What a rank does before its process group forms."""

    def build(self, model_path: str, recipe: Recipe, rank: int, world: int, device: str, init_method: str) -> Engine:
        raise NotImplementedError


class TorchAdapter(TrainerAdapter):
    """A transformers model trained by torch (fp32 weights, gradients and AdamW moments)."""

    engine = TrainEngine.TORCH

    def param_bytes(self, train: TrainConfig) -> tuple[float, float, float, float]:
        return 4.0, 4.0, 8.0, 0.0

    def pool_bytes(self, recipe: Recipe, params: float) -> tuple[float, float]:
        """fp32 weights (and an fp32 reference model with KL) kept; fp32 gradients and two Adam
        moments released; all split over its ranks."""
        ranks = recipe.train.ranks
        return 4 * params * (2 if recipe.algo.kl_coef > 0 else 1) / ranks, 12 * params / ranks

    def build(self, model_path: str, recipe: Recipe, rank: int, world: int, device: str, init_method: str) -> Engine:
        from rlctl.engines.train.torch_engine import TorchTrainEngine

        return TorchTrainEngine(model_path, recipe.train, recipe.rollout.sampling.temperature, rank, world,
                                device=device, algo=recipe.algo, behaviour_versions=behaviour_versions(recipe))


class MegatronAdapter(TrainerAdapter):
    """A Megatron-core GPTModel on CUDA (TP x DP groups, the distributed optimizer)."""

    engine = TrainEngine.MEGATRON
    module = "megatron.core"
    install = "pip install 'rlctl[megatron]'"
    cuda_only = True


    def tp_key(self) -> str | None:
        return "train.megatron.tp"

    def param_bytes(self, train: TrainConfig) -> tuple[float, float, float, float]:
        """bf16 parameters with fp32 gradients and a distributed fp32 main copy and Adam moments,
        or all fp32."""
        if train.megatron.dtype is MegatronDtype.BFLOAT16:
            return 2.0, 4.0, 0.0, 12.0
        return 4.0, 4.0, 0.0, 8.0

    def pool_bytes(self, recipe: Recipe, params: float) -> tuple[float, float]:
        """A rank keeps its TP shard of the parameters and of their fp32 gradients, and releases its
        share of the distributed optimizer (rlctl/engines/train/megatron_memory.py counts its tags)."""
        weight, grad, _, sharded = self.param_bytes(recipe.train)
        return (weight + grad) * params / recipe.train.megatron.tp, sharded * params / recipe.train.ranks

    def step_bytes(self, train: TrainConfig) -> float:
        """torch's AdamW (Megatron-core's optimizer without Transformer Engine or Apex) updates with
        multi-tensor ops that hold the second moments' square roots: one fp32 value a parameter."""
        return 4.0

    def layer_config(self, train: TrainConfig) -> MegatronConfig | None:
        return train.megatron

    def forms_group(self, world: int) -> bool:
        return True  # Megatron needs its NCCL group even for one rank

    def backend(self, train: TrainConfig) -> str:
        return "nccl"

    def before_group(self, device: str) -> None:
        import torch

        torch.cuda.set_device(torch.device(device))  # the GPU before the NCCL group, as the engine would do it

    def build(self, model_path: str, recipe: Recipe, rank: int, world: int, device: str, init_method: str) -> Engine:
        from rlctl.engines.train.megatron_engine import MegatronTrainEngine

        # The default group exists: the engine makes Megatron's TP x DP groups on it.
        return MegatronTrainEngine(model_path, recipe.train, recipe.rollout.sampling.temperature, rank, world,
                                   device=device, init_method=init_method, algo=recipe.algo,
                                   behaviour_versions=behaviour_versions(recipe))


TRAINERS: dict[TrainEngine, TrainerAdapter] = {TrainEngine.TORCH: TorchAdapter(), TrainEngine.MEGATRON: MegatronAdapter()}


def trainer_adapter(engine: TrainEngine) -> TrainerAdapter:
    return TRAINERS[TrainEngine(engine)]
