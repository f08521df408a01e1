"""Built-in verifiable tasks: generators of (prompt, answer) pairs with a known right answer.

They are small enough for a character-level model on a CPU to learn in minutes, and each has a
`random_answer` of the right form, which the tiny model's warm-up uses to learn the answer format
without learning the task itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from collections.abc import Callable

from rlctl.recipe.choices import TaskName

Pair = tuple[str, str]


@dataclass(frozen=True)
class Task:
    name: TaskName
    description: str
    sample: Callable[[random.Random], Pair]
    random_answer: Callable[[random.Random], str]
    alphabet: str
    """Every character a prompt or answer of this task can contain."""


def _max_digit(rng: random.Random) -> Pair:
    digits = [rng.randint(0, 9) for _ in range(3)]
    return "max(" + ",".join(map(str, digits)) + ")=", str(max(digits))


def _add(rng: random.Random) -> Pair:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a}+{b}=", str(a + b)


TASKS: dict[TaskName, Task] = {
    t.name: t
    for t in (
        Task(TaskName.MAX_DIGIT, "the largest of three digits: max(3,9,2)= -> 9", _max_digit,
             lambda rng: str(rng.randint(0, 9)), "0123456789max(),="),
        Task(TaskName.ADD, "the sum of two digits: 3+4= -> 7", _add,
             lambda rng: str(rng.randint(0, 18)), "0123456789+="),
    )
}
