"""The recipe: a strict, typed schema for one RL run, loaded from YAML plus `key=value` overrides.

Every field is typed and defaulted where a default is sane. Loading goes YAML (safe loader) ->
OmegaConf merge onto the structured schema (unknown keys and wrong types fail here) ->
dataclass instance -> `validate()` (values that are well-typed but impossible). Every failure
raises `RecipeError(file, key, message)`, which the CLI prints as one line and exits 2.
"""

from __future__ import annotations

import enum
import re
import importlib.util
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from rlctl.errors import RecipeError


class PipelineMode(enum.StrEnum):
    SYNC = "sync"
    ROLLOUTPIPE = "rolloutpipe"
    ASYNC = "async"


class RolloutEngine(enum.StrEnum):
    BUILTIN = "builtin"
    SGLANG = "sglang"


class TrainEngine(enum.StrEnum):
    TORCH = "torch"
    MEGATRON = "megatron"


class Admission(enum.StrEnum):
    FIFO = "fifo"
    FRONTIER = "frontier"


class InflightAtUpdate(enum.StrEnum):
    FINISH = "finish"
    ABORT_RESUME = "abort_resume"


class Launcher(enum.StrEnum):
    LOCAL = "local"
    SLURM = "slurm"


class Verifier(enum.StrEnum):
    EXACT = "exact"
    NUMERIC = "numeric"
    MATH = "math"
    FUNCTION = "function"


class DataSource(enum.StrEnum):
    TASK = "task"
    JSONL = "jsonl"


# Flags the sglang engine sets itself (rlctl/engines/rollout/sglang.py).
SGLANG_MANAGED_FLAGS = ("--model-path", "--host", "--port", "--tp-size", "--tp", "--random-seed", "--api-key",
                        "--mem-fraction-static", "--dtype", "--skip-tokenizer-init", "--dp-size", "--dp")

# What this version of rlctl can run. The schema already has room for the rest.
AVAILABLE = {
    "pipeline.mode": {PipelineMode.SYNC, PipelineMode.ROLLOUTPIPE, PipelineMode.ASYNC},
    "rollout.engine": {RolloutEngine.BUILTIN, RolloutEngine.SGLANG},
    "train.engine": {TrainEngine.TORCH, TrainEngine.MEGATRON},
    "launcher": {Launcher.LOCAL, Launcher.SLURM},
}


@dataclass(kw_only=True)
class RunConfig:
    name: str = "run"
    """Human name of the run; the run id is `<name>-<date>-<time>-<suffix>`."""
    seed: int = 0
    """Seeds data order, sampling on the rollout servers and model init."""
    steps: int = 20
    """Number of rollout batches (each followed by its optimizer steps and a weight sync)."""
    output_dir: str = "runs"
    """Where run directories are created (relative to the current directory)."""
    threads_per_process: int = 1
    """torch threads per worker process; keep low when several processes share a few cores."""


@dataclass(kw_only=True)
class ModelInit:
    """A tiny Qwen3-architecture model that rlctl builds itself, with a character tokenizer.

    It is given a short supervised warm-up on the run's task with noisy answers, so that it knows
    the answer format and is right only some of the time: the starting point RL then improves.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_position_embeddings: int = 64
    seed: int = 0
    """Seeds the weights and the warm-up data; the model is cached by its init block."""
    warmup_steps: int = 25
    """Supervised steps on the task before RL (0 = random init): few enough to leave it half-trained."""
    warmup_correct_prob: float = 1.0
    """Fraction of warm-up answers that are correct; the rest are random answers of the right form."""
    warmup_lr: float = 3e-3
    warmup_batch_size: int = 64


@dataclass(kw_only=True)
class ModelConfig:
    path: str | None = None
    """A local Hugging Face causal-LM directory (config.json, safetensors, tokenizer)."""
    init: ModelInit | None = None
    """Build a tiny model instead of loading one (exactly one of path / init)."""


@dataclass(kw_only=True)
class DataConfig:
    source: str = "task"
    """`task` (a built-in verifiable task generator) or `jsonl` (a file of prompt/answer rows)."""
    task: str = "max-digit"
    """Built-in task name, see `rlctl.rewards.tasks.TASKS`."""
    path: str | None = None
    """JSONL file for source=jsonl."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"


