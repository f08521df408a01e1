"""`python -m rlctl.worker ROLE --run-dir DIR [--index I]`: the one entry point of every process.

Roles: supervisor (local launcher), prepare (build the tiny model), rollout (a rollout server),
trainer (one trainer rank), controller (the pipeline). Each reads the resolved recipe and the
plan from the run directory, records its pid/host/port in run.json, and logs to stdout, which
the launcher sends to logs/<role>.log. Inside a Slurm job (rlctl/launchers/slurm/) the batch
script also runs `plan` (the plan from the job's node lists), `health` (are all servers up?) and
`state` (the run's final state); there --index defaults to SLURM_PROCID, the task's rank in its
srun step.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import signal
import sys
from pathlib import Path

from rlctl.run.checkpoint import PREEMPTED_EXIT, Preempted
from rlctl.process.devices import process_device
from rlctl.process.auth import role_key
from rlctl.engines.rollout.adapter import bound, record_key_id, run_token
from rlctl.engines.train.adapter import trainer_adapter
from rlctl.errors import RlctlError
from rlctl.process.topology import Topology
from rlctl.recipe import Recipe, recipe_from_yaml
from rlctl.run.dir import RunDir

log = logging.getLogger("rlctl.worker")


def _context(run_dir: Path) -> tuple[RunDir, Recipe, Topology, dict]:
    rd = RunDir(run_dir)
    info = rd.read()
    recipe = recipe_from_yaml(rd.recipe_path.read_text(), str(rd.recipe_path))
    return rd, recipe, Topology.from_json(info["plan"]), info


def _threads(recipe: Recipe, cpus: list[int] | None = None) -> None:
    """Few torch threads per process, and its own cores when the recipe pins them, so that
    rollout and training overlap for real on a small machine, as they do on separate nodes."""
    import torch

    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(recipe.run.threads_per_process)
    torch.set_num_interop_threads(1)


def run_prepare(rd: RunDir, recipe: Recipe) -> None:
    from rlctl.models.tiny import cached_tiny_model, ensure_tiny_model

    assert recipe.model.init is not None
    if cached_tiny_model(recipe.model.init, recipe.data.task) is None:
        _threads(recipe)  # torch only to build it: a cached one costs this process no torch import
    path = ensure_tiny_model(recipe.model.init, recipe.data.task, log=log.info)
    rd.update(lambda d: d.update(model_path=str(path)))


def slurm_step() -> str:
    """A rollout server's srun step as scancel names it: JOB.STEP, where JOB is the id of the
    heterogeneous job's component 1, which holds the servers (SLURM_JOB_ID_HET_GROUP_1; inside the
    step SLURM_JOB_ID is component 0's, under which scancel finds no such step and says nothing)."""
    job = os.environ.get("SLURM_JOB_ID_HET_GROUP_1") or os.environ["SLURM_JOB_ID"]
    return f"{job}.{os.environ['SLURM_STEP_ID']}"


def run_rollout(rd: RunDir, recipe: Recipe, plan: Topology, info: dict, index: int) -> None:
    """Rollout server `index`, as its engine's adapter starts it (rlctl/engines/rollout/registry.py)."""
    from rlctl.engines.rollout.adapter import ServerStart
    from rlctl.engines.rollout.registry import rollout_adapter

    role = plan.rollout[index]
    placed = info.get("pool", {}).get("placement", {}).get(role.name)  # launcher=pool: the pool's choice
    cpus = placed.get("cpus") if placed else recipe.rollout.cpus
    if cpus:
        os.sched_setaffinity(0, cpus)
    step = {"slurm_step": slurm_step()} if "SLURM_STEP_ID" in os.environ else {}  # failover kills a frozen one
    rd.record_process(role.name, pid=os.getpid(), port=role.port, cpus=sorted(os.sched_getaffinity(0)), **step)
    rollout_adapter(recipe.rollout.engine).start(ServerStart(rd, recipe, plan, role, info["model_path"], placed))


