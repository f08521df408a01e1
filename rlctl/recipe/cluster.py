"""The sections about where a run goes and who watches it: slurm, sim (the simulated cluster),
tracking."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field

from rlctl.recipe.checks import FieldError, Section, at_most, divides, positive, within
from rlctl.recipe.choices import GpuKind, WandbMode
from rlctl.recipe.sbatch_flags import managed_flag
from rlctl.recipe.secret_names import secret_name

_SLURM_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE)$")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,:+-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Upper bounds no real run reaches, so that a typo is an error and not a job that asks for a whole
# cluster (or a simulation that never ends): nodes per component 16,384, GPUs per node 64, CPUs per
# task 4,096, servers per node 64, the health timeout a week; the simulated cluster 65,536 GPUs
# per side, tp 64, 2^20 tokens of prompt or context, models of 100,000 B parameters.
NODE_BOUNDS = {"nodes": 16_384, "gpus_per_node": 64, "cpus_per_task": 4096, "servers_per_node": 64}
SIM_BOUNDS = {"rollout_gpus": 65_536, "trainer_gpus": 65_536, "tp": 64, "train_tp": 64, "train_pp": 1024,
              "prompt_tokens": 1 << 20, "context_tokens": 1 << 20, "params_b": 100_000.0, "layers": 1024,
              "kv_dim": 1 << 20, "hidden": 1 << 20, "vocab": 1 << 24}
SBATCH_MANAGED = {
    "--job-name": ("-J", "run.name"), "--output": ("-o", "the run directory (logs/slurm-%j.out)"),
    "--error": ("-e", "the run directory (logs/slurm-%j.out)"), "--open-mode": ("", "the run directory"),
    "--nodes": ("-N", "slurm.trainer.nodes and slurm.rollout.nodes"),
    "--ntasks": ("-n", "train.ranks and rollout.servers"),
    "--ntasks-per-node": ("", "train.ranks and slurm.rollout.servers_per_node"),
    "--gpus-per-node": ("", "slurm.trainer.gpus_per_node and slurm.rollout.gpus_per_node"),
    "--cpus-per-task": ("-c", "slurm.trainer.cpus_per_task and slurm.rollout.cpus_per_task"),
    "--mem": ("", "slurm.trainer.mem and slurm.rollout.mem"), "--partition": ("-p", "slurm.partition"),
    "--account": ("-A", "slurm.account"), "--qos": ("-q", "slurm.qos"), "--time": ("-t", "slurm.time"),
    "--signal": ("", "slurm.signal_before_s"), "--requeue": ("", "slurm.requeue"),
    "--no-requeue": ("", "slurm.requeue"), "--het-group": ("", "the batch script"),
}
"""sbatch flags the batch script of a run sets itself (rlctl/launchers/slurm/script.py), with their
short forms and what sets them instead: a recipe's slurm.sbatch_args may not set them."""


def slurm_time_seconds(time: str) -> int | None:
    """A Slurm time limit in seconds (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS); None when
    unlimited. Assumes the form was checked against _SLURM_TIME."""
    if time in ("UNLIMITED", "INFINITE"):
        return None
    days, _, rest = time.rpartition("-") if "-" in time else ("0", "", time)
    parts = [int(x) for x in rest.split(":")]
    if "-" in time:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:  # MM, MM:SS, HH:MM:SS
        hours, minutes, seconds = ([0] + parts if len(parts) < 3 else parts) if len(parts) > 1 else (0, parts[0], 0)
    return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds


