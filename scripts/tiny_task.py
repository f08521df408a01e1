"""A stand-in for your own model and data, built here with nothing downloaded: what
docs/your-own-task.md's walkthrough runs on a machine without a GPU (and the GPU check on one
where no weights can be fetched).

    python scripts/tiny_task.py [--out DIR] [--shape tiny|qwen3-0.6b] [--format parquet|jsonl]

writes, under DIR (default: the current directory):
- models/tiny-qwen3/ (or models/qwen3-0.6b-random/): a Qwen3-architecture causal LM with random
  weights, and a byte-level BPE tokenizer trained on the problems below, with ChatML special
  tokens and a chat template (as Qwen's: <|im_start|>role ... <|im_end|>, the generation prompt
  opening the assistant's turn). `tiny`: hidden 64, 2 layers; `qwen3-0.6b`: Qwen3-0.6B's shape
  (hidden 1024, 28 layers, 16 heads, 8 KV heads, FFN 3072) with this tokenizer's vocabulary;
- data/gsm8k/train.parquet (1,000 rows) and data/gsm8k/test.parquet (200 rows) in the layout
  verl's examples/data_preprocess/gsm8k.py writes: data_source, prompt as chat messages ending
  with GSM8K's "Let's think step by step and output the final answer after \"####\".",
  reward_model.ground_truth, extra_info. The problems are one- and two-step word problems on
  small numbers. --format jsonl writes the same rows as train.jsonl and test.jsonl (a machine
  without pyarrow).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana"]
THINGS = ["apples", "books", "coins", "marbles", "pencils", "stamps"]
SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072),
}


def problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, answer, worked solution ending in '#### answer')."""
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 5)
    kind = rng.randrange(3)
    if kind == 0:
        q, ans, work = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have?", a + b, f"{a}+{b}={a + b}"
    elif kind == 1:
        a = a + b
        q, ans, work = f"{who} has {a} {what} and gives away {b}. How many {what} are left?", a - b, f"{a}-{b}={a - b}"
    else:
        q, ans, work = (f"{who} buys {c} boxes of {a} {what} and {b} loose {what}. How many {what} is that?",
                        c * a + b, f"{c}*{a}={c * a}, {c * a}+{b}={c * a + b}")
    return q, ans, f"{work}\n#### {ans}"


def verl_rows(rng: random.Random, n: int, split: str) -> list[dict]:
    rows = []
    for i in range(n):
        q, ans, solution = problem(rng)
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(ans)},
                     "extra_info": {"split": split, "index": i, "answer": solution, "question": q}})
    return rows


def tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML)


def write_model(out: Path, shape: str, tok, seed: int) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
                         rope_theta=1000000.0, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tok.pad_token_id, bos_token_id=None, **SHAPES[shape])
    path = out / "models" / ("tiny-qwen3" if shape == "tiny" else f"{shape}-random")
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    train, test = verl_rows(rng, 1000, "train"), verl_rows(rng, 200, "test")
    data = args.out / "data" / "gsm8k"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        if args.format == "jsonl":
            (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            continue
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), data / f"{name}.parquet")
    texts = [f"<|im_start|>user\n{r['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
             f"{r['extra_info']['answer']}<|im_end|>" for r in train]
    model = write_model(args.out, args.shape, tokenizer(texts), args.seed)
    print(f"model: {model}\ndata: {data / ('train.' + args.format)} ({len(train)} rows), "
          f"{data / ('test.' + args.format)} ({len(test)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
