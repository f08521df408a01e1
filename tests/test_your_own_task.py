"""docs/your-own-task.md's CPU walkthrough, run as written: the shipped one-GPU recipe on a
test-sized Qwen3-architecture model with a byte-level BPE tokenizer and a chat template, and
GSM8K-style data in verl's layout, all built by scripts/tiny_task.py (nothing downloaded). Then
what each step is said to show is checked in the run directories it left."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from rlctl.recipe import load_recipe
from rlctl.run.dir import RunDir

DOC = REPO / "docs" / "your-own-task.md"


def walkthrough() -> str:
    """The bash block after the page's `walkthrough: cpu` marker."""
    text = DOC.read_text()
    found = re.search(r"<!-- walkthrough: cpu .*?-->\n```bash\n(.*?)```", text, re.S)
    assert found, "docs/your-own-task.md no longer has its CPU walkthrough block"
    return found[1]


def test_the_shipped_recipe_is_the_one_the_page_runs():
    recipe = load_recipe(REPO / "recipes" / "one-gpu-gsm8k.yaml", check_paths=False)
    assert (recipe.reward.verifier, recipe.data.chat_template, recipe.rollout.device) == ("math", "auto", "cuda")
    assert recipe.eval.sets[0].path == "data/gsm8k/test.parquet" and recipe.data.path == "data/gsm8k/train.parquet"
    assert "../recipes/one-gpu-gsm8k.yaml" in walkthrough()


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_cpu_walkthrough_runs_as_written(tmp_path):
    # The page runs from the checkout: the same relative paths here, and `rlctl` and `python` on PATH.
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "rlctl").write_text(f"#!/bin/sh\nexec {sys.executable} -m rlctl \"$@\"\n")
    (bin_dir / "rlctl").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-e", "-c", walkthrough()], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=840)
    assert res.returncode == 0, res.stderr[-3000:]
    here = tmp_path / "try"
    runs = sorted((here / "runs").iterdir())
    (train,) = [RunDir(p) for p in runs if p.name.startswith("gsm8k-")]
    (evaluated,) = [RunDir(p) for p in runs if p.name.startswith("eval-gsm8k-")]
    # the chat template applied: every sample's prompt is as long as apply_chat_template makes it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(here / "models" / "tiny-qwen3")
    samples = [json.loads(line) for line in train.samples_path.read_text().splitlines()]
    assert samples and "  response:" in res.stdout and "reward" in res.stdout
    for s in samples[:8]:
        ids = tok.apply_chat_template(s["prompt"], add_generation_prompt=True, tokenize=True, enable_thinking=False)
        assert s["prompt_tokens"] == len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    # eval before, during and after training; status shows it; the export loads; rlctl eval ran
    assert [(e["set"], e["steps"]) for e in train.evals()] == [("gsm8k-test", 0), ("gsm8k-test", 2), ("gsm8k-test", 4)]
    assert "eval gsm8k-test (16 prompts x 2): mean@2 " in res.stdout
    assert "\nqwen3\n" in res.stdout  # transformers loaded the exported model
    assert (here / "trained" / "tokenizer_config.json").is_file()
    (again,) = evaluated.evals()
    assert (again["steps"], again["prompts"], again["k"]) == (0, 16, 2)
    assert evaluated.read()["model_path"] == str(train.path / "final" / "hf")