def check_job_lines(section: Section, managed: dict[str, tuple[str, str]]) -> None:
    """A Slurm section's names, time, sbatch_args, setup lines and python (a run's, a pool's);
    `managed`: the sbatch flags its batch script sets itself (long flag -> (short flag, what sets it))."""
    for name in ("partition", "account", "qos"):
        _slurm_name(name, getattr(section, name))
    if not _SLURM_TIME.match(section.time):
        raise FieldError("time", f"'{section.time}' is not a Slurm time limit; use MM, HH:MM:SS or D-HH:MM:SS")
    flags = {**{long: long for long in managed}, **{short: long for long, (short, _) in managed.items() if short}}
    for i, arg in enumerate(section.sbatch_args):
        if not arg.startswith("-") or "\n" in arg:
            raise FieldError(f"sbatch_args[{i}]", f"'{arg}' is not an sbatch flag; write flags like --exclusive or --constraint=h200")
        flag = managed_flag(arg, flags)
        if flag is not None:
            long = flags[flag]
            named = long if flag == long else f"{flag} ({long})"
            raise FieldError(f"sbatch_args[{i}]", f"'{arg}' sets {named}, which is set by rlctl from "
                                                  f"{managed[long][1]}; remove it")
    for i, line in enumerate(section.setup):
        if "\n" in line:
            raise FieldError(f"setup[{i}]", "one shell line per list item")
    if "\n" in section.python or "\0" in section.python:
        raise FieldError("python", "a path or a command name, on one line")


def _check_env(name: str, value: str) -> None:
    key = f"env.{name}"
    if not _ENV_NAME.match(name):
        raise FieldError(key, "not a shell variable name; letters, digits and _, not starting with a digit")
    if name in ("CUDA_VISIBLE_DEVICES", "RLCTL_LOGS") or name.startswith("SLURM_"):
        raise FieldError(key, "set by Slurm or rlctl in the job (GPUs come from slurm.*.gpus_per_node)")
    if secret_name(name):
        raise FieldError(key, "looks like a secret, and a recipe is copied into the run directory; export it "
                              "in the shell that runs `rlctl launch` instead (sbatch passes that environment on)")
    if "\n" in value or "\0" in value:
        raise FieldError(key, "one line, without NUL characters")


def _bounded(section: Section) -> None:
    for name, high in NODE_BOUNDS.items():
        if hasattr(section, name):
            at_most(name, getattr(section, name), high)


def _slurm_name(key: str, value: str) -> None:
    if not _SLURM_NAME.match(value):
        raise FieldError(key, f"'{value}' has characters Slurm names do not use; letters, digits and _.,:+- only")


@dataclass(kw_only=True)
class SlurmTrainerConfig(Section):
    """Heterogeneous-job component 0: the trainer ranks (and the controller, on the first node)."""

    nodes: int = 1
    """Nodes of this component; train.ranks are spread evenly over them."""
    gpus_per_node: int = 0
    """GPUs to request per node (--gpus-per-node); 0 = none. Every rank sees all of its node's
    GPUs and takes the one its rank points at (rank r on GPU r mod the node's GPU count)."""
    cpus_per_task: int = 0
    """--cpus-per-task for each trainer rank (sbatch and srun); 0 = 4 per GPU of a rank
    (gpus_per_node / ranks per node, at least 1), or run.threads_per_process without GPUs."""
    mem: str = ""
    """--mem per node, e.g. 200G; empty = all of the node's memory (--mem=0) when the component asks
    for GPUs (loading a model takes host memory in proportion to the model), else the cluster's
    default. Set it when GPU nodes are shared between jobs."""

    def check(self) -> None:
        positive("nodes", self.nodes)
        positive("gpus_per_node", self.gpus_per_node, zero_ok=True)
        positive("cpus_per_task", self.cpus_per_task, zero_ok=True)
        _bounded(self)
        _slurm_name("mem", self.mem)


@dataclass(kw_only=True)
class SlurmRolloutConfig(Section):
    """Heterogeneous-job component 1: the rollout servers."""

    nodes: int = 0
    """0 = rollout.servers / servers_per_node."""
    servers_per_node: int = 1
    """Rollout servers per node (one per TP group of the node's GPUs)."""
    gpus_per_node: int = 0
    """GPUs to request per node (--gpus-per-node); 0 = none. Each server is bound to its own: its
    rollout.sglang.tp_size GPUs (SGLang) or 1 (the built-in server), taken in order of the
    CUDA_VISIBLE_DEVICES Slurm gives the node's tasks (rlctl/launchers/slurm/script.py)."""
    cpus_per_task: int = 0
    """--cpus-per-task for each server (sbatch and srun); 0 = 4 per GPU of a server, or
    run.threads_per_process for a server without GPUs."""
    mem: str = ""
    """--mem per node; empty = all of the node's memory (--mem=0) when the component asks for
    GPUs, else the cluster's default. Set it when GPU nodes are shared between jobs."""

    def check(self) -> None:
        positive("servers_per_node", self.servers_per_node)
        for name in ("nodes", "gpus_per_node", "cpus_per_task"):
            positive(name, getattr(self, name), zero_ok=True)
        _bounded(self)
        _slurm_name("mem", self.mem)


