"""How rlctl calls a reward function (reward.verifier=function): which argument goes to which
parameter. The recipe's check reads a function's signature with it before anything starts, and
every scoring process calls the function through it (rlctl/rewards/verifiers.py).

The rule, by parameter name:
- `response`, `solution_str` or `completion`: the response's text;
- `answer` or `ground_truth`: the reference answer (data.answer_key);
- `prompt`: the prompt as the data holds it (a string, or the list of chat messages);
- any other name: the row's field of that name (`data_source`, `extra_info`, any column);
- `**kwargs`: every field of the row not passed by name.
A function that names neither a response nor an answer parameter takes those two as its first
two positional parameters (`def score(r, a)`). So `score(response, answer)`, TRL-style
`score(completion, answer, **kwargs)` and verl's `compute_score(data_source, solution_str,
ground_truth, extra_info=None)` are all called as written.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RESPONSE_NAMES = ("response", "solution_str", "completion")
ANSWER_NAMES = ("answer", "ground_truth")
PROMPT_NAME = "prompt"


@dataclass(frozen=True)
class RewardCall:
    """A reward function's parameters, sorted by what they get."""

    by_position: bool
    """The function names neither a response nor an answer parameter: those two go first, by
    position."""
    leading: tuple[str, ...]
    """by_position: the names of the parameters they go to."""
    response: tuple[str, ...]
    answer: tuple[str, ...]
    prompt: bool
    fields: tuple[str, ...]
    """Parameters filled from the row's field of their name."""
    required_fields: tuple[str, ...]
    """Of `fields`, those without a default: a row must have them."""
    var_kwargs: bool

    @classmethod
    def of(cls, signature: inspect.Signature) -> RewardCall:
        """The call plan of a signature; ValueError (saying why) when no call can fill it."""
        params = list(signature.parameters.values())
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if any(p.kind is p.POSITIONAL_ONLY and p.name in (*RESPONSE_NAMES, *ANSWER_NAMES) for p in params):
            raise ValueError("its positional-only parameters cannot be passed by name; drop the / from its signature")
        response = tuple(p.name for p in named if p.name in RESPONSE_NAMES)
        answer = tuple(p.name for p in named if p.name in ANSWER_NAMES)
        leading: list[inspect.Parameter] = []
        if not response and not answer:
            leading = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
            if len(leading) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
                raise ValueError("it takes neither (response, answer) as its first two parameters nor parameters "
                                 f"named {'/'.join(RESPONSE_NAMES)} and {'/'.join(ANSWER_NAMES)}")
        elif not response or not answer:
            missing = RESPONSE_NAMES if not response else ANSWER_NAMES
            raise ValueError(f"it names no parameter for the {'response' if not response else 'answer'} "
                             f"(call one {' or '.join(missing)})")
        by_position = not response
        rest = [p for p in named if p not in leading]
        if any(p.kind is p.POSITIONAL_ONLY for p in params) and not by_position:
            raise ValueError("its positional-only parameters cannot be passed by name; drop the / from its signature")
        fields = tuple(p.name for p in rest if p.name not in (*RESPONSE_NAMES, *ANSWER_NAMES, PROMPT_NAME))
        required = tuple(p.name for p in rest if p.name in fields and p.default is p.empty)
        return cls(by_position, tuple(p.name for p in leading), response, answer,
                   any(p.name == PROMPT_NAME for p in rest), fields, required, any(p.kind is p.VAR_KEYWORD for p in params))

    def arguments(self, response: str, answer: str, prompt: Any, row: Mapping[str, Any]
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(args, kwargs) for one call. KeyError naming the field when the row lacks a required one."""
        kwargs: dict[str, Any] = {name: response for name in self.response}
        kwargs.update({name: answer for name in self.answer})
        if self.prompt:
            kwargs[PROMPT_NAME] = prompt
        for name in self.fields:
            if name in row:
                kwargs[name] = row[name]
            elif name in self.required_fields:
                raise KeyError(name)
        if self.var_kwargs:
            taken = {*kwargs, *self.leading, *RESPONSE_NAMES, *ANSWER_NAMES, PROMPT_NAME}
            kwargs.update({k: v for k, v in row.items() if k not in taken and k.isidentifier()})
        return ((response, answer) if self.by_position else ()), kwargs
