"""The eval section: held-out prompt sets the run evaluates on its rollout servers, at the
weights of the moment, before training, every N steps and at the end (rlctl/control/evaluation.py
runs them; rlctl/pipelines/evaluation.py generates and scores)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.recipe.checks import FieldError, Section, at_most, positive, within
from rlctl.recipe.inputs import RewardConfig

MAX_EVAL_SAMPLES = 1024
"""eval.sets[].samples at most: k of pass@k."""


@dataclass(kw_only=True)
class EvalSet(Section):
    """One held-out set: its prompts, how many samples each, how they are sampled and verified."""

    path: str = ""
    """A JSONL or Parquet file, or a save_to_disk directory, read as data.path is (plain prompts
    or chat messages, verl's layout; the run's chat template applies)."""
    name: str = ""
    """Its name in metrics (`eval/NAME/...`) and tables; default: the file's name without suffix."""
    prompt_key: str = "prompt"
    """The field that holds the prompt (as data.prompt_key)."""
    answer_key: str = "answer"
    """The field that holds the reference answer (as data.answer_key; dotted paths reach in)."""
    limit: int = 0
    """Evaluate the first this many prompts of the file (0 = every one)."""
    samples: int = 4
    """Responses per prompt: the k of mean@k and pass@k."""
    temperature: float | None = None
    """Sampling temperature (unset: rollout.sampling.temperature)."""
    top_p: float | None = None
    """Nucleus sampling (unset: rollout.sampling.top_p)."""
    max_new_tokens: int | None = None
    """Longest response (unset: rollout.sampling.max_new_tokens)."""
    reward: RewardConfig | None = None
    """The set's verifier, a reward section of its own (unset: the run's reward section). Either
    way an evaluation scores a response its verifier fails on 0 and counts it (`errors`):
    on_error and max_errors are the run's training rewards' alone."""

    def check(self) -> None:
        if not self.path:
            raise FieldError("path", "name the set's file: a JSONL or Parquet file or a save_to_disk directory")
        within("limit", self.limit, 0, 100_000_000)
        positive("samples", self.samples)
        at_most("samples", self.samples, MAX_EVAL_SAMPLES)
        if self.temperature is not None:
            within("temperature", self.temperature, 0.0, 100.0)
        if self.top_p is not None:
            within("top_p", self.top_p, 0.0, 1.0, open_low=True)
        if self.max_new_tokens is not None:
            positive("max_new_tokens", self.max_new_tokens)
            at_most("max_new_tokens", self.max_new_tokens, 1 << 20)
        if self.name and (not self.name.replace("-", "").replace("_", "").replace(".", "").isalnum()):
            raise FieldError("name", f"'{self.name}' is not a usable name; use letters, digits and _.-")

    def check_files(self) -> None:
        if not Path(os.path.expanduser(self.path)).exists():
            raise FieldError("path", f"'{self.path}' does not exist; give a JSONL or Parquet file or a save_to_disk "
                                     "directory")

    @property
    def label(self) -> str:
        """The set's name: `name`, or its file's name without suffix."""
        if self.name:
            return self.name
        stem = Path(self.path.rstrip("/")).name
        return stem.split(".")[0] or "eval"

    def resolve(self, base: Path) -> None:
        """path, when relative and found beside the recipe file (`base`), made absolute."""
        if self.path and not os.path.isabs(os.path.expanduser(self.path)) and (base / self.path).exists():
            self.path = str(base / self.path)
        if self.reward is not None:
            self.reward.resolve(base)


@dataclass(kw_only=True)
class EvalConfig(Section):
    """When the sets are evaluated. sync and rolloutpipe evaluate between steps, after the step's
    weight broadcast and before the next step opens a group, so every sample of an evaluation
    comes from one weight version. async evaluates right after its broadcast, with rollout
    paused (no new request is admitted) until the evaluation ends: one version too."""

    sets: list[EvalSet] = field(default_factory=list)
    """The held-out sets (none: no evaluation)."""
    every: int = 0
    """Evaluate after every this many steps (0 = only before and at the end)."""
    before: bool = True
    """Evaluate the starting weights before the first step (not again on a resumed run)."""
    at_end: bool = True
    """Evaluate after the last step (once, if `every` already lands there)."""
    correct_at: float = 1.0
    """A response counts as correct (pass@k) when its reward is at least this."""

    def check(self) -> None:
        within("every", self.every, 0, 10_000_000)
        within("correct_at", self.correct_at, 0.0, 1.0)
        labels = [s.label for s in self.sets]
        for i, label in enumerate(labels):
            if label in labels[:i]:
                raise FieldError(f"sets[{i}].name", f"two sets are named '{label}'; give each set its own name")
