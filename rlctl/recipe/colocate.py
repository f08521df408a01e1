"""colocate: the rollout servers and the trainer take turns on the same devices."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlctl.recipe.checks import FieldError, Section

SERVER_TAGS = ("kv_cache", "weights", "cuda_graph")
"""What a server can give back (SGLang's GPU_MEMORY_ALL_TYPES; the built-in server's the same)."""
TRAINER_TAGS = ("weights", "optimizer")
"""What a trainer can give back: its parameters, and its optimizer state with the gradients."""


@dataclass(kw_only=True)
class ColocateConfig(Section):
    """Each device hosts a trainer rank and a rollout server that take turns: after the rollout
    batch the servers give their memory back and the trainer takes its own back, trains, gives
    back what `trainer_release` names, the weights go over in place, and the servers resume
    (docs/colocate.md)."""

    enabled: bool = False
    """Rollout and training take turns on the same devices (pipeline.mode=sync, or async with
    pipeline.inflight_at_update=abort_resume; local or Slurm launcher; built-in or SGLang servers
    on the trainer's devices: any number on the CPU, on GPUs one server TP rank beside each
    trainer rank)."""
    server_release: list[str] = field(default_factory=lambda: ["kv_cache", "weights"])
    """What the servers give back while the trainer trains: kv_cache, weights, cuda_graph (what
    is not named stays on the device). Released weights come back with the next weight sync."""
    trainer_release: list[str] = field(default_factory=lambda: ["weights", "optimizer"])
    """What the trainer gives back while the servers generate: weights, optimizer (the optimizer
    state and gradients). Both go to host memory on a GPU, to a private file on the CPU."""

    def check(self) -> None:
        for key, given, known in (("server_release", self.server_release, SERVER_TAGS),
                                  ("trainer_release", self.trainer_release, TRAINER_TAGS)):
            unknown = [t for t in given if t not in known]
            if unknown:
                raise FieldError(key, f"{unknown[0]!r} is not one of {', '.join(known)}")
            if len(set(given)) != len(given):
                raise FieldError(key, "a tag is named twice; name each once")