@dataclass(kw_only=True)
class SlurmConfig(Section):
    """launcher=slurm: the run is one heterogeneous Slurm job (trainers | rollout servers).

    It is checked whatever the launcher, so a typo shows before a cluster run; how it fits the
    rollout and train sections is checked only for launcher=slurm (rlctl/recipe/schema.py)."""

    partition: str = ""
    """sbatch --partition; empty = the cluster's default."""
    account: str = ""
    """sbatch --account; empty = the user's default."""
    qos: str = ""
    """sbatch --qos; empty = the cluster's default."""
    time: str = "01:00:00"
    """Time limit, in any of Slurm's forms (MM, HH:MM:SS, D-HH:MM ...)."""
    trainer: SlurmTrainerConfig = field(default_factory=SlurmTrainerConfig)
    rollout: SlurmRolloutConfig = field(default_factory=SlurmRolloutConfig)
    sbatch_args: list[str] = field(default_factory=list)
    """Extra sbatch flags for both components, e.g. ["--exclusive", "--constraint=h200"]: one
    #SBATCH line each. A flag the batch script sets itself (--job-name, --output, --error, --nodes,
    --ntasks[-per-node], --gpus-per-node, --cpus-per-task, --mem, --partition, --account, --qos,
    --time, --signal, --[no-]requeue) is refused in any form sbatch reads (-N5, -o/tmp/x,
    --out=x, two flags in one item): set it by its own key."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run at the start of the job, e.g. "module load cuda/12.4", "source venv/bin/activate";
    every process of the job inherits the environment they leave."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every process of the job, e.g. {NCCL_SOCKET_IFNAME: ib0,
    NCCL_IB_HCA: mlx5}: exported after the setup lines (so they win over what a module sets).
    Not for secrets (a recipe is copied into the run directory): export those in the shell that
    runs `rlctl launch`, whose environment sbatch passes to the job."""
    python: str = ""
    """The Python on the compute nodes, a path or a command name. Empty = `python3` as found on
    PATH after the setup lines run, or, without setup lines, the one that runs `rlctl launch`
    (a shared filesystem)."""
    port_base: int = 0
    """First port the run's servers listen on; 0 = 20000 + job id x (its port count rounded up to 8)
    mod 40000, so that jobs sharing a node (a sweep's, with consecutive ids) never share a port."""
    health_timeout_s: int = 600
    """How long the job waits for every rollout server's /health before it gives up."""
    requeue: bool = True
    """Survive the time limit: Slurm signals the job signal_before_s before it (--signal), the run
    writes a checkpoint at the end of the step in progress, and the job requeues itself; the new
    attempt (like one Slurm requeues after a node failure) continues from the newest checkpoint.
    Slurm holds a requeued job for its credential lifetime (AuthInfo cred_expire, 120 s by
    default) before it can start again. false: the job ends at its time limit."""
    signal_before_s: int = 300
    """How long before the time limit the warning comes: enough for one step and a checkpoint.
    Slurm sends it up to a minute early (it looks at time limits every 30 s or so)."""
    max_requeues: int = 20
    """The most attempts a run requeues itself after the first; an attempt that ends without a
    newer checkpoint than the one it started from is not requeued either (no progress)."""

    def check(self) -> None:
        check_job_lines(self, SBATCH_MANAGED)
        positive("health_timeout_s", self.health_timeout_s)
        positive("signal_before_s", self.signal_before_s)
        at_most("signal_before_s", self.signal_before_s, 65535, "(Slurm's --signal limit)")
        limit = slurm_time_seconds(self.time)
        if self.requeue and limit is not None and self.signal_before_s >= limit:
            raise FieldError("signal_before_s", f"{self.signal_before_s} s is not before the time limit "
                             f"(slurm.time={self.time}, {limit} s); lower it or raise slurm.time")
        positive("max_requeues", self.max_requeues, zero_ok=True)
        at_most("max_requeues", self.max_requeues, 1000)
        at_most("health_timeout_s", self.health_timeout_s, 7 * 86400, "(a week)")
        positive("port_base", self.port_base, zero_ok=True)
        if self.port_base and not 1024 <= self.port_base <= 65000:
            raise FieldError("port_base", f"{self.port_base} is outside 1024..65000; use 0 to derive it from the job id")
        for name, value in self.env.items():
            _check_env(name, value)


