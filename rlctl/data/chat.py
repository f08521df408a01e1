"""A prompt as the token ids a rollout server is given: through the tokenizer's chat template, as
an instruct model was trained to read it, or as plain text.

data.chat_template (rlctl/recipe/data.py):
- `auto`: the tokenizer's own template when it has one, plain text when it has none;
- `none`: plain text (a string prompt only: chat messages need a template);
- a file: that Jinja template, in place of the tokenizer's.
With a template, a string prompt is one user message, data.system_prompt goes first in every
prompt without a system message of its own, and the generation prompt is added (the template's
`add_generation_prompt`), so the model's response starts where the servers start generating.
The template's text is tokenized without the tokenizer's special tokens (the template writes its
own), as `apply_chat_template(..., tokenize=True)` does. Plain text is tokenized as the
tokenizer does by default (the tiny model's tokenizer puts BOS first).
"""

from __future__ import annotations

from typing import Any

from rlctl.data.prompts import Prompt
from rlctl.data.rows import DataError
from rlctl.recipe import DataConfig
from rlctl.recipe.data import CHAT_TEMPLATE_AUTO, CHAT_TEMPLATE_NONE


class PromptRenderer:
    """prompt -> token ids, by the recipe's data section and the model's tokenizer."""

    def __init__(self, tokenizer: Any, cfg: DataConfig) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = cfg.system_prompt
        self.kwargs = dict(cfg.chat_template_kwargs)
        if cfg.chat_template == CHAT_TEMPLATE_NONE:
            self.template: str | None = None
        elif cfg.chat_template == CHAT_TEMPLATE_AUTO:
            self.template = getattr(tokenizer, "chat_template", None) or None
        else:
            self.template = cfg.template_file().read_text(encoding="utf-8")
        if self.template is None and self.system_prompt is not None:
            raise DataError("data.system_prompt: the model's tokenizer has no chat template to put it in; give "
                            "data.chat_template a template file or remove the system prompt")

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The chat the template is given: the prompt's messages (a string: one user message),
        the system prompt first where the prompt has none."""
        messages = [{"role": "user", "content": prompt.prompt}] if isinstance(prompt.prompt, str) else list(prompt.prompt)
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def text(self, prompt: Prompt) -> str:
        """The prompt as the model reads it, before tokenizing."""
        if self.template is None:
            if not isinstance(prompt.prompt, str):
                raise DataError("data: the prompts are chat messages and the model's tokenizer has no chat template; "
                                "give data.chat_template a template file, or plain string prompts")
            return prompt.prompt
        return self.tokenizer.apply_chat_template(self.messages(prompt), chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True, **self.kwargs)

    def ids(self, prompt: Prompt) -> list[int]:
        text = self.text(prompt)
        if self.template is None:
            return list(self.tokenizer(text)["input_ids"])
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def response_text(self, ids: list[int]) -> str:
        """A response as its verifier reads it: decoded, the special tokens (end of turn) skipped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)
