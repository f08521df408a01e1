"""Values on their way into a run's batch script (script.py): refused when they would break its
lines, and written so that sbatch reads each back whole."""

from __future__ import annotations

import re
from pathlib import Path

from rlctl.errors import UsageError
from rlctl.recipe import Recipe
from rlctl.recipe.checks import clip, control_character

_PLAIN = re.compile(r"[A-Za-z0-9_./%+,:=@-]*")


def sbatch_value(value: str) -> str:
    """A value as an #SBATCH line reads it back whole: as it is when plain, else in double quotes
    with every backslash and double quote escaped (sbatch splits a directive's words at
    whitespace, groups them by quotes, takes a backslash as an escape and an unquoted # as the
    start of a comment)."""
    if _PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def refuse_control_characters(recipe: Recipe, run_dir: Path, run_id: str, python: str) -> None:
    """UsageError naming the first value bound for the batch script that holds a control character
    (a newline would start a line of its own there, above or among the #SBATCH lines). The recipe's
    checks refuse them first (rlctl/recipe/checks.py, check_text); this is the script's own guard,
    for the values that do not come from a recipe (the run directory's path, the interpreter)."""
    sl = recipe.slurm
    values = [
        ("run directory", str(run_dir)),
        ("run id", run_id),
        ("python", python),
        ("slurm.time", sl.time),
        ("slurm.partition", sl.partition),
        ("slurm.account", sl.account),
        ("slurm.qos", sl.qos),
        ("slurm.python", sl.python),
        ("slurm.trainer.mem", sl.trainer.mem),
        ("slurm.rollout.mem", sl.rollout.mem),
        *((f"slurm.sbatch_args[{i}]", a) for i, a in enumerate(sl.sbatch_args)),
        *((f"slurm.setup[{i}]", line) for i, line in enumerate(sl.setup)),
        *((f"slurm.env.{k}", f"{k}={v}") for k, v in sl.env.items()),
    ]
    for key, value in values:
        bad = control_character(value)
        if bad is not None:
            raise UsageError(
                f"{key}: '{clip(value)}' holds a control character ({bad}); the batch script takes it on one line"
            )
    if "\\" in str(run_dir):
        raise UsageError(
            f"run directory: '{clip(str(run_dir))}' holds a backslash, which turns off Slurm's "
            "%j in --output; use a directory without one"
        )
