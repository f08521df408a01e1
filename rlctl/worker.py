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
import socket
import sys
from pathlib import Path

from rlctl.checkpoint import PREEMPTED_EXIT, Preempted
from rlctl.door import (listen_address, listening_socket, new_key_id, read_token, redact_output, role_key,
                        sglang_config, token_path)
from rlctl.errors import RlctlError, RunError
from rlctl.plan import Role, RunPlan
from rlctl.recipe import Device, Launcher, PipelineMode, Recipe, RolloutEngine, TrainEngine, recipe_from_yaml
from rlctl.rundir import RunDir

log = logging.getLogger("rlctl.worker")


def behaviour_versions(recipe: Recipe) -> int:
    """Weight versions a trained sample can come from: the last synced one, or in async up to
    pipeline.max_staleness + 1 of them (rlctl/engines/train/behaviour.py keeps a copy of each)."""
    return recipe.pipeline.max_staleness + 1 if recipe.pipeline.mode is PipelineMode.ASYNC else 1


def _context(run_dir: Path) -> tuple[RunDir, Recipe, RunPlan, dict]:
    rd = RunDir(run_dir)
    info = rd.read()
    recipe = recipe_from_yaml(rd.recipe_path.read_text(), str(rd.recipe_path))
    return rd, recipe, RunPlan.from_json(info["plan"]), info


def _threads(recipe: Recipe, cpus: list[int] | None = None) -> None:
    """Few torch threads per process, and its own cores when the recipe pins them, so that
    rollout and training overlap for real on a small machine, as they do on separate nodes."""
    import torch

    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(recipe.run.threads_per_process)
    torch.set_num_interop_threads(1)


def process_device(kind: Device, index: int, gpus: list[int] | None = None) -> str:
    """cuda -> the index-th of the recipe's GPU list (round-robin), or cuda:index when that GPU
    exists, else the GPUs are shared round-robin."""
    if kind is not Device.CUDA:
        return kind.value
    if gpus:
        return f"cuda:{gpus[index % len(gpus)]}"
    import torch

    return f"cuda:{index % max(1, torch.cuda.device_count())}"


def sglang_gpus(gpus: list[int], tp_size: int, index: int) -> str:
    """CUDA_VISIBLE_DEVICES of local SGLang server `index`: the index-th group of tp_size GPUs
    among rollout.gpus (all of this machine's when empty), so that no two servers share one; the
    server counts its own from 0, as SGLang's --base-gpu-id 0 expects."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    if not gpus:
        import torch

        gpus = list(range(len(visible) if visible else torch.cuda.device_count()))
    mine = gpus[index * tp_size:(index + 1) * tp_size]
    if len(mine) < tp_size:
        raise RunError(f"rollout server {index} needs {tp_size} GPUs of its own, GPUs {index * tp_size}.."
                         f"{(index + 1) * tp_size - 1} of {gpus}; list more in rollout.gpus or lower rollout.servers")
    return ",".join(visible[g] if visible else str(g) for g in mine)


def run_prepare(rd: RunDir, recipe: Recipe) -> None:
    from rlctl.models.tiny import ensure_tiny_model

    _threads(recipe)
    assert recipe.model.init is not None
    path = ensure_tiny_model(recipe.model.init, recipe.data.task, log=log.info)
    rd.update(lambda d: d.update(model_path=str(path)))


def slurm_step() -> str:
    """A rollout server's srun step as scancel names it: JOB.STEP, where JOB is the id of the
    heterogeneous job's component 1, which holds the servers (SLURM_JOB_ID_HET_GROUP_1; inside the
    step SLURM_JOB_ID is component 0's, under which scancel finds no such step and says nothing)."""
    job = os.environ.get("SLURM_JOB_ID_HET_GROUP_1") or os.environ["SLURM_JOB_ID"]
    return f"{job}.{os.environ['SLURM_STEP_ID']}"


