"""A run's trajectories (rollout.multi_turn) wired to its model: the environment, the tool-call
parser, the turn format of the model's chat template, and the tool workers."""

from __future__ import annotations

from typing import Any

from rlctl.agents.builtin import environment_factory
from rlctl.agents.calls import PARSERS
from rlctl.agents.tools import ToolRunner
from rlctl.agents.turns import PlainTurns, TemplateTurns
from rlctl.data.chat import PromptRenderer
from rlctl.errors import RunError
from rlctl.pipelines.episode import MultiTurn, TurnFormat, parsed_calls
from rlctl.recipe import FieldError, MultiTurnConfig


def make_multi_turn(cfg: MultiTurnConfig, renderer: PromptRenderer) -> MultiTurn | None:
    """The run's MultiTurn, calling tools through a ToolRunner; None when rollout.multi_turn is
    off. The environment's tools go into the renderer's template, so the prompts show them."""
    if not cfg.enabled:
        return None
    try:
        factory = environment_factory(cfg)
    except FieldError as e:
        raise RunError(f"rollout.multi_turn.{e.key}: {e.message}") from None
    tools = list(getattr(make_env_once(factory), "tools", None) or [])
    tokenizer = renderer.tokenizer
    turns: TurnFormat
    if renderer.template is None:
        turns = PlainTurns(tokenizer)
    else:
        if tools:
            renderer.kwargs["tools"] = tools
        turns = TemplateTurns(tokenizer, renderer.template, renderer.kwargs)
    runner = ToolRunner(cfg.tool_workers, cfg.tool_timeout_s, cfg.max_tool_output_chars)
    detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731 - tags may be special tokens
    return MultiTurn(factory, parsed_calls(PARSERS[cfg.tool_parser], detokenize), turns, runner, detokenize,
                     max_turns=cfg.max_turns, max_tokens=cfg.max_tokens)


def make_env_once(factory: Any) -> Any:
    """One environment, made to read its tools (RunError saying why when it cannot be made)."""
    try:
        return factory()
    except Exception as e:  # noqa: BLE001 - the user's class may raise anything
        raise RunError(f"rollout.multi_turn.environment: making one raised {type(e).__name__}: {e}; fix it") from None
