"""How a turn of the environment (the tools' results) becomes the tokens the model reads next.

With a chat template (an instruct model's), the results are `tool` messages and the template says
how they are written: the tokens are the template's rendering of a conversation with them, from
the end of the model's own turn to the start of its next one (`<|im_end|>`... `<|im_start|>
assistant`). A dummy conversation is rendered with and without the tool messages; the text after
the model's turn in it (less the end-of-turn token, which the model wrote itself) is the
environment's turn. Without a template (the tiny model's plain text), each result is written as
Hermes writes it, `<tool_response>...</tool_response>`, right after the model's turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_MARK = "RLCTL-TURN-MARK"


class PlainTurns:
    """A template-less model: `<tool_response>result</tool_response>` per result."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, results: Sequence[str]) -> str:
        return "".join(f"{RESPONSE_OPEN}{r}{RESPONSE_CLOSE}" for r in results)

    def ids(self, results: Sequence[str]) -> list[int]:
        return list(self.tokenizer(self.text(results), add_special_tokens=False)["input_ids"])


class TemplateTurns:
    """A chat template's own tool messages, between the model's turn and its next one."""

    def __init__(self, tokenizer: Any, template: str, kwargs: dict[str, Any]) -> None:
        """kwargs: the template's own, as the prompts are rendered with (the tools among them)."""
        self.tokenizer = tokenizer
        self.render: Callable[..., str] = lambda messages, **kw: tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, **kwargs, **kw)
        eos = tokenizer.eos_token or ""
        base = self.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}])
        after = base[base.index(_MARK) + len(_MARK):]
        self.model_wrote = eos if eos and after.startswith(eos) else ""
        """The end-of-turn text the template puts after the model's turn, which the model wrote
        itself (its stop token): left out of the environment's turn."""

    def text(self, results: Sequence[str]) -> str:
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK},
                    *({"role": "tool", "content": r} for r in results)]
        full = self.render(messages, add_generation_prompt=True)
        turn = full[full.index(_MARK) + len(_MARK):]
        return turn[len(self.model_wrote):] if turn.startswith(self.model_wrote) else turn

    def ids(self, results: Sequence[str]) -> list[int]:
        return list(self.tokenizer(self.text(results), add_special_tokens=False)["input_ids"])
