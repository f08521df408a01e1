"""Every closed set of choices a recipe offers, as enums.

The schema types its fields with these, so OmegaConf refuses anything else when a recipe loads,
and the code compares against members (`mode is PipelineMode.ASYNC`), never string literals.
They are StrEnums: a member is its string, so it goes into JSON, command lines and f-strings as
written in the recipe. The sets that other layers implement (built-in tasks in rlctl/rewards/tasks.py,
GPU kinds in rlctl/costs/model.py) are declared here so that the schema imports nothing above it;
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
    LONGEST = "longest"


class InflightAtUpdate(enum.StrEnum):
    FINISH = "finish"
    ABORT_RESUME = "abort_resume"


class RolloutEngine(enum.StrEnum):
    BUILTIN = "builtin"
    SGLANG = "sglang"
    VLLM = "vllm"


class ServerProtocol(enum.StrEnum):
    """The HTTP protocol a run's rollout servers speak: SGLang's (SGLang servers, and the built-in
    server by default) or vLLM's (vLLM servers, or built-in ones emulating vLLM). It decides the
    client and the weight sender; the engine decides everything else
    (rlctl/engines/rollout/registry.py)."""

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


class MegatronAttention(enum.StrEnum):
    """The Megatron trainer's core attention (rlctl/engines/train/megatron_attention.py)."""

    SDPA = "sdpa"
    LOCAL = "local"


class Recompute(enum.StrEnum):
    """Megatron-core's recompute_granularity ("none" is its None)."""

    FULL = "full"
    SELECTIVE = "selective"
    NONE = "none"


class RecomputeMethod(enum.StrEnum):
    """Megatron-core's recompute_method."""

    UNIFORM = "uniform"
    BLOCK = "block"


class Launcher(enum.StrEnum):
    LOCAL = "local"
    SLURM = "slurm"
    POOL = "pool"
    """A shared pool's devices (`rlctl pool up`): the pool starts and schedules the run's engines."""


class DataSource(enum.StrEnum):
    """Where prompts come from: a built-in task, or a file of rows (rlctl/data/rows.py reads
    JSONL, Parquet and save_to_disk datasets; `jsonl` is the older name of `file`)."""

    TASK = "task"
    FILE = "file"
    JSONL = "jsonl"


class TaskName(enum.StrEnum):
    """The built-in tasks (rlctl/rewards/tasks.py implements each)."""

    MAX_DIGIT = "max-digit"
    ADD = "add"
    CALC = "calc"
    """Multi-turn: the model calls the calculator (rollout.multi_turn)."""


TASK_ENVIRONMENTS = {TaskName.CALC: "calculator"}
"""The built-in multi-turn tasks and the rollout.multi_turn.environment each is answered with."""


class Verifier(enum.StrEnum):
    EXACT = "exact"
    NUMERIC = "numeric"
    MATH = "math"
    FUNCTION = "function"


class RewardOnError(enum.StrEnum):
    """What a verifier that raises or runs past reward.timeout_s does to the run."""

    FAIL = "fail"
    ZERO = "zero"


class GpuKind(enum.StrEnum):
    """The accelerators the simulation's cost model knows (rlctl/costs/model.py has their specs)."""

    H200 = "h200"
    H100 = "h100"
    A100 = "a100"
    CPU = "cpu"


class WandbMode(enum.StrEnum):
    DISABLED = "disabled"
    OFFLINE = "offline"
    ONLINE = "online"


class AlgoName(enum.StrEnum):
    GRPO = "grpo"
    """Group-relative advantages: each sample's reward against its group's (no critic)."""
    PPO = "ppo"
    """A learned critic and GAE: per-token advantages from the value model's estimates."""


class LossAgg(enum.StrEnum):
    """How per-token losses become the batch's loss (rlctl/algos/losses.py: token_weights)."""

    TOKEN_MEAN = "token-mean"
    """Sum over every response token of the train batch / the batch's response tokens (DAPO)."""
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    """Each sample's token mean, averaged over the batch's samples (the original GRPO)."""
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    """Each sample's token sum, averaged over the batch's samples (Dr. GRPO without its constant)."""


class KlEstimator(enum.StrEnum):
    """Per-token estimators of KL(pi || ref), with d = log ref - log pi (rlctl/algos/losses.py)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    LOW_VAR = "low-var"
    """k3 with d clamped to [-20, 20] and the result to [-10, 10]."""


class KlIn(enum.StrEnum):
    LOSS = "loss"
    """A penalty term added to the policy loss, aggregated like it."""
    REWARD = "reward"
    """Subtracted from the reward before advantages: per token for PPO, summed per sample for GRPO."""


class Overlong(enum.StrEnum):
    """DAPO's treatment of samples that reach rollout.sampling.max_new_tokens."""

    KEEP = "keep"
    PENALTY = "penalty"
    """A soft penalty growing linearly over the last algo.overlong_buffer tokens before the cap."""
    FILTER = "filter"
    """Truncated samples are left out of the loss (their group's advantages still count them)."""
