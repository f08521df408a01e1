"""The eval section: held-out prompt sets the run evaluates on its rollout servers, at the
weights of the moment, before training, every N steps and at the end (rlctl/control/evaluation.py
runs them; rlctl/pipelines/evaluation.py generates and scores)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlctl.recipe.checks import Section, at_most, positive, within
from rlctl.recipe.data import DatasetFile, unique_labels
from rlctl.recipe.inputs import RewardConfig

MAX_EVAL_SAMPLES = 1024
"""eval.sets[].samples at most: k of pass@k."""


@dataclass(kw_only=True)
class EvalSet(DatasetFile):
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

    fallback_label = "eval"

    def check(self) -> None:
        self.check_path_and_name("set")
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
        unique_labels("sets", self.sets, "sets")
