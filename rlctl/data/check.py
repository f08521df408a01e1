"""The data a launch is about to use, read and checked before anything starts: a malformed row
(rlctl/data/prompts.py lists the kinds) or a row without a field the reward function asks for is
one line naming the file, the row and the fix, and exit 2."""

from __future__ import annotations

import inspect
from pathlib import Path

from rlctl.data.prompts import Prompt
from rlctl.data.rows import DataError
from rlctl.data.stream import read_prompts, read_source
from rlctl.recipe import DataSource, Recipe, RewardConfig, Verifier
from rlctl.recipe.reward_call import RewardCall


def check_data(recipe: Recipe) -> list[Prompt]:
    """Every prompt of the recipe's data files, checked (none for a built-in task, or a file that
    is not on this machine: a cluster's job reads it on its first node)."""
    data = recipe.data
    if data.source is DataSource.TASK:
        return []
    here = lambda path: Path(path or "").expanduser().exists()  # noqa: E731
    if data.sources:
        files = [(s.path, read_source(data, s), s.reward or recipe.reward, f"data.sources[{i}].reward" if s.reward
                  else "reward") for i, s in enumerate(data.sources) if here(s.path)]
    else:
        files = [(data.path, read_prompts(data), recipe.reward, "reward")] if here(data.path) else []
    for path, prompts, reward, key in files:
        check_reward_fields(path or "", prompts, reward, key)
    return [p for _, prompts, _, _ in files for p in prompts]


def check_reward_fields(path: str, prompts: list[Prompt], reward: RewardConfig, key: str) -> None:
    """Every row has the fields the reward function takes without a default."""
    if reward.verifier is not Verifier.FUNCTION:
        return
    call = RewardCall.of(inspect.signature(reward.load_function()))
    for n, prompt in enumerate(prompts, 1):
        missing = [name for name in call.required_fields if name not in prompt.fields]
        if missing:
            raise DataError(f"{path}: row {n} has no field '{missing[0]}', which {key}.function "
                            f"{reward.function} takes; give every row that field or the parameter a default")