@dataclass(kw_only=True)
class RewardConfig:
    verifier: str = "exact"
    """exact | numeric | math (math-verify) | function (user code, see `function`)."""
    function: str | None = None
    """`package.module:callable` taking (response, answer) and returning a float in [0, 1]."""


@dataclass(kw_only=True)
class LongTailConfig:
    """Per-request response lengths drawn from a long-tailed distribution (a benchmark workload).

    Each request gets its own max_new_tokens, and ignore_eos so that it generates exactly that
    many tokens; SGLang supports both per request, so the same workload runs on real SGLang.
    The defaults are shaped like RLVR math: median about 1/10 of the p99, and about 5% of the
    samples producing a third of the tokens (rlctl.workloads.LengthDistribution says how). The
    cap is rollout.sampling.max_new_tokens.
    """

    enabled: bool = False
    median_fraction: float = 0.095
    """Median of the lognormal body as a fraction of max_new_tokens."""
    sigma: float = 0.5
    """Log-standard-deviation of the body."""
    truncated_fraction: float = 0.05
    """Share of requests that run to max_new_tokens (the runs that hit the length cap)."""
    min_tokens: int = 1


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 8
    stop_token_ids: list[int] = field(default_factory=list)
    long_tail: LongTailConfig = field(default_factory=LongTailConfig)


@dataclass(kw_only=True)
class SGLangConfig:
    """rollout.engine=sglang: how each server is started (python -m sglang.launch_server)."""

    tp_size: int = 1
    """GPUs per server (tensor parallel); data parallel = rollout.servers."""
    mem_fraction_static: float = 0.85
    dtype: str = "bfloat16"
    api_key: str = ""
    """Sent as a Bearer token on every request when set (--api-key)."""
    skip_tokenizer_init: bool = True
    """rlctl sends token ids and reads output_ids, so the server needs no tokenizer."""
    extra_args: list[str] = field(default_factory=list)
    """Passed through to sglang.launch_server, e.g. ["--attention-backend", "fa3"]."""


