"""Recipe -> Topology: which processes a run has, where they listen, and how they find each other.

Pure data, no I/O except asking the OS for free ports (local launcher). The plan is stored in
run.json, and every worker reads its part from there.
"""

from __future__ import annotations

import random
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlctl.recipe import Recipe


@dataclass(frozen=True)
class Role:
    name: str
    """Unique within the run: rollout-0, trainer-0, controller; also the log file's name."""
    kind: str
    """rollout | trainer | controller"""
    index: int
    host: str
    """Where the others reach it (a node name on a cluster), and where it listens: 127.0.0.1 in a
    local run, the node's own address on a cluster (rlctl/process/auth.py listen_address), never all."""
    port: int | None = None
    bind: str | None = None
    """Address its server listens on when not `host`. Plans no longer set it (older run.json
    files have 0.0.0.0 on cluster nodes)."""

    @property
    def listen(self) -> str:
        return self.bind or self.host


@dataclass
class Topology:
    rollout: list[Role]
    trainers: list[Role]
    controller: Role
    trainer_dist_port: int
    """torch.distributed rendezvous of the trainer ranks (on trainer 0's host)."""
    weight_sync_port: int
    """TCP store of the weight-sync group, hosted by trainer rank 0."""

    @property
    def server_urls(self) -> list[str]:
        return [f"http://{r.host}:{r.port}" for r in self.rollout]

    @property
    def trainer_url(self) -> str:
        t0 = self.trainers[0]
        return f"http://{t0.host}:{t0.port}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Topology:
        return cls(
            rollout=[Role(**r) for r in d["rollout"]],
            trainers=[Role(**r) for r in d["trainers"]],
            controller=Role(**d["controller"]),
            trainer_dist_port=d["trainer_dist_port"],
            weight_sync_port=d["weight_sync_port"],
        )


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000
"""Ports below are left to services that name theirs."""


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports that are free right now (held open together so none repeats), drawn from
    below the kernel's ephemeral range. A port is chosen at launch and bound seconds later, when
    its process has started; one from the ephemeral range (what bind to port 0 gives) may be
    taken meanwhile as the local end of any outgoing connection, which a run makes by the
    hundred. Where the range leaves too little room below it, the kernel picks."""
    socks: list[socket.socket] = []
    rng = random.SystemRandom()
    lo, _ = ephemeral_range()
    try:
        tries = 0
        while len(socks) < n:
            tries += 1
            port = rng.randrange(LOWEST_PORT, lo) if lo - LOWEST_PORT >= 1000 and tries <= 64 * n else 0
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default where it
    cannot be read)."""
    try:
        lo, hi = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def local_topology(recipe: Recipe, host: str = "127.0.0.1") -> Topology:
    n_servers, n_ranks = recipe.rollout.servers, recipe.train.ranks
    ports = free_ports(n_servers + 3, host)
    rollout = [Role(f"rollout-{i}", "rollout", i, host, ports[i]) for i in range(n_servers)]
    trainers = [Role(f"trainer-{r}", "trainer", r, host, ports[n_servers] if r == 0 else None) for r in range(n_ranks)]
    return Topology(
        rollout=rollout,
        trainers=trainers,
        controller=Role("controller", "controller", 0, host),
        trainer_dist_port=ports[n_servers + 1],
        weight_sync_port=ports[n_servers + 2],
    )


def slurm_topology(recipe: Recipe, trainer_hosts: list[str], rollout_hosts: list[str], port_base: int) -> Topology:
    """The plan inside a Slurm allocation, made by the job itself once it knows its nodes.

    Rollout servers fill the rollout nodes in order (servers_per_node each, ports port_base + k);
    trainer ranks fill the trainer nodes in order; trainer rank 0's node hosts the trainer service,
    the torch.distributed rendezvous, the weight-sync store and the controller. Ports are the
    same on every node, which is fine: each node is a separate host. Every server listens on its
    node's own address (the node name resolved there), not on all of the node's addresses.
    """
    spn = recipe.slurm.rollout.servers_per_node
    n_servers, n_ranks = recipe.rollout.servers, recipe.train.ranks
    if len(rollout_hosts) * spn < n_servers:
        raise ValueError(f"{n_servers} rollout servers need {-(-n_servers // spn)} nodes, the job has {len(rollout_hosts)}")
    if not trainer_hosts or n_ranks % len(trainer_hosts):
        raise ValueError(f"{n_ranks} trainer ranks do not spread evenly over {len(trainer_hosts)} nodes")
    per_node = n_ranks // len(trainer_hosts)
    rollout = [Role(f"rollout-{i}", "rollout", i, rollout_hosts[i // spn], port_base + i % spn)
               for i in range(n_servers)]
    trainers = [Role(f"trainer-{r}", "trainer", r, trainer_hosts[r // per_node], port_base + spn if r == 0 else None)
                for r in range(n_ranks)]
    return Topology(
        rollout=rollout,
        trainers=trainers,
        controller=Role("controller", "controller", 0, trainer_hosts[0]),
        trainer_dist_port=port_base + spn + 1,
        weight_sync_port=port_base + spn + 2,
    )
