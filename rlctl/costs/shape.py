"""The model a recipe trains, as the cost model sees it (rlctl.costs.model.ModelShape).

`sim.params_b` set: a model of that size, with the widths the `sim:` section gives (the rest
estimated). Otherwise the recipe's own model: the architecture of `model.init` (the model rlctl
builds itself: every width is known) or the config.json at `model.path`, and a 1.7B model when
neither can be read. The weights are counted at the serving dtype:
the built-in server's float32, SGLang's or vLLM's `dtype` (bf16 by default), or bf16 for a model
known only by its parameter count.
"""

from __future__ import annotations

from rlctl.models.hf_config import read_config
from rlctl.recipe import Recipe
from rlctl.engines.rollout.registry import rollout_adapter
from rlctl.costs.model import ModelShape

DEFAULT_PARAMS_B = 1.7
"""The model priced when the recipe's own cannot be read and sim.params_b is 0."""


def serving_bytes(recipe: Recipe) -> float:
    """Bytes a weight takes on the rollout servers, as their engine holds it."""
    return rollout_adapter(recipe.rollout.engine).served_bytes(recipe.rollout)


def init_config(recipe: Recipe) -> dict | None:
    """The config.json rlctl's own model builder writes for `model.init` (rlctl/models/tiny.py)."""
    init = recipe.model.init
    if init is None:
        return None
    from rlctl.models.tiny import ALPHABET

    return {"hidden_size": init.hidden_size, "num_hidden_layers": init.num_layers,
            "num_attention_heads": init.num_heads, "num_key_value_heads": init.num_kv_heads,
            "head_dim": init.head_dim, "intermediate_size": init.intermediate_size,
            "vocab_size": len(ALPHABET) + 3, "tie_word_embeddings": True}


def model_shape(recipe: Recipe) -> ModelShape:
    sim = recipe.sim
    if not sim.params_b:
        config = init_config(recipe) or (read_config(recipe.model.path) if recipe.model.path else None)
        try:
            if config is not None:
                return ModelShape.from_hf_config(config, serving_bytes(recipe))
        except (KeyError, TypeError, ValueError):
            pass  # not a decoder config we can read: priced by its size alone
    return ModelShape.from_params_b(sim.params_b or DEFAULT_PARAMS_B, layers=sim.layers or None,
                                    kv_dim=sim.kv_dim or None, hidden=sim.hidden or None, vocab=sim.vocab or None)
