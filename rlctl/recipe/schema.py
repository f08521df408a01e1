"""The whole recipe: its sections, and the checks that span more than one of them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rlctl.recipe.algo import AlgoConfig
from rlctl.recipe.checks import FieldError, Section, divides
from rlctl.recipe.choices import (
    TASK_ENVIRONMENTS,
    DataSource,
    Device,
    InflightAtUpdate,
    Launcher,
    Overlong,
    PipelineMode,
    RolloutEngine,
    ServerProtocol,
    SyncBackend,
    TrainEngine,
)
from rlctl.recipe.cluster import SimConfig, SlurmConfig, TrackingConfig
from rlctl.recipe.colocate import ColocateConfig
from rlctl.recipe.data import DataConfig
from rlctl.recipe.eval import EvalConfig
from rlctl.recipe.inputs import ModelConfig, RewardConfig, RunConfig
from rlctl.recipe.pool import PoolConfig
from rlctl.recipe.rollout import RolloutConfig
from rlctl.recipe.train import PipelineConfig, TrainConfig


@dataclass(kw_only=True)
class Recipe(Section):
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    colocate: ColocateConfig = field(default_factory=ColocateConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launcher: Launcher = Launcher.LOCAL
    """Where the run's processes go: local (this host, every role its own process), slurm (one heterogeneous
    Slurm job: trainer nodes and rollout nodes) or pool (the devices of a shared pool, `rlctl pool up`; see
    the pool section)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)

    def check(self) -> None:
        """What no single section can see; keys here are dotted from the top."""
        init = self.model.init
        if init is not None and init.warmup_steps > 0 and self.data.source is not DataSource.TASK:
            raise FieldError("model.init.warmup_steps",
                             "the warm-up trains on a built-in task; set data.source=task or warmup_steps=0")
        self._check_multi_turn()
        if self.run.steps == 0 and not (self.eval.sets and self.eval.before):
            raise FieldError("run.steps", "0 trains nothing and only evaluates eval.sets before training (eval.before); "
                                          "give eval sets, or steps > 0")
        divides("train.groups_per_batch", self.train.groups_per_batch, "rollout.batch_size", self.rollout.batch_size,
                "pick a divisor so every train batch is full")
        if self.launcher is Launcher.LOCAL:
            self._check_pinning()
        elif self.launcher is Launcher.SLURM:
            self._check_slurm_layout()
        else:
            self._check_pool()
        wandb_missing = self.tracking.wandb.missing_here() if self.launcher is not Launcher.SLURM else None
        if wandb_missing:  # the controller logs from this machine (a Slurm job's: from its first node)
            raise FieldError("tracking.wandb.mode", wandb_missing)
        self._check_ipc()
        self._check_colocate()
        self._check_vllm()
        self._check_algo()
        if self.sim.colocated and self.pipeline.mode is not PipelineMode.SYNC:
            raise FieldError("sim.colocated", "colocated rollout and training take turns on their GPUs: "
                             "set pipeline.mode=sync, or colocated=false")

    def _check_multi_turn(self) -> None:
        """A multi-turn task needs its environment."""
        mt = self.rollout.multi_turn
        needs = TASK_ENVIRONMENTS.get(self.data.task) if self.data.source is DataSource.TASK else None
        if needs and not mt.enabled:
            raise FieldError("rollout.multi_turn.enabled",
                             f"data.task={self.data.task} is answered with tools: set rollout.multi_turn.enabled=true "
                             f"and rollout.multi_turn.environment={needs}")
        if needs and mt.environment != needs:
            raise FieldError("rollout.multi_turn.environment",
                             f"data.task={self.data.task} is answered with the {needs}'s tools: set it to {needs}")

    def _check_pool(self) -> None:
        if not self.pool.name:
            raise FieldError("pool.name", "launcher=pool attaches to a pool: name it (see `rlctl pool status`)")
        for key, value in (("rollout.cpus", self.rollout.cpus), ("train.cpus", self.train.cpus),
                           ("rollout.gpus", self.rollout.gpus), ("train.gpus", self.train.gpus)):
            if value:
                raise FieldError(key, "the pool places a run's engines on its devices; remove it")
        if self.rollout.engine is not RolloutEngine.BUILTIN or self.rollout.builtin.emulate_vllm:
            raise FieldError("rollout.engine", "a pool hosts built-in servers speaking SGLang's protocol for now; "
                                               "use builtin without emulate_vllm")

    def _check_algo(self) -> None:
        algo = self.algo
        if algo.overlong is Overlong.PENALTY and algo.overlong_buffer > self.rollout.sampling.max_new_tokens:
            raise FieldError("algo.overlong_buffer", f"{algo.overlong_buffer} tokens is more than "
                             f"rollout.sampling.max_new_tokens ({self.rollout.sampling.max_new_tokens}); lower it")
        if self.launcher is Launcher.POOL and self.train.engine is TrainEngine.MEGATRON and algo.needs_reference:
            raise FieldError("algo.kl_coef", "a pool moves a Megatron trainer's policy and optimizer, not its KL "
                                             "reference model; set it to 0 or use train.engine=torch in a pool")
        if self.launcher is Launcher.POOL and (algo.ppo or algo.recompute_logprobs):
            raise FieldError("algo.name" if algo.ppo else "algo.recompute_logprobs",
                             "a pool moves a trainer's policy and optimizer, not a critic or behaviour copies; "
                             "run PPO and recomputed log-probs outside a pool")

    def _check_vllm(self) -> None:
        """vLLM's workers receive weights over NCCL only: the trainer sends from a GPU."""
        if self.rollout.engine is RolloutEngine.VLLM and self.pipeline.check_weights:
            raise FieldError("pipeline.check_weights", "vLLM holds its weights fused and sharded, not as the "
                             "trainer's tensors; check syncs with rollout.builtin.emulate_vllm instead")
        if self.rollout.engine is not RolloutEngine.VLLM:
            return
        if self.train.device is not Device.CUDA:
            raise FieldError("train.device", "vLLM servers receive weights over NCCL, from a GPU; set train.device=cuda")
        if self.train.sync_backend not in (SyncBackend.AUTO, SyncBackend.NCCL):
            raise FieldError("train.sync_backend", "vLLM servers receive weights over NCCL; set it to nccl or auto")

    def _check_colocate(self) -> None:
        """What taking turns needs: sync steps (or async ones whose requests cut by a turn resume
        after it), the local launcher, servers that release memory by
        SGLang's calls (built-in or SGLang) on the trainer's devices (the CPU's cores, shared; on
        GPUs each trainer rank with one server TP rank on its GPU: weights go over CUDA IPC, which
        only a process that sees the GPU opens, from every rank: weightsync/ipc_ranks.py)."""
        if not self.colocate.enabled:
            return
        mode = self.pipeline.mode
        if mode is PipelineMode.ROLLOUTPIPE:
            raise FieldError("pipeline.mode", "rolloutpipe trains while the servers generate, and colocated devices "
                                              "take turns; set pipeline.mode=sync or colocate.enabled=false")
        if mode is PipelineMode.ASYNC and self.pipeline.inflight_at_update is not InflightAtUpdate.ABORT_RESUME:
            raise FieldError("pipeline.inflight_at_update", "async colocated runs abort the requests in flight at each "
                             "of the trainer's turns and resume them after it; set it to abort_resume")
        if self.launcher is Launcher.POOL:
            raise FieldError("colocate.enabled", "a pool places and moves its jobs' engines itself; leave colocation "
                                                 "to it, or use launcher=local or slurm")
        if self.launcher is Launcher.SLURM:
            self._check_colocated_slurm()
        if self.rollout.engine is RolloutEngine.VLLM:
            raise FieldError("rollout.engine", "a colocated vLLM server would take the weights from a rank on its own "
                                               "GPU, and vLLM's ipc weight transfer is not wired yet; use sglang or builtin")
        if self.rollout.protocol is ServerProtocol.VLLM:
            release = self.colocate.server_release
            if "cuda_graph" in release or release == ["weights"]:
                raise FieldError("colocate.server_release", "vLLM's sleep puts the weights to sleep with the KV cache "
                                                            "and has no cuda_graph tag; use [kv_cache] or [kv_cache, weights]")
        if self.rollout.device is not self.train.device:
            raise FieldError("rollout.device", f"colocated servers share the trainer's devices ({self.train.device}); "
                                               f"set rollout.device={self.train.device}")
        if self.rollout.cpus != self.train.cpus:
            raise FieldError("rollout.cpus", "colocated servers and trainer ranks take turns on the same cores: set "
                                             "rollout.cpus = train.cpus, or leave both empty")
        if self.train.device is Device.CUDA:
            tp = self.rollout.server_tp
            if self.rollout.servers * tp != self.train.ranks:
                raise FieldError("rollout.servers", f"each GPU hosts one trainer rank and one server TP rank: set "
                                 f"rollout.servers x TP ({self.rollout.servers} x {tp}) = train.ranks ({self.train.ranks})")
            if self.train.gpus and len(self.train.gpus) != self.train.ranks:
                raise FieldError("train.gpus", f"colocated, each trainer rank has a GPU of its own, shared with a "
                                               f"server: list {self.train.ranks}, or leave it empty")
            if self.rollout.gpus != self.train.gpus:
                raise FieldError("rollout.gpus", f"colocated servers use the trainer's GPUs: set it to train.gpus "
                                                 f"({self.train.gpus})")
            if self.train.sync_backend not in (SyncBackend.AUTO, SyncBackend.IPC):
                raise FieldError("train.sync_backend", "a colocated server opens the trainer's weights on their GPU "
                                 "(NCCL refuses two ranks on one GPU); set it to ipc or auto")

    def _check_colocated_slurm(self) -> None:
        """One component whose every GPU hosts a trainer rank and a server TP rank (rlctl/launchers/
        slurm/placement.py): the servers of a node are its ranks' servers."""
        sl, tp, ranks = self.slurm, self.rollout.server_tp, self.train.ranks
        if self.rollout.servers * tp != ranks:
            raise FieldError("rollout.servers", f"colocated on Slurm, each trainer rank shares its GPU with a server TP "
                             f"rank: set rollout.servers x TP ({self.rollout.servers} x {tp}) = train.ranks ({ranks})")
        per_node = ranks // sl.trainer.nodes
        if sl.rollout.servers_per_node * tp != per_node:
            raise FieldError("slurm.rollout.servers_per_node", f"colocated, a node runs the servers of its {per_node} "
                             f"trainer rank(s): set it to {per_node // tp or 1}")
        if sl.rollout.nodes not in (0, sl.trainer.nodes) or sl.rollout.gpus_per_node or sl.rollout.mem:
            key = "slurm.rollout.nodes" if sl.rollout.nodes not in (0, sl.trainer.nodes) else (
                "slurm.rollout.gpus_per_node" if sl.rollout.gpus_per_node else "slurm.rollout.mem")
            raise FieldError(key, "colocated, the servers run on the trainer's nodes and GPUs (slurm.trainer.*); "
                                  "remove it")
        if self.train.device is Device.CUDA and sl.trainer.gpus_per_node not in (0, per_node):
            raise FieldError("slurm.trainer.gpus_per_node", f"colocated, each of a node's {per_node} trainer rank(s) "
                                                             f"takes one GPU: set it to {per_node}")

    def _check_ipc(self) -> None:
        """train.sync_backend=ipc hands weights over in place: one host, TP-1 built-in servers,
        on the trainer's device kind."""
        if self.train.sync_backend is not SyncBackend.IPC:
            return
        if self.rollout.engine is RolloutEngine.SGLANG and not self.colocate.enabled:  # it sees only its own GPUs
            raise FieldError("train.sync_backend", "ipc opens the trainer's tensors where the server runs, and an "
                             "SGLang server sees only its own GPUs (\"Invalid device_uuid\") unless colocated on the "
                             "trainer's; use nccl or auto, or colocate.enabled=true")
        if self.launcher is Launcher.SLURM and not self.colocate.enabled:
            raise FieldError("train.sync_backend", "ipc hands weights over within one host; with launcher=slurm "
                                                   "use nccl or gloo (or auto), or colocate.enabled=true")
        if self.rollout.engine is RolloutEngine.BUILTIN and self.rollout.builtin.tp_size != 1:
            raise FieldError("train.sync_backend", "ipc goes to TP-1 built-in servers; set rollout.builtin.tp_size=1 "
                                                   "or sync_backend=gloo")
        if self.rollout.engine is RolloutEngine.BUILTIN and self.rollout.device is not self.train.device:
            raise FieldError("train.sync_backend", f"ipc needs servers on the trainer's device ({self.train.device}), "
                                                   f"not {self.rollout.device}; set rollout.device or sync_backend=gloo")

    def _check_pinning(self) -> None:
        ncpu = len(os.sched_getaffinity(0))
        for key, cpus in (("rollout.cpus", self.rollout.cpus), ("train.cpus", self.train.cpus)):
            bad = [c for c in cpus if not 0 <= c < ncpu]
            if bad:
                raise FieldError(key, f"cores {bad} do not exist here (0..{ncpu - 1}); leave it empty to not pin")

    def _check_slurm_layout(self) -> None:
        sl, servers = self.slurm, self.rollout.servers
        if sl.rollout.nodes and sl.rollout.nodes * sl.rollout.servers_per_node != servers:
            raise FieldError("slurm.rollout.nodes", f"{sl.rollout.nodes} nodes x {sl.rollout.servers_per_node} servers "
                             f"per node != rollout.servers ({servers}); set nodes to 0 to derive it")
        divides("slurm.rollout.servers_per_node", sl.rollout.servers_per_node, "rollout.servers", servers,
                "every node runs the same number of servers")
        divides("slurm.trainer.nodes", sl.trainer.nodes, "train.ranks", self.train.ranks,
                "every node runs the same number of ranks")
        if self.rollout.cpus or self.train.cpus:
            key = "rollout.cpus" if self.rollout.cpus else "train.cpus"
            raise FieldError(key, "core pinning is for the local launcher; with launcher=slurm use slurm.*.cpus_per_task")
        if self.rollout.gpus or self.train.gpus:
            key = "rollout.gpus" if self.rollout.gpus else "train.gpus"
            raise FieldError(key, "GPU lists are for the local launcher; with launcher=slurm each task gets its own "
                                  "GPUs of those Slurm allocates (slurm.*.gpus_per_node)")
        per_server = self.rollout.server_tp
        need = sl.rollout.servers_per_node * per_server
        if self.rollout.on_gpus and sl.rollout.gpus_per_node and need > sl.rollout.gpus_per_node:
            raise FieldError("slurm.rollout.gpus_per_node", f"{sl.rollout.servers_per_node} servers per node x "
                             f"{per_server} GPUs each need {need} GPUs per node, {sl.rollout.gpus_per_node} are asked; "
                             "raise it or lower slurm.rollout.servers_per_node")


def slurm_rollout_nodes(recipe: Recipe) -> int:
    sl = recipe.slurm.rollout
    if recipe.colocate.enabled:  # the servers are on the trainer's nodes
        return recipe.slurm.trainer.nodes
    return sl.nodes or -(-recipe.rollout.servers // sl.servers_per_node)