@dataclass(kw_only=True)
class SimToolsConfig(Section):
    """Simulated tool calls, for a recipe with rollout.multi_turn.enabled (the simulation has no
    text to parse): each model turn but the last calls a tool with chance `call_prob`; each
    call takes a lognormal number of seconds (median latency_median_s, log-sd latency_sigma),
    capped at rollout.multi_turn.tool_timeout_s, and its result adds result_tokens tokens."""

    call_prob: float = 0.5
    """Chance that a model turn calls a tool, in [0, 1]."""
    latency_median_s: float = 1.0
    """Median seconds of a tool call (a sandboxed code run: about a second; a search: a few)."""
    latency_sigma: float = 1.0
    """Log-standard-deviation of a call's seconds, in [0, 5]: 1 puts the p90 at 3.6x the median."""
    result_tokens: int = 64
    """Tokens of a tool's result, appended to the trajectory (prefilled by the next turn)."""

    def check(self) -> None:
        within("call_prob", self.call_prob, 0.0, 1.0)
        within("latency_median_s", self.latency_median_s, 0.0, 3600.0)
        within("latency_sigma", self.latency_sigma, 0.0, 5.0)
        within("result_tokens", self.result_tokens, 0, 1 << 20)


@dataclass(kw_only=True)
class SimConfig(Section):
    """`rlctl simulate`: the cluster and model the cost model prices (rlctl/costs/model.py)."""

    gpu: GpuKind = GpuKind.H200
    """h200 | h100 | a100 | cpu"""
    params_b: float = 0.0
    """Model size in billions of parameters (bf16); 0 = the recipe's own model (model.init, or the
    config.json at model.path), or 1.7 when neither is there."""
    rollout_gpus: int = 8
    """GPUs of the simulated rollout servers."""
    trainer_gpus: int = 8
    """GPUs of the simulated trainer."""
    tp: int = 1
    """GPUs per rollout server; the simulation has rollout_gpus / tp servers."""
    train_tp: int = 1
    """The trainer's tensor-parallel size (GPUs of one node)."""
    train_pp: int = 1
    """The trainer's pipeline-parallel size; data parallel is trainer_gpus / (train_tp x train_pp)."""
    colocated: bool = False
    """Rollout and training time-share the same GPUs (rollout_gpus = trainer_gpus; sync mode)."""
    prompt_tokens: int = 256
    """Tokens of each prompt (prefill work, and the start of each request's KV cache)."""
    context_tokens: int = 0
    """Mean tokens of context a decoding request holds (its KV cache read per step); 0 = the
    prompt plus a running response's mean length so far, from rollout.sampling's lengths."""
    layers: int = 0
    """Transformer layers, for the KV-cache size (0 = estimate from params_b)."""
    kv_dim: int = 0
    """KV heads x head dim, for the KV-cache size (0 = estimate)."""
    hidden: int = 0
    """Hidden size, for activations and tensor-parallel traffic (0 = estimate: 128 x layers)."""
    vocab: int = 0
    """Vocabulary size, for the logits' memory (0 = 128k)."""
    reward_rate: float = 0.5
    """Chance that a simulated sample is right (drives dynamic sampling's drop rate)."""
    dataset_prompts: int = 0
    """Distinct prompts the simulated run reads, epoch after epoch, each reshuffled, as a dataset
    is read (what rollout.sampling.long_tail.prompt_share and pipeline.admission=longest see
    again); 0: a new prompt for every group, as a built-in task makes them."""
    mfu_train: float = 0.4
    """Share of the GPU's peak bf16 FLOP/s that training reaches, in (0, 10] (a calibration against a
    CPU's guessed peak may pass 1)."""
    mfu_prefill: float = 0.5
    """Share of the GPU's peak bf16 FLOP/s that prefill reaches."""
    decode_bw_efficiency: float = 0.7
    """Share of the GPU's peak memory bandwidth that a decode step reaches."""
    decode_step_overhead_s: float = 0.0
    """Fixed seconds per decode step that the roofline misses (scheduler, kernel launches); calibration sets
    it."""
    train_step_overhead_s: float = 0.0
    """Fixed seconds per optimizer step that the roofline misses (optimizer, gradient all-reduce latency);
    calibration sets it."""
    layer_launch_s: float = 2e-4
    """Fixed seconds per layer and training micro-batch: some 40 kernel launches forward and
    backward at ~5 us each; calibration sets it."""
    tools: SimToolsConfig = field(default_factory=SimToolsConfig)
    """rollout.multi_turn: how often the simulated model calls a tool and how long tools take."""

    def check(self) -> None:
        for name in ("params_b", "context_tokens", "layers", "kv_dim", "hidden", "vocab", "dataset_prompts"):
            positive(name, getattr(self, name), zero_ok=True)
        for name in ("rollout_gpus", "trainer_gpus", "tp", "train_tp", "train_pp", "prompt_tokens"):
            positive(name, getattr(self, name))
        for name, high in SIM_BOUNDS.items():
            at_most(name, getattr(self, name), high)
        # Shares of a peak, but one calibrated against a CPU's guessed peak may pass 1.
        for name in ("mfu_train", "mfu_prefill", "decode_bw_efficiency"):
            within(name, getattr(self, name), 0.0, 10.0, open_low=True)
        for name in ("decode_step_overhead_s", "train_step_overhead_s"):
            within(name, getattr(self, name), 0.0, 3600.0)
        within("layer_launch_s", self.layer_launch_s, 0.0, 10.0)
        divides("tp", self.tp, "sim.rollout_gpus", self.rollout_gpus, "pick a tp that divides it")
        divides("train_tp", self.train_tp * self.train_pp, "sim.trainer_gpus", self.trainer_gpus,
                "train_tp x train_pp must divide it")
        if self.colocated and self.rollout_gpus != self.trainer_gpus:
            raise FieldError("colocated", f"colocated rollout and training share their GPUs: set rollout_gpus = "
                             f"trainer_gpus (now {self.rollout_gpus} and {self.trainer_gpus})")
        within("reward_rate", self.reward_rate, 0.0, 1.0)


@dataclass(kw_only=True)
class WandbConfig(Section):
    """Weights & Biases: the resolved recipe as config, every step's metrics (the names of
    metrics.jsonl), and a summary at the end. `offline` writes into the run directory."""

    mode: WandbMode = WandbMode.DISABLED
    """disabled | offline | online"""
    project: str = "rlctl"
    """The wandb project."""
    entity: str = ""
    """The wandb team or user; empty = wandb's default for the logged-in user."""
    group: str = ""
    """The wandb group the run is shown in; empty = none."""
    tags: list[str] = field(default_factory=list)
    """wandb tags of the run."""

    def missing_here(self) -> str | None:
        """Why wandb cannot log from this machine (it is not installed), or None. Asked where the
        controller logs from: this machine (Recipe.check), or for launcher=slurm the job's first
        node (rlctl/launchers/slurm/steps.py), so the submitting machine needs no wandb."""
        if self.mode is not WandbMode.DISABLED and importlib.util.find_spec("wandb") is None:
            return "wandb is not installed: pip install 'rlctl[wandb]', or set it to disabled"
        return None


@dataclass(kw_only=True)
class TrackingConfig(Section):
    wandb: WandbConfig = field(default_factory=WandbConfig)