@dataclass(kw_only=True)
class RolloutConfig:
    engine: str = "builtin"
    """builtin (rlctl's own server, CPU or GPU) or sglang."""
    servers: int = 2
    """Rollout servers (data parallel: one per TP group)."""
    group_size: int = 8
    """Samples per prompt (G in GRPO)."""
    batch_size: int = 32
    """Groups per rollout batch (B): all generated with one weight version."""
    concurrency: int = 32
    """Requests in flight per server under frontier admission (fifo admission sends everything)."""
    max_running_requests: int = 128
    """Largest decode batch a built-in server runs."""
    dynamic_sampling: bool = False
    """Drop complete groups whose rewards are all equal (they carry no GRPO signal)."""
    over_provision: float = 0.0
    """With dynamic sampling: open this fraction more groups than still needed, so that drops do
    not leave the rollout batch waiting for late replacements. Leftovers are aborted."""
    cpus: list[int] = field(default_factory=list)
    """Pin rollout servers to these CPU cores (empty = no pinning)."""
    device: str = "cpu"
    """Where built-in servers run: cpu or cuda (server i uses cuda:i when there are enough GPUs)."""
    gpus: list[int] = field(default_factory=list)
    """Local launcher, device cuda: the GPUs the servers use (server i on gpus[i % len]); empty = cuda:i."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


@dataclass(kw_only=True)
class MegatronConfig:
    """train.engine=megatron: how the Megatron-core model is parallelized."""

    tp: int = 1
    """Tensor-parallel size; train.ranks = tp x data-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (only 1 for now)."""
    dtype: str = "bfloat16"
    """Parameter dtype: bfloat16 (fp32 master weights in the optimizer) or float32."""


@dataclass(kw_only=True)
class TrainConfig:
    engine: str = "torch"
    """torch (transformers model, DDP) or megatron (Megatron-core GPTModel; CUDA only)."""
    ranks: int = 1
    """Data-parallel trainer processes (torch.distributed, gloo on CPU)."""
    cpus: list[int] = field(default_factory=list)
    """Pin trainer ranks to these CPU cores (empty = no pinning)."""
    device: str = "cpu"
    """cpu or cuda (rank r uses cuda:r when there are enough GPUs)."""
    gpus: list[int] = field(default_factory=list)
    """Local launcher, device cuda: the GPUs the ranks use (rank r on gpus[r % len]); empty = cuda:r.
    Give trainers and servers different GPUs for a disaggregated run on one multi-GPU host."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    groups_per_batch: int = 8
    """Groups per train batch (one optimizer step); must divide rollout.batch_size."""
    clip_eps: float = 0.2
    """PPO/GRPO ratio clip."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty against the initial model (0 = off, no reference copy kept)."""
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192
    """Most padded tokens per forward/backward; a train batch is split by length to fit."""
    sync_bucket_mb: float = 64.0
    """Size of one weight-broadcast bucket in MiB."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    sync_backend: str = "auto"
    """Weight-sync group: gloo (CPU staging), nccl (GPU to GPU, one GPU per rank), or auto: nccl
    when trainers and servers are on GPUs of different nodes (launcher=slurm), else gloo."""


@dataclass(kw_only=True)
class PipelineConfig:
    mode: str = "sync"
    """sync: generate the rollout batch, then train, then broadcast weights.
    rolloutpipe: weights fixed per rollout batch, but each complete group goes to the trainer at
    once and a train batch starts as soon as it is full. async: rollout never stops; samples carry
    their weight version and at most max_staleness versions of lag are trained."""
    admission: str = "fifo"
    """Order and amount of requests sent to the servers. fifo: the whole rollout batch at once,
    in group order (the servers queue what they cannot run). frontier: at most
    rollout.concurrency per server, groups needed for the next train batch first."""
    stream_train: bool = True
    """rolloutpipe: the trainer runs forward and backward on each complete group as soon as it
    is free (gradient accumulation) and takes the optimizer step when the train batch is full,
    instead of waiting for the whole train batch first. The step is the same either way."""
    max_staleness: int = 1
    """async: the most weight versions a trained sample may lag behind the trainer."""
    sync_every: int = 1
    """async: optimizer steps between weight broadcasts."""
    check_weights: bool = False
    """After every weight sync, compare the sha256 of every tensor on each server with the
    trainer's, and fail the run on a difference (built-in servers; slow: for tests)."""
    inflight_at_update: str = "finish"
    """async: what happens to requests in flight at a weight update. finish: they complete on the
    old weights (tagged with that version). abort_resume: they are aborted and resumed on the new
    weights from where they stopped (partial rollout; a sample then spans versions)."""


@dataclass(kw_only=True)
class SimConfig:
    """`rlctl simulate`: the cluster and model the cost model prices (rlctl/sim/cost.py)."""

    gpu: str = "h200"
    """h200 | h100 | a100 | cpu"""
    params_b: float = 1.7
    """Model size in billions of parameters (bf16)."""
    rollout_gpus: int = 8
    trainer_gpus: int = 8
    tp: int = 1
    """GPUs per rollout server; the simulation has rollout_gpus / tp servers."""
    prompt_tokens: int = 256
    context_tokens: int = 2048
    """Mean tokens of context a decoding request holds (its KV cache read per step)."""
    layers: int = 0
    """Transformer layers, for the KV-cache size (0 = estimate from params_b)."""
    kv_dim: int = 0
    """KV heads x head dim, for the KV-cache size (0 = estimate)."""
    reward_rate: float = 0.5
    """Chance that a simulated sample is right (drives dynamic sampling's drop rate)."""
    mfu_train: float = 0.4
    mfu_prefill: float = 0.5
    decode_bw_efficiency: float = 0.7
    decode_step_overhead_s: float = 0.0
    train_step_overhead_s: float = 0.0


@dataclass(kw_only=True)
class SlurmTrainerConfig:
    """Heterogeneous-job component 0: the trainer ranks (and the controller, on the first node)."""

    nodes: int = 1
    gpus_per_node: int = 0
    """GPUs to request per node (--gpus-per-node); 0 = none."""
    cpus_per_task: int = 0
    """--cpus-per-task for each trainer rank; 0 = the cluster's default."""
    mem: str = ""
    """--mem per node, e.g. 200G; empty = the cluster's default."""


