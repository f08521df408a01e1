"""The data a launch is about to use, read and checked before anything starts: a malformed row
(rlctl/data/prompts.py lists the kinds) or a row without a field the reward function asks for is
one line naming the file, the row and the fix, and exit 2."""

from __future__ import annotations

import inspect
from pathlib import Path

from rlctl.data.prompts import Prompt
from rlctl.data.rows import DataError
from rlctl.data.stream import read_prompts
from rlctl.recipe import DataSource, Recipe, Verifier
from rlctl.recipe.reward_call import RewardCall


def check_data(recipe: Recipe) -> list[Prompt]:
    """Every prompt of the recipe's data file, checked (none for a built-in task, or a file that
    is not on this machine: a cluster's job reads it on its first node)."""
    data = recipe.data
    if data.source is DataSource.TASK or not Path(data.path or "").expanduser().exists():
        return []
    prompts = read_prompts(data)
    if recipe.reward.verifier is Verifier.FUNCTION:
        call = RewardCall.of(inspect.signature(recipe.reward.load_function()))
        for n, prompt in enumerate(prompts, 1):
            missing = [name for name in call.required_fields if name not in prompt.fields]
            if missing:
                raise DataError(f"{data.path}: row {n} has no field '{missing[0]}', which reward.function "
                                f"{recipe.reward.function} takes; give every row that field or the parameter a default")
    return prompts
