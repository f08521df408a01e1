"""What a run has learned about how long its responses are, for length-aware admission.

Before a request goes out, nothing says how long its response will be; what a run has seen does.
In RLVR a prompt's samples are alike in length (a hard problem gets long answers), and datasets
are read for several epochs, so the lengths a prompt's samples had before predict its next ones.
`LengthModel` keeps, per prompt, the lengths of its finished samples, and the run's mean length
over every sample so far. `expected_tokens(prompt)` is the prompt's mean length shrunk toward the
run's mean by how few samples it rests on (a prompt never seen: the run's mean).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

PRIOR_SAMPLES = 1.0
"""A prompt's mean rests on its samples plus this many samples of the run's mean."""
MAX_PROMPTS = 1 << 20
"""Prompts remembered (the oldest forgotten first): a dataset's worth, bounded in a long run of a
generated task, whose prompts never come back."""


class LengthModel:
    def __init__(self, max_prompts: int = MAX_PROMPTS) -> None:
        self.max_prompts = max_prompts
        self._prompts: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()
        """prompt -> (its samples' tokens, how many samples), the least recently seen first."""
        self._samples = 0
        self._tokens = 0

    def finished(self, prompt: Hashable, tokens: int) -> None:
        """A sample of `prompt` finished with `tokens` tokens."""
        total, n = self._prompts.pop(prompt, (0, 0))
        self._prompts[prompt] = (total + tokens, n + 1)
        if len(self._prompts) > self.max_prompts:
            self._prompts.popitem(last=False)
        self._samples += 1
        self._tokens += tokens

    @property
    def mean_tokens(self) -> float:
        return self._tokens / self._samples if self._samples else 0.0

    def expected_tokens(self, prompt: Hashable) -> float:
        total, n = self._prompts.get(prompt, (0, 0))
        return (total + PRIOR_SAMPLES * self.mean_tokens) / (n + PRIOR_SAMPLES)