def run_trainer(rd: RunDir, recipe: Recipe, plan: Topology, info: dict, rank: int) -> None:
    import torch.distributed as dist
    from aiohttp import web

    from rlctl.engines.train.service import TrainerService, follower_loop
    from rlctl.engines.weightsync import tcp_store
    from rlctl.engines.weightsync.ipc import ipc_key

    role = plan.trainers[rank]
    placed = info.get("pool", {}).get("placement", {}).get(role.name)  # launcher=pool: the pool's choice
    _threads(recipe, placed.get("cpus") if placed else recipe.train.cpus)
    step = {"slurm_step": slurm_step()} if placed and "SLURM_STEP_ID" in os.environ else {}  # a Slurm pool stops it
    rd.record_process(role.name, pid=os.getpid(), port=role.port, cpus=sorted(os.sched_getaffinity(0)), **step)
    token = run_token(rd) if rank == 0 else None
    if rank == 0:  # what sending weights to this engine's servers needs here (vLLM: its own weight group)
        from rlctl.engines.rollout.registry import rollout_adapter

        rollout_adapter(recipe.rollout.engine).trainer_requires()
    world = len(plan.trainers)
    init_method = f"tcp://{plan.trainers[0].host}:{plan.trainer_dist_port}"
    trainer = trainer_adapter(recipe.train.engine)
    device = placed["device"] if placed else process_device(trainer.device(recipe.train), rank, recipe.train.gpus)
    trainer.before_group(device)
    if trainer.forms_group(world):
        store = tcp_store(init_method, rank, world, datetime.timedelta(minutes=30))  # on trainer 0's address only
        dist.init_process_group(trainer.backend(recipe.train), store=store, rank=rank, world_size=world)
    engine = trainer.build(info["model_path"], recipe, rank, world, device, init_method)
    log.info("trainer rank %d/%d ready", rank, world)
    if rank == 0:
        sock = bound(role)
        key_id = record_key_id(rd, role)  # once the port is ours, as a rollout server's
        service = TrainerService(engine, world, token=token, key=role_key(token, role.name, key_id), run_dir=rd.path)
        web.run_app(service.app(), sock=sock, print=None, access_log=None)
    else:  # colocated, each rank tags the buckets it hands its own server with the run's key
        follower_loop(engine, ipc_key(run_token(rd)) if recipe.colocate.enabled else None)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_controller(rd: RunDir, recipe: Recipe, plan: Topology, info: dict) -> None:
    from rlctl.control.controller import run_controller as main

    rd.record_process("controller", pid=os.getpid())
    try:
        asyncio.run(main(rd, recipe, plan, info["model_path"]))
    finally:
        # The loop's SIGUSR1 handler (a checkpoint, then stop) is gone with it; a warning sent
        # again now (the batch script repeats it until the controller exits) must not kill it.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def run_supervisor(rd: RunDir) -> int:
    from rlctl.launchers.local import Supervisor

    return Supervisor(rd).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlctl.worker")
    p.add_argument("role", choices=["supervisor", "prepare", "rollout", "trainer", "controller", "plan", "health", "state",
                                     "attempt", "requeue", "server-exit"])
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--index", type=int, default=int(os.environ.get("SLURM_PROCID", 0)))
    p.add_argument("--trainer-nodes", default="", help="plan: the trainer component's hostnames")
    p.add_argument("--rollout-nodes", default="", help="plan: the rollout component's hostnames")
    p.add_argument("--port-base", type=int, default=0, help="plan: first port")
    p.add_argument("--state", default="", help="state: running | completed | failed | cancelled")
    p.add_argument("--reason", default="", help="state: why the run ended")
    p.add_argument("--failed", default="", help="state: the component that failed (rollout | trainer | controller)")
    p.add_argument("--code", type=int, default=0, help="server-exit: the exit code of the server's srun step")
    p.add_argument("--restarts", type=int, default=0, help="server-exit: how many times it has now exited")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format=f"%(asctime)s %(levelname)s {args.role}-{args.index}: %(message)s")
    if args.role == "supervisor":
        return run_supervisor(RunDir(args.run_dir))
    if args.role in ("plan", "health", "state", "attempt", "requeue", "server-exit"):
        from rlctl.launchers.slurm import steps

        return steps.main(args)
    rd, recipe, plan, info = _context(args.run_dir)
    try:
        if args.role == "prepare":
            run_prepare(rd, recipe)
        elif args.role == "rollout":
            run_rollout(rd, recipe, plan, info, args.index)
        elif args.role == "trainer":
            run_trainer(rd, recipe, plan, info, args.index)
        else:
            run_controller(rd, recipe, plan, info)
    except Preempted as e:
        print(f"preempted: {e}", flush=True)
        return PREEMPTED_EXIT
    except RlctlError as e:
        # One line the supervisor can quote as the run's exit reason.
        log.debug("traceback", exc_info=True)
        print(f"error: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
