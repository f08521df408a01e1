"""The data of SGLang's /generate exchange, free of any HTTP library (simulations use it too)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# First SGLang release that refuses weight updates outside begin/end_weight_update.
UPDATE_SESSION_SINCE = (0, 5, 21)

# Liveness. SGLang's /health and /health_generate are one handler (http_server.py
# health_generate, every supported release): a one-token generation, healthy once anything comes
# back from the scheduler, 503 after SGLANG_HEALTH_CHECK_TIMEOUT seconds (20) otherwise. A paused
# server generates nothing, so it answers 503 however alive it is. With
# SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION false, /health alone answers 200 at once while the
# server is up, and /health_generate keeps the generation: rlctl starts its SGLang servers so and
# asks /health_generate while they generate, /health while they are paused.
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
HEALTH_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
HEALTH_TIMEOUT_S = 20


@dataclass
class GenerateOutput:
    rid: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    text: str | None = None


@dataclass
class SamplingRequest:
    """What the controller asks of one sample; to_json() is SGLang's `sampling_params`."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }


def weight_version_number(stamp: str) -> int:
    """The run's weight version a sample was generated with, from the server's stamp.

    SGLang stamps meta_info.weight_version with a string: the version of its last update
    (rlctl sends the step number as text), or its --weight-version argument ("default") until
    the first update. rlctl syncs every server before step 0, so a stamp that is not a number
    means a server generated with weights the run never sent: an error, not a version."""
    text = str(stamp).strip()
    if not text.isdigit():
        raise ValueError(f"weight version {stamp!r} is not one the run set; the server has not received "
                         "the run's weights (rlctl syncs every server before step 0)")
    return int(text)


def parse_version(text: str) -> tuple[int, ...] | None:
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", text.strip())
    return tuple(int(x) for x in m.groups()) if m else None
