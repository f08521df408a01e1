"""What the GPU check scripts share: the results and their report lines, the small models they
build, the samples they train on, the engines under test, and running a list of checks."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlctl.engines.train.base import TrainSample  # noqa: E402
from rlctl.process.topology import free_ports  # noqa: E402
from rlctl.recipe import MegatronConfig, TrainConfig  # noqa: E402
from artifact import slug, write_artifact  # noqa: E402

RESULTS: dict[str, dict] = {}
TWO_LAYERS = dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)


def report(name: str, ok: bool | None, **numbers) -> None:
    RESULTS[name] = {"ok": ok, **numbers}
    verdict = "PASS" if ok else "FAIL" if ok is not None else "INFO"
    print(f"{verdict} {name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in numbers.items()), flush=True)


def free_port() -> int:
    return free_ports(1)[0]


def build_model(path: Path, dtype: torch.dtype, arch: str = "qwen3", **shape) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**shape)).to(dtype)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that a dropped one shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def samples(vocab: int, n: int = 12, seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(4, 17, (1,), generator=g))
        r = int(torch.randint(5, 41, (1,), generator=g))
        ids = torch.randint(1, vocab, (p + r,), generator=g).tolist()
        out.append(TrainSample(ids[:p], ids[p:], advantage=float(torch.randn(1, generator=g)), logprobs=[0.0] * r,
                               weight_version=0))
    return out


def megatron_engine(model_dir: Path, dtype: str, lr: float = 1e-5, algo=None, **megatron):
    """A Megatron engine on cuda:0; `megatron`: further train.megatron keys (attention, recompute_*)."""
    from megatron.core import parallel_state

    from rlctl.engines.train.megatron_engine import MegatronTrainEngine

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    cfg = TrainConfig(lr=lr, grad_clip=1.0, micro_batch_tokens=4096, megatron=MegatronConfig(dtype=dtype, **megatron))
    port = free_port()
    return MegatronTrainEngine(str(model_dir), cfg, 1.0, 0, 1, device="cuda:0", init_method=f"tcp://127.0.0.1:{port}", algo=algo)


def torch_engine(model_dir: Path, lr: float = 1e-5, algo=None):
    from rlctl.engines.train.torch_engine import TorchTrainEngine

    cfg = TrainConfig(lr=lr, grad_clip=1.0, micro_batch_tokens=4096)
    return TorchTrainEngine(str(model_dir), cfg, 1.0, 0, 1, device="cuda:0", algo=algo)


def run_checks(steps: dict, names: list[str], out_file: Path, artifact: str | None = None) -> None:
    """Run the named checks (a crash is a failed check that hides no other), write RESULTS to out_file and to
    results/ (as `artifact`, else as out_file's name plus the checks' names unless all ran); exit 1 if one failed."""
    for name in names:
        try:
            steps[name]()
        except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
            traceback.print_exc()
            report(f"{name} (crashed)", False, error=f"{type(e).__name__}: {e}"[:300])
    out_file.write_text(json.dumps(RESULTS, indent=2))
    name = artifact or out_file.stem + ("" if set(names) == set(steps) else "-" + slug("-".join(names)))
    write_artifact(name, {"only": names, "checks": RESULTS})
    sys.exit(0 if all(r["ok"] is not False for r in RESULTS.values()) else 1)
