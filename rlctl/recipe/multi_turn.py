"""rollout.multi_turn: samples as trajectories of model turns and tool calls (rlctl/agents/)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.recipe.checks import FieldError, Section, at_most, positive, within
from rlctl.recipe.imports import check_spec, import_object

BUILTIN_ENVIRONMENTS = ("calculator", "python")
TOOL_PARSERS = ("hermes", "qwen3")
MAX_TURNS = 1024
MAX_TOOL_S = 3600.0


@dataclass(kw_only=True)
class MultiTurnConfig(Section):
    """Each sample is a trajectory: the model writes, calls tools in its chat format's tool-call
    syntax, reads their results and goes on, until it answers without a call or a limit ends it.
    Only the model's tokens are trained (the tools' results are masked out of the loss); the
    reward section scores the model's last turn."""

    enabled: bool = False
    """Generate trajectories of turns with tool calls instead of single responses."""
    environment: str = "calculator"
    """What answers the calls: `calculator`, `python` (code run in a bubblewrap sandbox, refused
    where the machine has none), or `module:Class` for your own (rlctl/agents/environments.py
    says what it implements), found on the Python path, then in `module_dir`."""
    module_dir: str | None = None
    """Where `environment`'s module may lie besides the Python path: relative to the recipe file
    (its own directory when unset)."""
    tool_parser: str = "hermes"
    """How a turn's tool calls are read: `hermes` (= `qwen3`): JSON between <tool_call> tags."""
    max_turns: int = 4
    """Model turns per sample at most; the last one's calls go unanswered."""
    max_tokens: int = 512
    """Tokens after the prompt at most, model and tool turns together; each model turn may also
    write at most rollout.sampling.max_new_tokens."""
    tool_timeout_s: float = 10.0
    """Seconds a tool call may run; past them the model reads an error (the python tool's
    sandbox is killed at this limit)."""
    tool_workers: int = 8
    """Tool calls running at once, in worker threads off the controller's event loop."""
    max_tool_output_chars: int = 2048
    """A tool's output is cut to this many characters before the model reads it."""

    def check(self) -> None:
        if self.environment not in BUILTIN_ENVIRONMENTS:
            check_spec("environment", self.environment, "my_env:MyEnv, with my_env.py beside the recipe", "Class")
        elif self.module_dir is not None:
            raise FieldError("module_dir", f"only used with an environment of your own; {self.environment} is built in")
        if self.tool_parser not in TOOL_PARSERS:
            raise FieldError("tool_parser", f"'{self.tool_parser}' is not one of {', '.join(TOOL_PARSERS)}")
        within("max_turns", self.max_turns, 1, MAX_TURNS)
        positive("max_tokens", self.max_tokens)
        at_most("max_tokens", self.max_tokens, 1 << 20)
        within("tool_timeout_s", self.tool_timeout_s, 0.0, MAX_TOOL_S, open_low=True)
        within("tool_workers", self.tool_workers, 1, 1024)
        within("max_tool_output_chars", self.max_tool_output_chars, 1, 1 << 20)

    def check_files(self) -> None:
        """Your own environment is imported before anything starts (a built-in is checked by
        `rlctl launch`: the python tool's sandbox, rlctl/agents/builtin.py)."""
        if self.enabled and self.environment not in BUILTIN_ENVIRONMENTS:
            self.load_environment()

    def resolve(self, base: Path) -> None:
        if self.environment not in BUILTIN_ENVIRONMENTS:
            self.module_dir = os.path.normpath(base / os.path.expanduser(self.module_dir or "."))

    def load_environment(self) -> Any:
        """Your own environment's class (or any callable making one), imported; FieldError naming
        the fix. The built-ins are made by rlctl/agents/builtin.py."""
        factory = import_object("environment", self.environment, self.module_dir, "class")
        if not callable(factory):
            raise FieldError("environment", f"'{self.environment}' is not callable (a {type(factory).__name__}); "
                                            "name a class")
        return factory
