"""The recipe: a strict, typed schema for one RL run, loaded from YAML plus `key=value` overrides.

One dataclass per section, each checking its own fields next to where they are declared:

    choices.py   every closed set of choices, as enums
    checks.py    FieldError and the Section base: how a section says a value is impossible
    inputs.py    run, model, data, reward
    eval.py      eval: held-out sets, when they are evaluated
    rollout.py   rollout (sampling, long tail, sglang, vllm)
    train.py     train (megatron), pipeline
    algo.py      algo: the RL objective and its knobs
    cluster.py   slurm, sim, tracking
    colocate.py  colocate: servers and trainer taking turns on the same devices
    schema.py    Recipe: the sections, and the checks that span several
    load.py      YAML + overrides -> checked Recipe; Recipe -> YAML
    bounded_yaml.py  YAML parsed within bounds (size, depth, aliases expanded, no key given twice)
    sbatch_flags.py  which sbatch flags a slurm.sbatch_args item sets, read as sbatch reads it
    secret_names.py  which environment variable names hold secrets (slurm.env refuses them)

A new section is one dataclass with its `check()`, added as a field of Recipe. The schema
imports nothing from the rest of rlctl but rlctl.errors.
"""

from rlctl.recipe.algo import AlgoConfig
from rlctl.recipe.checks import FieldError, Section
from rlctl.recipe.choices import (
    Admission,
    AlgoName,
    DataSource,
    Device,
    GpuKind,
    InflightAtUpdate,
    KlEstimator,
    KlIn,
    Launcher,
    LossAgg,
    MegatronAttention,
    MegatronDtype,
    Overlong,
    PipelineMode,
    Recompute,
    RecomputeMethod,
    RolloutEngine,
    ServerProtocol,
    SGLangDtype,
    SyncBackend,
    TaskName,
    TrainEngine,
    Verifier,
    WandbMode,
)
from rlctl.recipe.colocate import ColocateConfig
from rlctl.recipe.cluster import SimConfig, SlurmConfig, SlurmRolloutConfig, SlurmTrainerConfig, TrackingConfig, WandbConfig
from rlctl.recipe.data import DataConfig, MixedSource
from rlctl.recipe.eval import EvalConfig, EvalSet
from rlctl.recipe.inputs import ModelConfig, ModelInit, RewardConfig, RunConfig
from rlctl.recipe.multi_turn import MultiTurnConfig
from rlctl.recipe.load import check_recipe, load_recipe, recipe_from_yaml, recipe_to_dict, recipe_to_yaml
from rlctl.recipe.rollout import (
    SGLANG_MANAGED_FLAGS,
    SGLANG_NEWEST,
    SGLANG_OLDEST,
    VLLM_MANAGED_FLAGS,
    VLLM_NEWEST,
    VLLM_OLDEST,
    BuiltinConfig,
    LongTailConfig,
    RolloutConfig,
    SamplingConfig,
    SGLangConfig,
    VllmConfig,
    sglang_release,
    vllm_release,
)
from rlctl.recipe.schema import Recipe, slurm_rollout_nodes
from rlctl.recipe.train import MegatronConfig, PipelineConfig, TrainConfig

__all__ = [
    "SGLANG_MANAGED_FLAGS", "SGLANG_NEWEST", "SGLANG_OLDEST", "VLLM_MANAGED_FLAGS", "VLLM_NEWEST", "VLLM_OLDEST",
    "Admission", "AlgoConfig", "AlgoName", "BuiltinConfig", "ColocateConfig", "DataConfig", "DataSource", "EvalConfig", "EvalSet", "Device", "FieldError", "GpuKind",
    "InflightAtUpdate", "KlEstimator", "KlIn", "Launcher", "LossAgg", "LongTailConfig", "MegatronAttention", "MixedSource", "MegatronConfig", "MegatronDtype", "ModelConfig", "MultiTurnConfig", "ModelInit", "Overlong",
    "PipelineConfig", "PipelineMode", "Recipe", "Recompute", "RecomputeMethod", "RewardConfig", "RolloutConfig", "RolloutEngine", "ServerProtocol", "RunConfig",
    "SGLangConfig", "SGLangDtype", "SamplingConfig", "Section", "SimConfig", "SlurmConfig", "SlurmRolloutConfig",
    "SlurmTrainerConfig", "SyncBackend", "TaskName", "TrackingConfig", "TrainConfig", "TrainEngine", "Verifier",
    "WandbConfig", "WandbMode", "check_recipe", "load_recipe", "recipe_from_yaml", "recipe_to_dict", "recipe_to_yaml",
    "VllmConfig", "sglang_release", "slurm_rollout_nodes", "vllm_release",
]
