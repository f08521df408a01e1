"""The data section: where a run's prompts come from and how each becomes the tokens a rollout
server is given (rlctl/data/ reads and renders them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlctl.recipe.checks import FieldError, Section, at_most, positive, within
from rlctl.recipe.choices import DataSource, TaskName
from rlctl.recipe.inputs import RewardConfig

CHAT_TEMPLATE_AUTO = "auto"
CHAT_TEMPLATE_NONE = "none"


class DatasetFile(Section):
    """What a section naming one dataset file has (a file of data.sources, an eval set): its
    `path`, a `name` that defaults to the file's, and a `reward` section of its own or None. The
    subclass declares those fields; the checks and the resolving of paths are here."""

    path: str
    name: str
    reward: RewardConfig | None
    fallback_label = "file"

    def check_path_and_name(self, what: str) -> None:
        if not self.path:
            raise FieldError("path", f"name the {what}'s file: a JSONL or Parquet file or a save_to_disk directory")
        if self.name and not self.name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise FieldError("name", f"'{self.name}' is not a usable name; use letters, digits and _.-")

    def check_files(self) -> None:
        if not Path(os.path.expanduser(self.path)).exists():
            raise FieldError("path", f"'{self.path}' does not exist; give a JSONL or Parquet file or a save_to_disk "
                                     "directory")

    @property
    def label(self) -> str:
        """Its name: `name`, or its file's name without suffix."""
        return self.name or Path(self.path.rstrip("/")).name.split(".")[0] or self.fallback_label

    def resolve(self, base: Path) -> None:
        """path, when relative and found beside the recipe file (`base`), made absolute; the same
        for its reward section's module_dir."""
        if self.path and not os.path.isabs(os.path.expanduser(self.path)) and (base / self.path).exists():
            self.path = str(base / self.path)
        if self.reward is not None:
            self.reward.resolve(base)


def unique_labels(key: str, items: list[DatasetFile], what: str) -> None:
    """FieldError at the first item whose label another before it has."""
    labels = [item.label for item in items]
    for i, label in enumerate(labels):
        if label in labels[:i]:
            raise FieldError(f"{key}[{i}].name", f"two {what} are named '{label}'; give each its own name")


@dataclass(kw_only=True)
class MixedSource(DatasetFile):
    """One file of a mix (data.sources): its rows, its share of the prompts, its verifier."""

    path: str = ""
    """A JSONL or Parquet file or a save_to_disk directory, read as data.path is."""
    weight: float = 1.0
    """Its share of the prompts: each prompt comes from this source with probability weight / the
    sum of the weights (3 and 1: three prompts of the first to one of the second, on average)."""
    name: str = ""
    """Its name in the metrics (reward_mean/NAME, samples.jsonl's source); default: the file's
    name without suffix. Its rows' own data_source stays a field the reward function can take."""
    prompt_key: str | None = None
    """The field that holds the prompt (unset: data.prompt_key)."""
    answer_key: str | None = None
    """The field that holds the answer (unset: data.answer_key)."""
    reward: RewardConfig | None = None
    """Its verifier, a reward section of its own (unset: the run's reward section)."""

    fallback_label = "source"

    def check(self) -> None:
        self.check_path_and_name("source")
        within("weight", self.weight, 0.0, 1e9, open_low=True)