@dataclass(kw_only=True)
class SlurmRolloutConfig:
    """Heterogeneous-job component 1: the rollout servers."""

    nodes: int = 0
    """0 = rollout.servers / servers_per_node."""
    servers_per_node: int = 1
    """Rollout servers per node (one per TP group of the node's GPUs)."""
    gpus_per_node: int = 0
    cpus_per_task: int = 0
    mem: str = ""


@dataclass(kw_only=True)
class SlurmConfig:
    """launcher=slurm: the run is one heterogeneous Slurm job (trainers | rollout servers)."""

    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = "01:00:00"
    """Time limit, in any of Slurm's forms (MM, HH:MM:SS, D-HH:MM ...)."""
    trainer: SlurmTrainerConfig = field(default_factory=SlurmTrainerConfig)
    rollout: SlurmRolloutConfig = field(default_factory=SlurmRolloutConfig)
    sbatch_args: list[str] = field(default_factory=list)
    """Extra sbatch flags for both components, e.g. ["--exclusive", "--constraint=h200"]."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run at the start of the job, e.g. "module load cuda/12.4", "source venv/bin/activate"."""
    python: str = ""
    """The Python on the compute nodes; empty = the one that runs `rlctl launch` (shared filesystem)."""
    port_base: int = 0
    """First port the run's servers listen on; 0 = 20000 + job id % 20000, so jobs sharing a node differ."""
    health_timeout_s: int = 600
    """How long the job waits for every rollout server's /health before it gives up."""


@dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases: the resolved recipe as config, every step's metrics (the names of
    metrics.jsonl), and a summary at the end. `offline` writes into the run directory."""

    mode: str = "disabled"
    """disabled | offline | online"""
    project: str = "rlctl"
    entity: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class TrackingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(kw_only=True)
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    launcher: str = "local"
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sim: SimConfig = field(default_factory=SimConfig)



# ----------------------------------------------------------------------------------------------
# Loading


def load_recipe(path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = (),
                check_paths: bool = True) -> Recipe:
    """Read a recipe file, apply `key=value` overrides, and return a validated Recipe.

    check_paths=False skips the checks that local files exist (model, data): a simulation of a
    cluster run needs neither."""
    file = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise RecipeError(file, "<file>", "no such file; check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(file, "<file>", f"cannot read it ({e.__class__.__name__}: {e})") from None
    recipe = recipe_from_yaml(text, file, overrides)
    base = Path(path).resolve().parent
    _resolve_relative_paths(recipe, base)
    validate(recipe, file, check_paths)
    return recipe


def recipe_from_yaml(text: str, file: str, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = yaml.safe_load(text)
    except yaml.constructor.ConstructorError as e:
        where = _yaml_where(e)
        raise RecipeError(file, where, f"unsafe or unknown YAML tag ({e.problem}); recipes are plain YAML") from None
    except yaml.YAMLError as e:
        where = _yaml_where(e)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(file, where, f"malformed YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(file, "<top level>", f"a recipe is a mapping of sections, got {type(data).__name__}")

    schema = OmegaConf.structured(Recipe)
    current_file = file
    try:
        cfg = OmegaConf.merge(schema, OmegaConf.create(data))
        current_file = "<overrides>"
        for item in overrides:
            if "=" not in item:
                raise RecipeError(current_file, item, "an override is KEY=VALUE, e.g. run.steps=10")
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _translate_omegaconf_error(e, current_file) from None
    assert isinstance(obj, Recipe)
    return obj


def recipe_to_yaml(recipe: Recipe) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(recipe))


def _yaml_where(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if mark is None:
        return "<yaml>"
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _translate_omegaconf_error(e: Exception, file: str) -> RecipeError:
    from omegaconf.errors import ConfigKeyError, ValidationError

    key = getattr(e, "full_key", None) or "<unknown>"
    msg = getattr(e, "msg", None) or str(e)
    if isinstance(e, ConfigKeyError) or "not in" in msg:
        parent = key.rpartition(".")[0]
        valid = _valid_keys(parent)
        hint = f"valid keys{' under ' + parent if parent else ''}: {', '.join(valid)}" if valid else "remove it"
        return RecipeError(file, key, f"unknown key; {hint}")
    if isinstance(e, ValidationError):
        expected = _expected_type(key)
        first = msg.splitlines()[0]
        return RecipeError(file, key, f"{first}; expected {expected}" if expected else first)
    return RecipeError(file, key, msg.splitlines()[0])


def _field_at(key: str) -> Any:
    """The dataclass field type at a dotted key, or None."""
    import typing

    cls: Any = Recipe
    ftype: Any = None
    for part in key.split("."):
        if not is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        ftype = hints[part]
        args = [a for a in typing.get_args(ftype) if a is not type(None)]
        cls = args[0] if typing.get_origin(ftype) is typing.Union and args else ftype
    return ftype


def _valid_keys(parent: str) -> list[str]:
    import typing

    ftype = Recipe if not parent else _field_at(parent)
    args = [a for a in typing.get_args(ftype) if a is not type(None)]
    cls = args[0] if args and typing.get_origin(ftype) is typing.Union else ftype
    return [f.name for f in fields(cls)] if is_dataclass(cls) else []


def _expected_type(key: str) -> str | None:
    ftype = _field_at(key)
    if ftype is None:
        return None
    return getattr(ftype, "__name__", None) or str(ftype).replace("typing.", "")


def _resolve_relative_paths(recipe: Recipe, base: Path) -> None:
    """Paths in a recipe are relative to the recipe file, as users expect from config files."""
    if recipe.model.path and not os.path.isabs(os.path.expanduser(recipe.model.path)):
        candidate = base / recipe.model.path
        if candidate.exists():
            recipe.model.path = str(candidate)
    if recipe.data.path and not os.path.isabs(os.path.expanduser(recipe.data.path)):
        candidate = base / recipe.data.path
        if candidate.exists():
            recipe.data.path = str(candidate)


# ----------------------------------------------------------------------------------------------
# Validation of values that are well-typed but impossible


def _choice(file: str, key: str, value: str, enum_type: type[enum.Enum]) -> None:
    valid = [m.value for m in enum_type]
    if value not in valid:
        raise RecipeError(file, key, f"'{value}' is not one of {', '.join(valid)}")
    available = AVAILABLE.get(key)
    if available is not None and value not in {m.value for m in available}:
        names = ", ".join(sorted(m.value for m in available))
        raise RecipeError(file, key, f"'{value}' is not available in this version of rlctl; use {names}")


def _positive(file: str, key: str, value: float, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise RecipeError(file, key, f"must be {'>= 0' if zero_ok else '> 0'}, got {value}")


def validate(recipe: Recipe, file: str, check_paths: bool = True) -> None:
    r = recipe
    _positive(file, "run.steps", r.run.steps)
    _positive(file, "run.threads_per_process", r.run.threads_per_process)
    if not r.run.name or "/" in r.run.name or r.run.name.startswith("."):
        raise RecipeError(file, "run.name", f"'{r.run.name}' is not a usable name; use letters, digits, - and _")

    if (r.model.path is None) == (r.model.init is None):
        raise RecipeError(file, "model", "set exactly one of model.path (a local HF directory) or model.init (build a tiny model)")
    if r.model.path is not None and check_paths:
        p = Path(os.path.expanduser(r.model.path))
        if not (p / "config.json").is_file():
            raise RecipeError(file, "model.path", f"'{r.model.path}' is not a Hugging Face model directory (no config.json); give a local model directory")
    if r.model.init is not None:
        i = r.model.init
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "max_position_embeddings"):
            _positive(file, f"model.init.{name}", getattr(i, name))
        if i.num_heads % i.num_kv_heads:
            raise RecipeError(file, "model.init.num_kv_heads", f"must divide num_heads ({i.num_heads})")
        _positive(file, "model.init.warmup_steps", i.warmup_steps, zero_ok=True)
        if not 0.0 <= i.warmup_correct_prob <= 1.0:
            raise RecipeError(file, "model.init.warmup_correct_prob", f"must be in [0, 1], got {i.warmup_correct_prob}")

    _choice(file, "data.source", r.data.source, DataSource)
    if r.data.source == DataSource.TASK:
        from rlctl.rewards.tasks import TASKS

        if r.data.task not in TASKS:
            raise RecipeError(file, "data.task", f"unknown task '{r.data.task}'; built-in tasks: {', '.join(TASKS)}")
    else:
        if not r.data.path:
            raise RecipeError(file, "data.path", "data.source=jsonl needs data.path, a JSONL file of prompt/answer rows")
        if check_paths and not Path(os.path.expanduser(r.data.path)).is_file():
            raise RecipeError(file, "data.path", f"'{r.data.path}' does not exist; give a JSONL file of prompt/answer rows")

    if r.model.init is not None and r.model.init.warmup_steps > 0 and r.data.source != DataSource.TASK:
        raise RecipeError(file, "model.init.warmup_steps", "the warm-up trains on a built-in task; set data.source=task or warmup_steps=0")

    _choice(file, "reward.verifier", r.reward.verifier, Verifier)
    if r.reward.verifier == Verifier.FUNCTION:
        fn = r.reward.function or ""
        module, _, attr = fn.partition(":")
        if not module or not attr:
            raise RecipeError(file, "reward.function", f"'{fn}' is not of the form package.module:callable")
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise RecipeError(file, "reward.function", f"module '{module}' cannot be imported; install it or fix PYTHONPATH")
    elif r.reward.function is not None:
        raise RecipeError(file, "reward.function", "only used with reward.verifier=function; remove it or set the verifier")

    ro = r.rollout
    _choice(file, "rollout.engine", ro.engine, RolloutEngine)
    _positive(file, "rollout.servers", ro.servers)
    if ro.group_size < 2:
        raise RecipeError(file, "rollout.group_size", f"GRPO needs at least 2 samples per group, got {ro.group_size}")
    _positive(file, "rollout.batch_size", ro.batch_size)
    _positive(file, "rollout.concurrency", ro.concurrency)
    _positive(file, "rollout.max_running_requests", ro.max_running_requests)
    sg = ro.sglang
    _positive(file, "rollout.sglang.tp_size", sg.tp_size)
    if not 0.0 < sg.mem_fraction_static < 1.0:
        raise RecipeError(file, "rollout.sglang.mem_fraction_static", f"must be in (0, 1), got {sg.mem_fraction_static}")
    if sg.dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise RecipeError(file, "rollout.sglang.dtype", f"'{sg.dtype}' is not one of auto, bfloat16, float16, float32")
    for i, arg in enumerate(sg.extra_args):
        if arg.split("=")[0] in SGLANG_MANAGED_FLAGS:
            raise RecipeError(file, f"rollout.sglang.extra_args[{i}]", f"'{arg}' is set by rlctl; use the rollout.sglang keys or the plan")
    if ro.engine == RolloutEngine.SGLANG and ro.device != "cuda":
        raise RecipeError(file, "rollout.device", "SGLang runs on GPUs only; set rollout.device=cuda (or rollout.engine=builtin on CPU)")
    s = ro.sampling
    _positive(file, "rollout.sampling.temperature", s.temperature, zero_ok=True)
    if not 0.0 < s.top_p <= 1.0:
        raise RecipeError(file, "rollout.sampling.top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k == 0 or s.top_k < -1:
        raise RecipeError(file, "rollout.sampling.top_k", f"must be -1 (all) or >= 1, got {s.top_k}")
    _positive(file, "rollout.sampling.max_new_tokens", s.max_new_tokens)

    t = r.train
    _choice(file, "train.engine", t.engine, TrainEngine)
    _positive(file, "train.ranks", t.ranks)
    _positive(file, "train.lr", t.lr)
    _positive(file, "train.weight_decay", t.weight_decay, zero_ok=True)
    _positive(file, "train.groups_per_batch", t.groups_per_batch)
    if ro.batch_size % t.groups_per_batch:
        raise RecipeError(
            file, "train.groups_per_batch",
            f"{t.groups_per_batch} does not divide rollout.batch_size ({ro.batch_size}); pick a divisor so every train batch is full",
        )
    _positive(file, "train.clip_eps", t.clip_eps)
    _positive(file, "train.kl_coef", t.kl_coef, zero_ok=True)
    _positive(file, "train.grad_clip", t.grad_clip)
    _positive(file, "train.micro_batch_tokens", t.micro_batch_tokens)
    _positive(file, "train.sync_bucket_mb", t.sync_bucket_mb)
    mg = t.megatron
    _positive(file, "train.megatron.tp", mg.tp)
    if mg.pp != 1:
        raise RecipeError(file, "train.megatron.pp", "pipeline parallelism is not supported yet; use pp=1 (and tp for large models)")
    if mg.dtype not in ("bfloat16", "float32"):
        raise RecipeError(file, "train.megatron.dtype", f"'{mg.dtype}' is not one of bfloat16, float32")
    if t.engine == TrainEngine.MEGATRON:
        if t.ranks % mg.tp:
            raise RecipeError(file, "train.megatron.tp", f"{mg.tp} does not divide train.ranks ({t.ranks}); ranks = tp x data parallel")
        if t.device != "cuda":
            raise RecipeError(file, "train.device", "Megatron trains on GPUs only; set train.device=cuda (or train.engine=torch on CPU)")
        if t.kl_coef > 0:
            raise RecipeError(file, "train.kl_coef", "the KL penalty is not in the megatron engine yet; set it to 0 or use train.engine=torch")
    if t.sync_backend not in ("auto", "gloo", "nccl"):
        raise RecipeError(file, "train.sync_backend", f"'{t.sync_backend}' is not one of auto, gloo, nccl")

    for key, dev in (("rollout.device", ro.device), ("train.device", t.device)):
        if dev not in ("cpu", "cuda"):
            raise RecipeError(file, key, f"'{dev}' is not one of cpu, cuda")
    for key, gpus in (("rollout.gpus", ro.gpus), ("train.gpus", t.gpus)):
        if any(g < 0 for g in gpus):
            raise RecipeError(file, key, f"GPU indices are >= 0, got {gpus}")
    _choice(file, "pipeline.mode", r.pipeline.mode, PipelineMode)
    _choice(file, "pipeline.admission", r.pipeline.admission, Admission)
    _choice(file, "pipeline.inflight_at_update", r.pipeline.inflight_at_update, InflightAtUpdate)
    _positive(file, "pipeline.max_staleness", r.pipeline.max_staleness, zero_ok=True)
    _positive(file, "pipeline.sync_every", r.pipeline.sync_every)
    _positive(file, "rollout.over_provision", ro.over_provision, zero_ok=True)
    lt = s.long_tail
    if lt.enabled:
        if not 0.0 < lt.median_fraction < 1.0:
            raise RecipeError(file, "rollout.sampling.long_tail.median_fraction", f"must be in (0, 1), got {lt.median_fraction}")
        _positive(file, "rollout.sampling.long_tail.sigma", lt.sigma, zero_ok=True)
        if not 0.0 <= lt.truncated_fraction < 1.0:
            raise RecipeError(file, "rollout.sampling.long_tail.truncated_fraction", f"must be in [0, 1), got {lt.truncated_fraction}")
        _positive(file, "rollout.sampling.long_tail.min_tokens", lt.min_tokens)
    ncpu = len(os.sched_getaffinity(0))
    for key, cpus in (("rollout.cpus", ro.cpus), ("train.cpus", t.cpus)) if r.launcher == Launcher.LOCAL else ():
        bad = [c for c in cpus if not 0 <= c < ncpu]
        if bad:
            raise RecipeError(file, key, f"cores {bad} do not exist here (0..{ncpu - 1}); leave it empty to not pin")
    _choice(file, "launcher", r.launcher, Launcher)
    _validate_slurm(r, file)
    sim = r.sim
    from rlctl.sim.cost import HARDWARE

    if sim.gpu not in HARDWARE:
        raise RecipeError(file, "sim.gpu", f"'{sim.gpu}' is not one of {', '.join(HARDWARE)}")
    for key in ("params_b", "rollout_gpus", "trainer_gpus", "tp", "prompt_tokens", "mfu_train", "mfu_prefill",
                "decode_bw_efficiency"):
        _positive(file, f"sim.{key}", getattr(sim, key))
    if sim.rollout_gpus % sim.tp:
        raise RecipeError(file, "sim.tp", f"{sim.tp} does not divide sim.rollout_gpus ({sim.rollout_gpus})")
    if not 0.0 <= sim.reward_rate <= 1.0:
        raise RecipeError(file, "sim.reward_rate", f"must be in [0, 1], got {sim.reward_rate}")

    wb = r.tracking.wandb
    if wb.mode not in ("disabled", "offline", "online"):
        raise RecipeError(file, "tracking.wandb.mode", f"'{wb.mode}' is not one of disabled, offline, online")
    if wb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise RecipeError(file, "tracking.wandb.mode", "wandb is not installed: pip install 'rlctl[wandb]', or set it to disabled")


_SLURM_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE)$")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,:+-]*$")


def slurm_rollout_nodes(recipe: Recipe) -> int:
    sl = recipe.slurm.rollout
    return sl.nodes or -(-recipe.rollout.servers // sl.servers_per_node)


def _validate_slurm(r: Recipe, file: str) -> None:
    """The slurm section is checked whatever the launcher, so a typo shows before a cluster run."""
    sl = r.slurm
    for key in ("partition", "account", "qos", "trainer.mem", "rollout.mem"):
        value = getattr(sl.trainer if key.startswith("trainer.") else sl.rollout if key.startswith("rollout.") else sl,
                        key.rpartition(".")[2])
        if not _SLURM_NAME.match(value):
            raise RecipeError(file, f"slurm.{key}", f"'{value}' has characters Slurm names do not use; letters, digits and _.,:+- only")
    if not _SLURM_TIME.match(sl.time):
        raise RecipeError(file, "slurm.time", f"'{sl.time}' is not a Slurm time limit; use MM, HH:MM:SS or D-HH:MM:SS")
    for key, value in (("trainer.nodes", sl.trainer.nodes), ("rollout.servers_per_node", sl.rollout.servers_per_node),
                       ("health_timeout_s", sl.health_timeout_s)):
        _positive(file, f"slurm.{key}", value)
    for key, value in (("trainer.gpus_per_node", sl.trainer.gpus_per_node), ("trainer.cpus_per_task", sl.trainer.cpus_per_task),
                       ("rollout.nodes", sl.rollout.nodes), ("rollout.gpus_per_node", sl.rollout.gpus_per_node),
                       ("rollout.cpus_per_task", sl.rollout.cpus_per_task), ("port_base", sl.port_base)):
        _positive(file, f"slurm.{key}", value, zero_ok=True)
    if sl.port_base and not 1024 <= sl.port_base <= 65000:
        raise RecipeError(file, "slurm.port_base", f"{sl.port_base} is outside 1024..65000; use 0 to derive it from the job id")
    for i, arg in enumerate(sl.sbatch_args):
        if not arg.startswith("-") or "\n" in arg:
            raise RecipeError(file, f"slurm.sbatch_args[{i}]", f"'{arg}' is not an sbatch flag; write flags like --exclusive or --constraint=h200")
        if arg.split("=")[0] in ("--job-name", "-J", "--output", "-o", "--error", "-e", "--nodes", "-N", "--het-group"):
            raise RecipeError(file, f"slurm.sbatch_args[{i}]", f"'{arg}' is set by rlctl; use the slurm section's own keys")
    for i, line in enumerate(sl.setup):
        if "\n" in line:
            raise RecipeError(file, f"slurm.setup[{i}]", "one shell line per list item")
    if r.launcher != Launcher.SLURM:
        return
    ro = sl.rollout
    if ro.nodes and ro.nodes * ro.servers_per_node != r.rollout.servers:
        raise RecipeError(file, "slurm.rollout.nodes", f"{ro.nodes} nodes x {ro.servers_per_node} servers per node != "
                          f"rollout.servers ({r.rollout.servers}); set nodes to 0 to derive it")
    if r.rollout.servers % ro.servers_per_node:
        raise RecipeError(file, "slurm.rollout.servers_per_node", f"{ro.servers_per_node} does not divide rollout.servers ({r.rollout.servers})")
    if r.train.ranks % sl.trainer.nodes:
        raise RecipeError(file, "slurm.trainer.nodes", f"{sl.trainer.nodes} does not divide train.ranks ({r.train.ranks}); every node runs the same number of ranks")
    if r.rollout.cpus or r.train.cpus:
        key = "rollout.cpus" if r.rollout.cpus else "train.cpus"
        raise RecipeError(file, key, "core pinning is for the local launcher; with launcher=slurm use slurm.*.cpus_per_task")
