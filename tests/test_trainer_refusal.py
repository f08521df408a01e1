"""What the controller says when the trainer refuses a call (rlctl/engines/train/client.py)."""

from __future__ import annotations

import json

from rlctl.engines.train.client import refusal


def test_a_refusal_is_the_trainers_message_and_keeps_its_fix_past_a_deep_path():
    path = "/scratch/" + "nested/" * 40 + "run/checkpoints/step-000002/trainer/rng-rank-0.pt"
    message = (f"{path}: an RNG state pickled by an earlier rlctl, which is not loaded (a pickle can run code); "
               "start a new run from this checkpoint's policy with model.path=DIR/hf")
    said = refusal(json.dumps({"success": False, "message": message}))
    assert said.startswith("/scratch/nested/") and "rng-rank-0.pt: an RNG state" in said
    assert said.endswith("with model.path=DIR/hf") and "success" not in said and len(said) <= 400


def test_a_refusal_that_is_not_the_trainers_json_is_shown_as_text_on_one_line():
    assert refusal("500 Internal Server Error\n\nServer got itself in trouble") == \
        "500 Internal Server Error Server got itself in trouble"
    assert refusal('["a list"]') == '["a list"]'