def run_rollout(rd: RunDir, recipe: Recipe, plan: RunPlan, info: dict, index: int) -> None:
    from rlctl.engines.rollout.builtin import server

    role = plan.rollout[index]
    placed = info.get("pool", {}).get("placement", {}).get(role.name)  # launcher=pool: the pool's choice
    cpus = placed.get("cpus") if placed else recipe.rollout.cpus
    if cpus:
        os.sched_setaffinity(0, cpus)
    step = {"slurm_step": slurm_step()} if "SLURM_STEP_ID" in os.environ else {}  # failover kills a frozen one
    rd.record_process(role.name, pid=os.getpid(), port=role.port, cpus=sorted(os.sched_getaffinity(0)), **step)
    if recipe.rollout.engine is RolloutEngine.SGLANG:
        _exec_sglang(rd, recipe, role, info["model_path"])
    if recipe.rollout.engine is RolloutEngine.VLLM:
        _exec_vllm(rd, recipe, role, info["model_path"])
    sock = _bound(role)
    key_id = _new_key_id(rd, role)  # once the port is ours: a key in run.json is never that of a process without it
    args = server.parser().parse_args([  # a list in this process: the token file's path only, never the token
        "--model-path", info["model_path"], "--host", listen_address(role.listen), "--port", str(role.port),
        "--api-key-file", str(token_path(rd.path)), "--key-scope", f"{role.name}/{key_id}",
        "--weight-group-master", plan.trainers[0].host,
        "--random-seed", str(recipe.run.seed * 1000 + index),
        "--max-running-requests", str(recipe.rollout.max_running_requests),
        "--threads", str(recipe.run.threads_per_process),
        "--device", placed["device"] if placed else process_device(recipe.rollout.device, index, recipe.rollout.gpus),
        "--tp-size", str(recipe.rollout.builtin.tp_size),
        *(["--emulate-sglang", recipe.rollout.builtin.emulate_sglang] if recipe.rollout.builtin.emulate_sglang else []),
        *(["--emulate-vllm", recipe.rollout.builtin.emulate_vllm] if recipe.rollout.builtin.emulate_vllm else []),
    ])
    if recipe.rollout.builtin.emulate_vllm:  # as a vLLM server rlctl starts (vllm.launch_env), unless told otherwise
        os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")
    server.serve(args, sock)


def _new_key_id(rd: RunDir, role: Role) -> str:
    """This start's key_id (rlctl/door.py role_key), recorded in run.json for the others."""
    key_id = new_key_id()
    rd.record_process(role.name, key_id=key_id)
    return key_id


def _bound(role: Role) -> socket.socket:
    """This process's listening socket, before it draws its key: a port someone else holds ends
    the process here (EADDRINUSE), and the launcher starts it again (rlctl/launchers/local.py)."""
    try:
        return listening_socket(role.listen, role.port)
    except OSError as e:
        raise RunError(f"{role.name} cannot listen on {role.listen}:{role.port}: {e.strerror or e}; "
                       "another process holds the port") from None


def _exec_sglang(rd: RunDir, recipe: Recipe, role: Role, model_path: str) -> None:
    """The SGLang server takes this process over (same pid, log and parent-death signal), the run's
    token its api key by a 0600 --config file; what it logs passes a filter that hides the token
    (SGLang logs its server_args, api_key included)."""
    from rlctl.engines.rollout import sglang

    sglang.require_sglang()
    if recipe.launcher is Launcher.LOCAL:  # under Slurm the batch script has bound the task's GPUs
        os.environ["CUDA_VISIBLE_DEVICES"] = sglang_gpus(recipe.rollout.gpus, recipe.rollout.sglang.tp_size, role.index)
        log.info("rollout server %d on GPUs %s", role.index, os.environ["CUDA_VISIBLE_DEVICES"])
    key = _own_key(rd, role)
    config = sglang_config(rd.path / f"sglang-{role.name}.yaml", key)
    cmd = sglang.launch_command(sys.executable, model_path, recipe.rollout.sglang, host=listen_address(role.listen),
                                port=role.port, seed=recipe.run.seed * 1000 + role.index, config=str(config))
    log.info("exec %s", " ".join(cmd))
    redact_output(key)
    os.execv(cmd[0], cmd)


def _exec_vllm(rd: RunDir, recipe: Recipe, role: Role, model_path: str) -> None:
    """The vLLM server takes this process over, as SGLang's does; the run's token reaches it in
    its environment (VLLM_API_KEY, never on a command line) and guards every route but /health
    (rlctl/engines/rollout/vllm_door.py); dev mode gives it the routes a trainer drives."""
    from rlctl.engines.rollout import vllm

    vllm.require_vllm()
    if recipe.launcher is Launcher.LOCAL:  # under Slurm the batch script has bound the task's GPUs
        os.environ["CUDA_VISIBLE_DEVICES"] = sglang_gpus(recipe.rollout.gpus, recipe.rollout.vllm.tp_size, role.index)
        log.info("rollout server %d on GPUs %s", role.index, os.environ["CUDA_VISIBLE_DEVICES"])
    key = _own_key(rd, role)
    env = vllm.launch_env(key)
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", env.pop("VLLM_SERVER_DEV_MODE"))
    os.environ.update(env)
    cmd = vllm.launch_command(sys.executable, model_path, recipe.rollout.vllm, host=listen_address(role.listen),
                              port=role.port, seed=recipe.run.seed * 1000 + role.index)
    log.info("exec %s", " ".join(cmd))
    redact_output(key)
    os.execv(cmd[0], cmd)


