"""Placing jobs' models on a pool's devices, once (strict affinity), and what a job needs.

A job asks for blocks: each rollout server needs `tp` devices, the trainer `n`. A block goes on
the aligned run of devices (start a multiple of its size, up to 8: a block stays inside one node
when it can) with the least expected load, where a model's expected load is the fraction of time
it keeps its devices busy when the job runs alone (measured by a dedicated simulation, or 0.5
when nothing better is known). Two models whose busy times are anti-correlated (one job's
rollout, another's trainer) then share devices, which is where the pool's saving comes from.
A job's own models go on different devices when there is room: a job never fills its own gaps.

Admission: every model must fit alone on each of its devices when active; a job whose model
does not is refused, saying which and by how much.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlctl.errors import RunError
from rlctl.plex.scheduler import Model

GIB = float(2**30)


@dataclass(frozen=True)
class Block:
    """Models a job needs placed together: `parts` models (rollout servers) over `size` devices
    in all, or one model (a trainer); bytes per device."""

    name: str
    size: int
    weights: float
    working: float
    load: float = 0.5
    """Expected fraction of the time it keeps its devices busy."""
    parts: int = 1
    numbered: bool = False
    """Its models are NAME-0 .. NAME-(parts-1) (rollout servers, even one); else one model NAME."""

    def model_names(self) -> list[str]:
        if self.parts == 1 and not self.numbered:
            return [self.name]
        return [f"{self.name}-{i}" for i in range(self.parts)]


class Layout:
    """What is placed so far on a pool's devices: expected load and occupants per device."""

    def __init__(self, capacity: dict[int, float]) -> None:
        self.capacity = dict(capacity)
        self.load = dict.fromkeys(capacity, 0.0)
        self.occupants: dict[int, set[str]] = {d: set() for d in capacity}

    def forget(self, job: str) -> None:
        for d, occ in self.occupants.items():
            for o in [o for o in occ if o.split("/")[0] == job]:
                occ.discard(o)
                self.load[d] = max(0.0, self.load[d] - float(o.split("/")[2]))

    def place(self, job: str, blocks: list[Block]) -> list[Model]:
        """Models for `blocks` (best fit, busiest first), recorded here. Raises RunError when a
        block fits nowhere."""
        mine: set[int] = set()
        models = []
        for b in sorted(blocks, key=lambda b: (-b.load, -b.size)):
            run = self._best_run(job, b, mine)
            for d in run:
                self.load[d] += b.load
                self.occupants[d].add(f"{job}/{b.name}/{b.load}")
            mine |= set(run)
            width = max(1, b.size // b.parts)  # more parts than devices: they take turns on them
            for i, name in enumerate(b.model_names()):
                start = (i * width) % b.size
                models.append(Model(job, name, run[start:start + width], b.weights, b.working))
        return models

    def _best_run(self, job: str, b: Block, mine: set[int]) -> tuple[int, ...]:
        """Best fit: among the aligned runs of b.size devices where every device has the memory,
        one not the job's own, then one whose expected load stays within 1, then one holding
        fewest models of the same role (a trainer beside other jobs' rollout servers: their busy
        times are the ones that do not coincide), then the busiest such (packing), then one whose
        devices share the same occupants (its calls then wait on one other job, not several)."""
        devices = sorted(self.capacity)
        need = b.weights + b.working
        best: tuple | None = None
        for i in range(0, len(devices) - b.size + 1, min(b.size, 8)):
            run = tuple(devices[i:i + b.size])
            if any(self.capacity[d] < need for d in run):
                continue
            after = max(self.load[d] for d in run) + b.load
            fits = after <= 1.0 + 1e-9
            aligned = len({frozenset(self.occupants[d]) for d in run}) == 1
            same_role = sum(o.split("/")[1] == b.name for d in run for o in self.occupants[d])
            score = (len(mine & set(run)), not fits, same_role, -after if fits else after, not aligned, i)
            if best is None or score < best[0]:
                best = (score, run)
        if best is None:
            biggest = max(self.capacity.values(), default=0.0)
            raise RunError(f"{job}/{b.name} needs {need / GIB:.2f} GiB on each of {b.size} device(s); the pool's "
                           f"devices have {biggest / GIB:.2f} GiB (raise the pool's memory_gb or shrink the job)"
                           if biggest < need else f"{job}/{b.name} needs {b.size} devices; the pool has {len(devices)}")
        return best[1]


def co_location_fits(models: list[Model], capacity: dict[int, float]) -> dict[int, tuple[float, float]]:
    """Naive co-location keeps every model active at once: device -> (bytes needed, capacity) for
    each device where that does not fit (empty when it all fits)."""
    need: dict[int, float] = dict.fromkeys(capacity, 0.0)
    for m in models:
        for d in m.devices:
            need[d] += m.weights + m.working
    return {d: (n, capacity[d]) for d, n in need.items() if n > capacity[d]}
