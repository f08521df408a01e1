"""Starting a pooled run's engine processes, each where its device is: forked warm from the pool's
forker (rlctl/launchers/pool/warm.py), started cold, or on a Slurm pool as a step of the pool's
job on its node (rlctl/launchers/pool/slurm.py). Either way the process is the same
`rlctl.worker` a run of its own starts, logging into the run's directory."""

from __future__ import annotations

import asyncio
import os

from rlctl.launchers.pool.jobs import PoolJob, wait_healthy
from rlctl.launchers.pool.slurm import srun_command
from rlctl.launchers.pool.warm import Forker

START_TIMEOUT_S = 300.0


class EngineStarter:
    def __init__(self, pool_name: str, nodes: list[str] | None, forker: Forker | None) -> None:
        self.pool_name = pool_name
        self.nodes = nodes
        self.forker = forker

    async def start(self, job: PoolJob, model) -> None:
        """Start the processes of one of the job's models and wait until they answer."""
        from rlctl.launchers.local import run_env, spawn, worker_command

        env = run_env(job.rd)
        if self.nodes:  # gloo and NCCL find their peers on the nodes' own addresses, not loopback
            env = {k: v for k, v in env.items() if not k.endswith("_SOCKET_IFNAME") or k in os.environ}
        for role in job.roles(model):
            cmd, log_path = worker_command(role.kind, job.rd.path, role.index), job.rd.log_path(role.name)
            if self.nodes:  # a step of the pool's job on the role's node
                proc = spawn(srun_command(job.node_of[role.name], cmd, f"{job.name}:{role.name}"), log_path,
                             die_with_parent=True, env=env)
            elif self.forker is not None:  # forked warm: torch and the engines are imported already
                proc = await asyncio.to_thread(self.forker.spawn, cmd[3:], log_path, {**os.environ, **env})
            else:
                proc = spawn(cmd, log_path, die_with_parent=True, env=env)
            job.procs[role.name] = proc
            job.rd.record_process(role.name, pid=proc.pid, port=role.port, log=str(log_path), pool=self.pool_name)
        urls = [job.plan.trainer_url] if model.name == "trainer" else \
            [job.plan.server_urls[int(model.name.rsplit("-", 1)[1])]]
        await wait_healthy(urls, job, START_TIMEOUT_S)
        job.started.add(model.name)
        for url in urls:
            if model.name != "trainer":
                job.rd.event("server_up", role=job.roles(model)[0].name, url=url)