def _own_key(rd: RunDir, role: Role) -> str:
    """An engine that binds its port itself (SGLang, vLLM) gets its key before it starts: the
    key_id is recorded before the port is bound (docs/security.md says what that leaves open)."""
    return role_key(_run_token(rd), role.name, _new_key_id(rd, role))


def _run_token(rd: RunDir) -> str:
    try:
        return read_token(rd.path)
    except ValueError as e:
        raise RunError(str(e)) from None


def run_trainer(rd: RunDir, recipe: Recipe, plan: RunPlan, info: dict, rank: int) -> None:
    import torch.distributed as dist
    from aiohttp import web

    from rlctl.engines.train.service import TrainerService, follower_loop
    from rlctl.engines.train.torch_engine import TorchTrainEngine
    from rlctl.engines.weightsync import tcp_store

    role = plan.trainers[rank]
    placed = info.get("pool", {}).get("placement", {}).get(role.name)  # launcher=pool: the pool's choice
    _threads(recipe, placed.get("cpus") if placed else recipe.train.cpus)
    step = {"slurm_step": slurm_step()} if placed and "SLURM_STEP_ID" in os.environ else {}  # a Slurm pool stops it
    rd.record_process(role.name, pid=os.getpid(), port=role.port, cpus=sorted(os.sched_getaffinity(0)), **step)
    token = _run_token(rd) if rank == 0 else None
    if rank == 0 and recipe.rollout.engine is RolloutEngine.VLLM:  # the weight group is vLLM's own (vllm_group.py)
        from rlctl.engines.rollout.vllm import require_vllm

        require_vllm()
    world = len(plan.trainers)
    init_method = f"tcp://{plan.trainers[0].host}:{plan.trainer_dist_port}"
    megatron = recipe.train.engine is TrainEngine.MEGATRON
    gpu = placed["device"] if placed else process_device(Device.CUDA, rank, recipe.train.gpus)  # megatron's
    if megatron:  # the GPU before the NCCL group, as the engine would do it
        import torch

        torch.cuda.set_device(torch.device(gpu))
    if megatron or world > 1:  # Megatron needs its NCCL group even for one rank
        backend = "nccl" if megatron or recipe.train.device is Device.CUDA else "gloo"
        store = tcp_store(init_method, rank, world, datetime.timedelta(minutes=30))  # on trainer 0's address only
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    if megatron:
        from rlctl.engines.train.megatron_engine import MegatronTrainEngine

        # The default group exists: the engine makes Megatron's TP x DP groups on it.
        engine = MegatronTrainEngine(info["model_path"], recipe.train, recipe.rollout.sampling.temperature, rank,
                                     world, device=gpu, init_method=init_method, algo=recipe.algo,
                                     behaviour_versions=behaviour_versions(recipe))
    else:
        device = placed["device"] if placed else process_device(recipe.train.device, rank, recipe.train.gpus)
        engine = TorchTrainEngine(info["model_path"], recipe.train, recipe.rollout.sampling.temperature, rank, world,
                                  device=device, algo=recipe.algo, behaviour_versions=behaviour_versions(recipe))
    log.info("trainer rank %d/%d ready", rank, world)
    if rank == 0:
        sock = _bound(role)
        key_id = _new_key_id(rd, role)  # once the port is ours, as a rollout server's
        service = TrainerService(engine, world, token=token, key=role_key(token, role.name, key_id), run_dir=rd.path)
        web.run_app(service.app(), sock=sock, print=None, access_log=None)
    else:
        follower_loop(engine)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_controller(rd: RunDir, recipe: Recipe, plan: RunPlan, info: dict) -> None:
    from rlctl.controller import run_controller as main

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
        from rlctl.launchers import slurm_job

        return slurm_job.main(args)
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
