"""The weights that generated the samples still to be trained: one frozen copy per weight version.

PPO's old log-probs and old values belong to the weights the rollout servers sampled with. A
trainer that takes several optimizer steps per rollout batch (train.groups_per_batch below
rollout.batch_size), or trains samples a version or more behind (async), has moved on from
them by the time it trains a sample; so, when the servers are given version v, the trainer keeps
a copy of its weights at v, and scores a sample of version v with that copy. A sample of the
trainer's own current version needs no copy: the live weights are exactly that version's (a
version is a count of optimizer steps).

`keep` copies are kept, the newest: 1 when every sample trained was generated after the last
sync (sync, rolloutpipe), pipeline.max_staleness + 1 in async. A sample whose version has no
copy any more stops the trainer with one line (it would otherwise be scored by other weights).
"""

from __future__ import annotations

import copy

import torch

from rlctl.errors import RunError


class Behaviour:
    def __init__(self, live: torch.nn.Module, keep: int, what: str = "policy",
                 shadow: torch.nn.Module | None = None) -> None:
        """`shadow`: a module of live's structure to load copies into (a deep copy of live when
        None; Megatron builds a fresh model, its live parameters being views of DDP buffers)."""
        self.live, self.keep, self.what = live, max(1, keep), what
        self.shadow = shadow if shadow is not None else copy.deepcopy(live).eval().requires_grad_(False)
        self._shadow_params = list(self.shadow.parameters())
        self.copies: dict[int, list[torch.Tensor]] = {}
        self.loaded: int | None = None

    def mark(self, version: int) -> None:
        """The servers now hold the live weights as `version`: keep a copy of them."""
        if version in self.copies:
            return
        spare = None
        if len(self.copies) >= self.keep:
            spare = self.copies.pop(min(self.copies))  # the oldest; its tensors are reused
            if self.loaded is not None and self.loaded not in self.copies:
                self.loaded = None
        with torch.no_grad():
            live = [p.detach() for p in self.live.parameters()]
            if spare is None:
                spare = [p.clone() for p in live]
            else:
                for dst, src in zip(spare, live):
                    dst.copy_(src)
        self.copies[version] = spare

    def module_at(self, version: int, current: int) -> torch.nn.Module:
        """The module holding the weights of `version` (the live one when it is `current`)."""
        if version == current:
            return self.live
        if version not in self.copies:
            raise RunError(f"a sample of weight version {version} reached the trainer, which keeps the {self.what} "
                           f"weights of versions {sorted(self.copies)} only (trainer at {current}); "
                           "raise the behaviour copies kept or lower pipeline.max_staleness")
        if self.loaded != version:
            with torch.no_grad():
                for dst, src in zip(self._shadow_params, self.copies[version]):
                    dst.copy_(src)
            self.loaded = version
        return self.shadow

    def nbytes(self) -> int:
        per = sum(p.numel() * p.element_size() for p in self._shadow_params)
        return per * (1 + len(self.copies))
