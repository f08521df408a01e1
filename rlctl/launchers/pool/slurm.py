"""A pool on a Slurm allocation (pool file `launcher: slurm`).

`rlctl pool up` submits one job of `slurm.nodes` nodes whose batch script runs the pool's service
on the first node. The service listens on that node's own address (not all of them), and starts
each run's engines as steps of the job (`srun --overlap`) on the nodes their devices are on: the
devices are spread evenly, device i on node i // (count / nodes). A run's plan (run.json) is
rewritten when it is attached: its servers and trainer ranks get the nodes of their devices and
ports there from the pool's port book, so its controller (started after the attach, wherever the
run was launched) and its engines find each other across nodes.

The pool's directory must be on a filesystem the nodes and the launching host share, as a Slurm
run's directory is.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from rlctl.errors import RunError
from rlctl.process.topology import Topology
from rlctl.recipe import Device
from rlctl.recipe.pool import PoolFile


def render_pool_script(spec: PoolFile, pool_dir: Path, python: str = sys.executable) -> str:
    """The pool's batch script (a pure function of the pool file)."""
    from rlctl.launchers.slurm.script import python_lines

    p, sl = spec.pool, spec.pool.slurm
    gpus = sl.gpus_per_node or (spec.pool.devices_per_node() if p.devices.kind is Device.CUDA else 0)
    lines = [
        "#!/bin/bash",
        "# shellcheck disable=SC1090,SC1091  # slurm.setup may source files that exist only on the nodes",
        f"# rlctl pool {p.name}: {p.devices.count} {p.devices.kind} device(s) on {sl.nodes} node(s), written by "
        "`rlctl pool up`. The service runs on the first node and starts the runs' engines as steps.",
        f"#SBATCH --job-name=rlctl-pool-{p.name}",
        f"#SBATCH --nodes={sl.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={pool_dir}/logs/pool.log",
        "#SBATCH --open-mode=append",
        f"#SBATCH --time={sl.time}",
        "#SBATCH --no-requeue",
        *([f"#SBATCH --gpus-per-node={gpus}"] if gpus else []),
        *(f"#SBATCH --{key}={value}" for key, value in (("partition", sl.partition), ("account", sl.account),
                                                       ("qos", sl.qos)) if value),
        *(f"#SBATCH {arg}" for arg in sl.sbatch_args),
    ]
    setup = "\n".join(sl.setup) if sl.setup else "# (no slurm.setup lines)"
    body = f"""\
set -uo pipefail
export PYTHONUNBUFFERED=1
echo "rlctl: pool job ${{SLURM_JOB_ID:-}} starts on $HOSTNAME"

# slurm.setup
{setup}

{python_lines(sl, python)}
exec "$PY" -m rlctl.launchers.pool.service --pool-dir {shlex.quote(str(pool_dir))}
"""
    return "\n".join(lines) + "\n\n" + body


def submit_pool(spec: PoolFile, pool_dir: Path) -> str:
    """Write the batch script into the pool's directory and sbatch it: the job id."""
    from rlctl.launchers import slurm
    from rlctl.run.dir import write_atomic

    script = pool_dir / "pool.sbatch"
    write_atomic(script, render_pool_script(spec, pool_dir))
    return slurm.submit(script)


def job_nodes() -> list[str]:
    """The nodes of the allocation this process runs in, in Slurm's order (the first is ours)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise RunError("launcher=slurm: the pool's service is not in a Slurm job (no SLURM_JOB_NODELIST); "
                       "start it with `rlctl pool up POOL.yaml`")
    res = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    if res.returncode != 0:
        raise RunError(f"scontrol show hostnames {nodelist}: {res.stderr.strip()}")
    return res.stdout.split()


def srun_command(node: str, cmd: list[str], name: str) -> list[str]:
    """One engine process as a step of the pool's job on `node`. --overlap: the steps share the
    nodes' CPUs and GPUs (the pool's scheduler decides who computes); --cpu-bind=none: the
    engine pins itself to its device's cores; --kill-on-bad-exit: a task that dies ends its step."""
    return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--cpu-bind=none",
            "--kill-on-bad-exit=1", "--quiet", f"--job-name={name}", *cmd]


class PortBook:
    """Ports the runs' engines listen on, per node, from `base` up: a run's are given back when it
    leaves, so a long-lived pool does not walk through the port range."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.taken: dict[str, dict[int, str]] = {}

    def take(self, node: str, owner: str) -> int:
        used = self.taken.setdefault(node, {})
        port = self.base
        while port in used:
            port += 1
        used[port] = owner
        return port

    def give_back(self, owner: str) -> None:
        for used in self.taken.values():
            for port in [p for p, o in used.items() if o == owner]:
                del used[port]

    def replan(self, plan: Topology, owner: str, node_of_role: dict[str, str]) -> Topology:
        """The run's plan with every server and trainer rank on its node, listening on ports of
        this book; the trainers' rendezvous and the weight-sync store on trainer 0's node."""
        rollout = [replace(r, host=node_of_role[r.name], port=self.take(node_of_role[r.name], owner))
                   for r in plan.rollout]
        trainers = [replace(r, host=node_of_role[r.name],
                            port=self.take(node_of_role[r.name], owner) if r.port is not None else None)
                    for r in plan.trainers]
        first = trainers[0].host
        return Topology(rollout=rollout, trainers=trainers, controller=plan.controller,
                       trainer_dist_port=self.take(first, owner), weight_sync_port=self.take(first, owner))
