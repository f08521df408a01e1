"""The sections that say what a run trains and on what: run, model, data, reward."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from rlctl.recipe.checks import FieldError, Section, at_most, positive, within
from rlctl.recipe.choices import DataSource, TaskName, Verifier

RUN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,99}$")
"""A run name: it begins the run id, which names the run's directory, its Slurm job (#SBATCH
--job-name, rlctl/launchers/slurm/script.py) and its processes' command lines. Letters, digits
and _.+- only (no space, quote, newline or other control character to break a shell line or a
Slurm directive), not starting with - or . (an option, a hidden directory), 100 at most."""
MAX_STEPS = 10_000_000
"""run.steps and model.init.warmup_steps at most: more than any run takes (10^6 steps is a year
of 30-second steps)."""


@dataclass(kw_only=True)
class RunConfig(Section):
    name: str = "run"
    """Human name of the run; the run id is `<name>-<date>-<time>-<suffix>` (RUN_NAME says which
    characters)."""
    seed: int = 0
    """Seeds data order, sampling on the rollout servers and model init."""
    steps: int = 20
    """Number of rollout batches (each followed by its optimizer steps and a weight sync); at
    most MAX_STEPS."""
    output_dir: str = "runs"
    """Where run directories are created (relative to the current directory)."""
    threads_per_process: int = 1
    """torch threads per worker process; keep low when several processes share a few cores (at
    most 1024)."""
    shared_group: bool = False
    """The run directory readable by its group too (0750, for a project group sharing runs)
    instead of its owner's alone (0700); the run's token file stays 0600 either way."""
    save_every: int = 0
    """Write a checkpoint every this many steps and after the last step (0 = never): what `rlctl
    resume` continues from and `rlctl export` exports (run_dir/checkpoints/step-NNNNNN/)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep, the newest (0 = all)."""

    def check(self) -> None:
        positive("steps", self.steps)
        at_most("steps", self.steps, MAX_STEPS)
        positive("threads_per_process", self.threads_per_process)
        at_most("threads_per_process", self.threads_per_process, 1024)
        positive("save_every", self.save_every, zero_ok=True)
        positive("keep_checkpoints", self.keep_checkpoints, zero_ok=True)
        if not RUN_NAME.fullmatch(self.name):
            raise FieldError("name", f"'{self.name}' is not a usable name; use up to 100 letters, digits and _.+- "
                                     "(not - or . first)")


@dataclass(kw_only=True)
class ModelInit(Section):
    """A tiny Qwen3-architecture model that rlctl builds itself, with a character tokenizer.

    It is given a short supervised warm-up on the run's task with noisy answers, so that it knows
    the answer format and is right only some of the time: the starting point RL then improves.
    Its sizes are at most 65,536 (layers 1,024, positions 2^20, warm-up batch 65,536 samples):
    a tiny model is built on this machine, and a typo there would take all its memory.
    """

    hidden_size: int = 128
    """Hidden size of the tiny model."""
    num_layers: int = 2
    """Transformer layers."""
    num_heads: int = 4
    """Attention (query) heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int = 32
    """Size of each attention head."""
    intermediate_size: int = 256
    """Width of each layer's MLP."""
    max_position_embeddings: int = 64
    """Longest prompt + response the model takes, in tokens (characters)."""
    seed: int = 0
    """Seeds the weights and the warm-up data; the model is cached by its init block."""
    warmup_steps: int = 25
    """Supervised steps on the task before RL (0 = random init): few enough to leave it half-trained."""
    warmup_correct_prob: float = 1.0
    """Fraction of warm-up answers that are correct; the rest are random answers of the right form."""
    warmup_lr: float = 3e-3
    """AdamW learning rate of the supervised warm-up."""
    warmup_batch_size: int = 64
    """Samples per warm-up step."""

    def check(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            positive(name, getattr(self, name))
            at_most(name, getattr(self, name), {"num_layers": 1024, "max_position_embeddings": 1 << 20}.get(name, 65_536))
        if self.num_heads % self.num_kv_heads:
            raise FieldError("num_kv_heads", f"must divide num_heads ({self.num_heads})")
        positive("warmup_steps", self.warmup_steps, zero_ok=True)
        at_most("warmup_steps", self.warmup_steps, MAX_STEPS)
        positive("warmup_batch_size", self.warmup_batch_size)
        at_most("warmup_batch_size", self.warmup_batch_size, 65_536)
        within("warmup_correct_prob", self.warmup_correct_prob, 0.0, 1.0)


@dataclass(kw_only=True)
class ModelConfig(Section):
    path: str | None = None
    """A local Hugging Face causal-LM directory (config.json, safetensors, tokenizer)."""
    init: ModelInit | None = None
    """Build a tiny model instead of loading one (exactly one of path / init)."""

    def check(self) -> None:
        if (self.path is None) == (self.init is None):
            raise FieldError("", "set exactly one of model.path (a local HF directory) or model.init (build a tiny model)")

    def check_files(self) -> None:
        if self.path is not None and not (Path(os.path.expanduser(self.path)) / "config.json").is_file():
            raise FieldError("path", f"'{self.path}' is not a Hugging Face model directory (no config.json); "
                                     "give a local model directory")


@dataclass(kw_only=True)
class DataConfig(Section):
    source: DataSource = DataSource.TASK
    """`task` (a built-in verifiable task generator) or `jsonl` (a file of prompt/answer rows)."""
    task: TaskName = TaskName.MAX_DIGIT
    """Built-in task: `max-digit` or `add` (rlctl/rewards/tasks.py)."""
    path: str | None = None
    """JSONL file for source=jsonl."""
    prompt_key: str = "prompt"
    """source=jsonl: the field of each row that holds the prompt."""
    answer_key: str = "answer"
    """source=jsonl: the field of each row that holds the answer the verifier checks against."""

    def check(self) -> None:
        if self.source is DataSource.JSONL and not self.path:
            raise FieldError("path", "data.source=jsonl needs data.path, a JSONL file of prompt/answer rows")

    def check_files(self) -> None:
        if self.source is DataSource.JSONL and not Path(os.path.expanduser(self.path or "")).is_file():
            raise FieldError("path", f"'{self.path}' does not exist; give a JSONL file of prompt/answer rows")


@dataclass(kw_only=True)
class RewardConfig(Section):
    verifier: Verifier = Verifier.EXACT
    """exact | numeric | math (math-verify) | function (user code, see `function`)."""
    function: str | None = None
    """`package.module:callable` taking (response, answer) and returning a float in [0, 1]."""

    def check(self) -> None:
        if self.verifier is not Verifier.FUNCTION:
            if self.function is not None:
                raise FieldError("function", "only used with reward.verifier=function; remove it or set the verifier")
            return
        fn = self.function or ""
        module, _, attr = fn.partition(":")
        if not module or not attr:
            raise FieldError("function", f"'{fn}' is not of the form package.module:callable")
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise FieldError("function", f"module '{module}' cannot be imported; install it or fix PYTHONPATH")