@dataclass(kw_only=True)
class DataConfig(Section):
    source: DataSource = DataSource.TASK
    """`task` (a built-in verifiable task generator) or `file` (rows of a dataset file: `path`).
    `jsonl` is the older name of `file`."""
    task: TaskName = TaskName.MAX_DIGIT
    """Built-in task: `max-digit`, `add`, or `calc` (multi-turn: the model calls a calculator; needs
    rollout.multi_turn with the calculator environment) (rlctl/rewards/tasks.py)."""
    path: str | None = None
    """source=file: a JSONL file (.jsonl), a Parquet file (.parquet, e.g. verl's layout) or a
    directory written by Hugging Face datasets' `save_to_disk` (one split)."""
    sources: list[MixedSource] = field(default_factory=list)
    """source=file, in place of `path`: several files mixed by weight, each with its own verifier
    and metrics (reward_mean/NAME); each file's rows are reshuffled every epoch of its own."""
    prompt_key: str = "prompt"
    """The field of each row that holds the prompt: a string, or a list of chat messages
    ({role, content}). A row without it that has `messages` uses those."""
    answer_key: str = "answer"
    """The field that holds the reference answer the verifier checks against; a dotted path
    reaches into a nested field (`reward_model.ground_truth`). A row without `answer` that has
    verl's `reward_model.ground_truth` uses that."""
    max_prompt_tokens: int | None = None
    """Rows whose prompt, as the rollout servers get it (chat template applied), is longer are
    left out when the run starts; the controller's log and the `data_loaded` event say how many."""
    chat_template: str = CHAT_TEMPLATE_AUTO
    """How a prompt becomes tokens. `auto`: the tokenizer's chat template when it has one (with
    the generation prompt added), the prompt's text as it is otherwise; `none`: the text as it is
    (a string prompt only); a path to a Jinja template file: that template."""
    system_prompt: str | None = None
    """A system message put before the prompt of every row that has none of its own (needs a chat
    template)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the template, e.g. {enable_thinking: false} for Qwen3's."""

    def check(self) -> None:
        if self.sources and (self.source is DataSource.TASK or self.path):
            raise FieldError("sources", "a mix of files is data.source=file without data.path; set source: file and "
                                        "remove path")
        if self.source is not DataSource.TASK and not self.path and not self.sources:
            raise FieldError("path", f"data.source={self.source} needs data.path, a JSONL or Parquet file or a "
                                     "save_to_disk directory (or data.sources, several)")
        unique_labels("sources", self.sources, "sources")
        if self.max_prompt_tokens is not None:
            positive("max_prompt_tokens", self.max_prompt_tokens)
            at_most("max_prompt_tokens", self.max_prompt_tokens, 1 << 20)
        if self.system_prompt is not None and self.chat_template == CHAT_TEMPLATE_NONE:
            raise FieldError("system_prompt", "needs a chat template; remove it or set data.chat_template to auto "
                                              "or a template file")
        for key in (self.prompt_key, self.answer_key):
            if not key or any(not part for part in key.split(".")):
                raise FieldError("prompt_key" if key == self.prompt_key else "answer_key",
                                 f"'{key}' is not a field name (a dotted path like reward_model.ground_truth)")

    def check_files(self) -> None:
        if self.source is not DataSource.TASK and not self.sources and not Path(os.path.expanduser(self.path or "")).exists():
            raise FieldError("path", f"'{self.path}' does not exist; give a JSONL or Parquet file or a save_to_disk "
                                     "directory")
        if self.chat_template not in (CHAT_TEMPLATE_AUTO, CHAT_TEMPLATE_NONE) and not self.template_file().is_file():
            raise FieldError("chat_template", f"'{self.chat_template}' is neither auto, none nor a template file; "
                                              "give one of those")

    def template_file(self) -> Path:
        return Path(os.path.expanduser(self.chat_template))

    def resolve(self, base: Path) -> None:
        """path and a template file, when relative and found beside the recipe file (`base`), made
        absolute: paths in a recipe are relative to it, as users expect of config files."""
        if self.path and not os.path.isabs(os.path.expanduser(self.path)) and (base / self.path).exists():
            self.path = str(base / self.path)
        for source in self.sources:
            source.resolve(base)
        template = self.chat_template
        if template not in (CHAT_TEMPLATE_AUTO, CHAT_TEMPLATE_NONE) and not os.path.isabs(os.path.expanduser(template)) \
                and (base / template).exists():
            self.chat_template = str(base / template)
