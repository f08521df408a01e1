"""The Megatron engine's checkpoints: the model and distributed optimizer through
megatron.core.dist_checkpointing (every rank writes its shards; the optimizer's dp_reshardable
format: no gathers, same TP on load), plus the policy exported as an HF directory for serving
and `rlctl export`. Written against megatron-core 0.19.2; needs CUDA, so it is exercised on GPU
machines only (scripts/gpu_checks.py --only checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlctl.engines.train import ckpt_files, rng_state
from rlctl.engines.train.dcp_check import check_dist_checkpoint
from rlctl.engines.train.base import new_accumulator
from rlctl.errors import RunError


class MegatronCheckpoint:
    """save_checkpoint / load_checkpoint of MegatronTrainEngine (its model, optimizer, ddp,
    layout and parallel ranks)."""

    DIST_OPTIM = {"distrib_optim_sharding_type": "dp_reshardable"}

    def _sharded_state(self, is_loading: bool, model=None, optimizer=None) -> dict[str, Any]:
        """Megatron-LM's layout: {"model": ..., "optimizer": ...}; the optimizer's sharded state is
        matched to the model's ShardedTensors (which hold the parameters themselves). The policy's
        unless a model and its optimizer (PPO's critic) are given."""
        model, optimizer = model or self.model, optimizer or self.optimizer
        state: dict[str, Any] = {"model": model.sharded_state_dict()}
        if is_loading:  # a fresh distributed optimizer has no Adam state to load into yet (without
            # Apex/TE its state_dict() needs a step): Megatron's own dummy step makes it; the load
            # then replaces it, and the parameters, in place.
            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                if not opt.optimizer.state:
                    opt._init_optimizer_states_with_dummy_values()
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=self.DIST_OPTIM)
        return state

    def _parts(self, root: Path) -> list[tuple[Any, Any, Path]]:
        """(model, optimizer, directory) of each dist_checkpointing part: the policy, and PPO's critic."""
        trainer = root / ckpt_files.TRAINER_DIR
        parts = [(self.model, self.optimizer, trainer / "megatron")]
        if self.critic is not None:
            parts.append((self.critic.model, self.critic.optimizer, trainer / "megatron-critic"))
        return parts

    def save_checkpoint(self, path: str) -> dict[str, float]:
        from megatron.core import dist_checkpointing, tensor_parallel

        root = Path(path)
        self._write_policy(root)
        if self.rank == 0:
            for _, _, part in self._parts(root):
                part.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        for model, optimizer, part in self._parts(root):
            dist_checkpointing.save(self._sharded_state(False, model, optimizer), str(part))
        rng_state.save_rng(root, self.rank, megatron_cuda=tensor_parallel.get_cuda_rng_tracker().get_states())
        if self.rank == 0:
            ckpt_files.write_engine_info(root, engine="megatron", version=self.version, ranks=self.world_size,
                                         tp=self.tp_size, dp=self.dp_size)
        dist.barrier()
        return {"version": float(self.version)}

    def save_policy(self, path: str) -> dict[str, float]:
        self._write_policy(Path(path))
        dist.barrier()
        return {"version": float(self.version)}

    def _write_policy(self, root: Path) -> None:
        """hf/: rank 0's TP group rebuilds the full tensors, rank 0 writes them with the model's
        other files (config, tokenizer)."""
        if self.dp_rank == 0:
            weights = list(self.hf_weights())
            if self.rank == 0:
                ckpt_files.write_safetensors(weights, root / ckpt_files.HF_DIR)
                ckpt_files.copy_model_files(self.model_path, root / ckpt_files.HF_DIR, with_config=True)
            del weights

    def load_checkpoint(self, path: str) -> dict[str, float]:
        from megatron.core import dist_checkpointing, tensor_parallel

        root = Path(path)
        info = ckpt_files.read_engine_info(root)
        if info.get("engine") != "megatron" or info.get("tp") != self.tp_size:
            raise RunError(f"{root}: written by the {info.get('engine')} engine with TP {info.get('tp')}; "
                           f"this trainer is megatron with TP {self.tp_size}")
        parts = self._parts(root)
        for _, _, part in parts:  # every file read and checked before anything is set
            if part.name == "megatron-critic" and not part.is_dir():
                raise RunError(f"{root}: no critic in this checkpoint (trainer/{part.name}); it was not written by a PPO run")
            check_dist_checkpoint(part)  # its pickles, before dist_checkpointing unpickles them unrestricted
        rng = rng_state.read_rng(root, self.rank)
        for model, optimizer, part in parts:
            with torch.no_grad():  # the optimizer's fp32 shards are views of parameters that need grad
                loaded = dist_checkpointing.load(self._sharded_state(True, model, optimizer), str(part))
                model.load_state_dict(loaded["model"])
                optimizer.load_state_dict(loaded["optimizer"])
                _own_step_counters(optimizer)
        tensor_parallel.get_cuda_rng_tracker().set_states(rng.apply()["megatron_cuda"])
        self.version = int(info["version"])
        self._acc = new_accumulator()
        self.ddp.zero_grad_buffer()
        if self.critic is not None:
            self.critic.ddp.zero_grad_buffer()
        self.mark_behaviour(self.version)
        return {"version": float(self.version)}


def _own_step_counters(optimizer) -> None:
    """Give every parameter's Adam state its own `step` tensor. Without Apex or Transformer Engine,
    megatron-core's DistributedOptimizer.load_state_dict (0.19.2) puts ONE step tensor into every
    parameter's state; torch's Adam then adds 1 to it once per parameter in each step, so the
    bias correction of a resumed run is off (19 parameters: step 1 counted as 20, updates about a
    third smaller; scripts/gpu_checks.py --only checkpoint measures the next step against a run
    that never stopped)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
