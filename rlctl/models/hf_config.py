"""A Hugging Face model directory's config.json, read without importing transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_config(model_path: str | Path) -> dict[str, Any] | None:
    """The directory's config.json, or None when it cannot be read."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def declared_dtype(config: dict[str, Any] | None) -> str:
    """The dtype the config says the weights are stored in ("float32", "bfloat16", ...):
    `dtype`, or the older `torch_dtype`; float32 when it says none."""
    config = config or {}
    return str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
