"""The sections that say what a run trains and on what: run, model, reward (data: rlctl/recipe/data.py)."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.recipe.checks import FieldError, Section, at_most, positive, within
from rlctl.recipe.choices import RewardOnError, Verifier
from rlctl.recipe.imports import check_spec, import_object
from rlctl.recipe.reward_call import RewardCall

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
    most MAX_STEPS. 0 trains nothing: the run evaluates its eval sets at the model's weights and
    ends (what `rlctl eval` launches)."""
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
    save_final: bool = True
    """A run that completes its steps writes its policy as RUN/final/ (an HF model directory with
    its tokenizer) for `rlctl export RUN`, unless a checkpoint after the last step holds it."""
    sample_groups: int = 2
    """Groups a step whose samples (prompt, response, answer, reward and named scores, weight
    version, finish reason, lengths) go to the run directory's samples.jsonl, the first groups
    to complete in each step (0 = none); `rlctl samples RUN` prints them."""
    stall_timeout_s: float = 600.0
    """The watchdog of the controller and the trainer (rollout servers have rollout.stall_timeout_s):
    the run fails, saying which, when the controller's heartbeat has stopped this long (the
    supervisor checks it), or when a call to the trainer has taken this long and 10x the slowest
    call of its kind so far (rlctl/process/watchdog.py)."""

    def check(self) -> None:
        positive("steps", self.steps, zero_ok=True)
        at_most("steps", self.steps, MAX_STEPS)
        positive("threads_per_process", self.threads_per_process)
        at_most("threads_per_process", self.threads_per_process, 1024)
        within("save_every", self.save_every, 0, MAX_STEPS)
        within("keep_checkpoints", self.keep_checkpoints, 0, 10_000)
        within("sample_groups", self.sample_groups, 0, 1_000_000)
        within("stall_timeout_s", self.stall_timeout_s, 1.0, 7 * 86400.0)
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
    """AdamW learning rate of the supervised warm-up, in (0, 1]."""
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
        within("warmup_lr", self.warmup_lr, 0.0, 1.0, open_low=True)


@dataclass(kw_only=True)
class ModelConfig(Section):
    path: str | None = None
    """A local Hugging Face causal-LM directory (config.json, safetensors, tokenizer)."""
    init: ModelInit | None = None
    """Build a tiny model instead of loading one (exactly one of path / init). `model.path=X` on
    the command line replaces the recipe's init: `rlctl launch recipes/quickstart.yaml
    model.path=~/models/Qwen3-0.6B` runs the quickstart on that model."""

    def check(self) -> None:
        if (self.path is None) == (self.init is None):
            raise FieldError("", "set exactly one of model.path (a local HF directory) or model.init (build a tiny model)")

    def check_files(self) -> None:
        if self.path is not None and not (Path(os.path.expanduser(self.path)) / "config.json").is_file():
            raise FieldError("path", f"'{self.path}' is not a Hugging Face model directory (no config.json); "
                                     "give a local model directory")


MAX_VERIFY_S = 86_400.0
"""reward.timeout_s at most: a day, more than any verification of one response takes."""


@dataclass(kw_only=True)
class RewardConfig(Section):
    verifier: Verifier = Verifier.EXACT
    """exact | numeric | math (math-verify) | function (user code, see `function`)."""
    function: str | None = None
    """`module:callable` (or `package.module:callable`) for verifier=function. It is called with
    the response's text, the reference answer and, by parameter name, the row's fields
    (rlctl/recipe/reward_call.py says which argument goes where: `score(response, answer)` and
    verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` both work). It
    returns a number, or a dict of named scores (e.g. {format: 0.1, correct: 1.0}), each logged
    as the step metric `score_<name>`, whose sum (or `score_key`'s entry) is the reward. The
    reward is clipped to [0, 1]. The module is looked for on the Python path, then in
    `module_dir`. `rlctl launch` imports it and checks its parameters before anything starts."""
    score_key: str | None = None
    """verifier=function returning a dict: the entry that is the reward (e.g. `score`, as verl's
    functions return it); unset, the sum of the entries."""
    module_dir: str | None = None
    """Where `function`'s module may lie besides the Python path: relative to the recipe file, and
    the recipe's own directory when unset (so `my_reward:score` finds my_reward.py beside the
    recipe). The run's resolved recipe holds it as an absolute path, which the scoring processes
    of every node import from: on a cluster it must be on a filesystem the nodes share."""
    on_error: RewardOnError = RewardOnError.FAIL
    """What a response the verifier fails on (it raised, or ran past `timeout_s`) does: `fail`
    ends the run at once, saying why; `zero` scores that response 0 and goes on, counting the
    errors (the step metric `reward_errors`) until there are more than `max_errors`. Either way
    the traceback and the response's prompt, text and answer, cut to a few lines, go to the
    controller's log and to a `reward_error` event."""
    max_errors: int = 100
    """on_error=zero: the run fails at its (max_errors + 1)-th reward error. 100 lets a verifier
    choke on the odd response; one that fails on every response (a step scores
    rollout.batch_size x group_size of them, 256 in the quickstart) stops the run in its first
    step. Raise it for long runs whose verifier fails now and then."""
    timeout_s: float = 60.0
    """Seconds the verifier may take on one response, in its scoring process; past them the
    process is stopped and replaced, and the response is a reward error (see on_error). Applies
    to every launched run, whatever the verifier; a simulation scores without it. At most a day."""

    def check(self) -> None:
        positive("max_errors", self.max_errors, zero_ok=True)
        at_most("max_errors", self.max_errors, 1_000_000_000)
        positive("timeout_s", self.timeout_s)
        at_most("timeout_s", self.timeout_s, MAX_VERIFY_S)
        if self.verifier is not Verifier.FUNCTION:
            for key in ("function", "module_dir", "score_key"):
                if getattr(self, key) is not None:
                    raise FieldError(key, "only used with reward.verifier=function; remove it or set the verifier")
            return
        check_spec("function", self.function, "my_reward:score, with my_reward.py beside the recipe", "callable")

    def check_files(self) -> None:
        if self.verifier is Verifier.FUNCTION:
            self.load_function()

    def resolve(self, base: Path) -> None:
        """module_dir made absolute, relative to `base`, the recipe file's directory (load_recipe)."""
        if self.verifier is Verifier.FUNCTION:
            self.module_dir = os.path.normpath(base / os.path.expanduser(self.module_dir or "."))

    def load_function(self) -> Callable[..., Any]:
        """Import `function` (module_dir after the Python path) and check that it can be called as
        rlctl calls it (rlctl/recipe/reward_call.py): the callable, or a FieldError naming the fix.
        The recipe's check, the controller and every scoring process load it through here."""
        fn = import_object("function", self.function or "", self.module_dir, "function")
        if not callable(fn):
            raise FieldError("function", f"'{self.function}' is not callable (its type is {type(fn).__name__}); "
                                         "name a function")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature to read (a builtin): its first call will tell
            return fn
        try:
            RewardCall.of(signature)
        except ValueError as e:
            raise FieldError("function", f"'{self.function}{signature}' cannot be called as a reward: {e}") from None
        return fn
