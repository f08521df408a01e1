"""Every closed set of choices a recipe offers, as enums.

The schema types its fields with these, so OmegaConf refuses anything else when a recipe loads,
and the code compares against members (`mode is PipelineMode.ASYNC`), never string literals.
They are StrEnums: a member is its string, so it goes into JSON, command lines and f-strings as
written in the recipe. The sets that other layers implement (built-in tasks in rlctl/rewards/tasks.py,
GPU kinds in rlctl/sim/cost.py) are declared here so that the schema imports nothing above it;
tests/test_recipe.py checks those tables cover exactly these members.
"""

from __future__ import annotations

import enum


class PipelineMode(enum.StrEnum):
    SYNC = "sync"
    ROLLOUTPIPE = "rolloutpipe"
    ASYNC = "async"


class Admission(enum.StrEnum):
    FIFO = "fifo"
    FRONTIER = "frontier"


class InflightAtUpdate(enum.StrEnum):
    FINISH = "finish"
    ABORT_RESUME = "abort_resume"


class RolloutEngine(enum.StrEnum):
    BUILTIN = "builtin"
    SGLANG = "sglang"
    VLLM = "vllm"


class TrainEngine(enum.StrEnum):
    TORCH = "torch"
    MEGATRON = "megatron"


class Device(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class SyncBackend(enum.StrEnum):
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"
    IPC = "ipc"


class SGLangDtype(enum.StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class MegatronDtype(enum.StrEnum):
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class Launcher(enum.StrEnum):
    LOCAL = "local"
    SLURM = "slurm"
    POOL = "pool"
    """A shared pool's devices (`rlctl pool up`): the pool starts and schedules the run's engines."""


class DataSource(enum.StrEnum):
    TASK = "task"
    JSONL = "jsonl"


class TaskName(enum.StrEnum):
    """The built-in tasks (rlctl/rewards/tasks.py implements each)."""

    MAX_DIGIT = "max-digit"
    ADD = "add"


class Verifier(enum.StrEnum):
    EXACT = "exact"
    NUMERIC = "numeric"
    MATH = "math"
    FUNCTION = "function"


class GpuKind(enum.StrEnum):
    """The accelerators the simulation's cost model knows (rlctl/sim/cost.py has their specs)."""

    H200 = "h200"
    H100 = "h100"
    A100 = "a100"
    CPU = "cpu"


class WandbMode(enum.StrEnum):
    DISABLED = "disabled"
    OFFLINE = "offline"
    ONLINE = "online"
