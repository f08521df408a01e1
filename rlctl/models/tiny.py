"""The tiny model rlctl builds itself: a Qwen3-architecture causal LM with a character tokenizer.

It is saved as an ordinary Hugging Face directory (config.json, model.safetensors,
tokenizer.json), so everything downstream loads it exactly as it would load any local model.
A short supervised warm-up on the run's task, with a configurable share of wrong answers,
teaches the answer format and leaves the model right only part of the time: the "base model"
that RL then improves.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlctl.recipe import ModelInit

if TYPE_CHECKING:
    import torch
    from transformers import Qwen3Config

    from rlctl.rewards.tasks import Task

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# Printable ASCII: any prompt a user writes in a JSONL file can be encoded.
ALPHABET = "".join(chr(c) for c in range(32, 127))


def cache_root() -> Path:
    return Path(os.environ.get("RLCTL_CACHE", Path.home() / ".cache" / "rlctl")) / "models"


def model_key(init: ModelInit, task: str) -> str:
    blob = json.dumps({"init": asdict(init), "task": task, "format": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for ch in ALPHABET:
        vocab[ch] = len(vocab)
    # BPE without merges over an unsplit string is exactly a character tokenizer.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def build_tiny_model(init: ModelInit, task_name: str, out_dir: Path, log: Callable[[str], Any] = print) -> Path:
    """Create, warm up and save the tiny model into out_dir (written atomically)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(init.seed)
    tokenizer = build_tokenizer()
    model = Qwen3ForCausalLM(qwen3_config(init, tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    # Warm up on a GPU when there is one (the larger benchmark models); the result is saved on CPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    log(f"tiny model: {n_params:,} parameters, vocab {model.config.vocab_size}")
    warm_up(model, tokenizer, init, task_name, device, log)
    return save_atomically(model.cpu(), tokenizer, out_dir,
                           {"init": asdict(init), "task": task_name, "parameters": n_params})


def qwen3_config(init: ModelInit, tokenizer: Any) -> Qwen3Config:
    """The Qwen3 architecture at the init block's size, with the character tokenizer's ids."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=init.hidden_size,
        intermediate_size=init.intermediate_size,
        num_hidden_layers=init.num_layers,
        num_attention_heads=init.num_heads,
        num_key_value_heads=init.num_kv_heads,
        head_dim=init.head_dim,
        max_position_embeddings=init.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def warm_up(model: torch.nn.Module, tokenizer: Any, init: ModelInit, task_name: str, device: str,
            log: Callable[[str], Any]) -> None:
    """init.warmup_steps supervised steps on the task's prompts, a share of them with wrong answers."""
    import torch

    from rlctl.rewards.tasks import TASKS

    task = TASKS[task_name]
    rng = random.Random(init.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=init.warmup_lr)
    for step in range(init.warmup_steps):
        ids, labels = warmup_batch(task, tokenizer, init, rng)
        loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            log(f"warm-up step {step + 1}/{init.warmup_steps}: loss {loss.item():.3f}")


def warmup_batch(task: Task, tokenizer: Any, init: ModelInit, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt + target ids and their labels; the loss falls on the target only (on a
    multi-turn task's trajectory, on the model's turns only)."""
    import torch

    rows: list[tuple[list[int], list[int]]] = []  # (ids, labels)
    for _ in range(init.warmup_batch_size):
        if task.demonstrate is not None:  # a trajectory: the model's turns are learned, the tools' are read
            prompt, turns = task.demonstrate(rng, rng.random() < init.warmup_correct_prob)
        else:
            prompt, answer = task.sample(rng)
            turns = [(answer if rng.random() < init.warmup_correct_prob else task.random_answer(rng), True)]
        ids = list(tokenizer(prompt)["input_ids"])
        labels = [-100] * len(ids)
        for text, by_model in turns:
            t_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + ([tokenizer.eos_token_id] if by_model else [])
            ids += t_ids
            labels += t_ids if by_model else [-100] * len(t_ids)
        rows.append((ids, labels))
    length = max(len(i) for i, _ in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    labels = torch.full((len(rows), length), -100)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        labels[i, : len(row_labels)] = torch.tensor(row_labels)
    return ids, labels


def save_atomically(model: torch.nn.Module, tokenizer: Any, out_dir: Path, description: dict[str, Any]) -> Path:
    """Write the model directory under a temporary name and rename it into place, so that a run
    never sees a half-written model; description goes to rlctl_model.json."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "rlctl_model.json").write_text(json.dumps(description, indent=2))
    try:
        os.rename(tmp, out_dir)
    except OSError:  # another run built the same model first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _model_dir(init: ModelInit, task_name: str) -> Path:
    return cache_root() / model_key(init, task_name)


def cached_tiny_model(init: ModelInit, task_name: str) -> Path | None:
    """The model directory of this init block if it is built already (no torch needed to say so)."""
    out = _model_dir(init, task_name)
    return out if (out / "config.json").is_file() else None


def ensure_tiny_model(init: ModelInit, task_name: str, log: Callable[[str], Any] = print) -> Path:
    """The cached model directory for this init block, building it if needed."""
    cached = cached_tiny_model(init, task_name)
    if cached is not None:
        log(f"tiny model: cached at {cached}")
        return cached
    return build_tiny_model(init, task_name, _model_dir(init, task_name), log)
