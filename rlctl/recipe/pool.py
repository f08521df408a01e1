"""A pool file (`rlctl pool up POOL.yaml`, `rlctl simulate POOL.yaml`) and a run's `pool:` section.

A pool is a long-lived set of devices that several runs share (rlctl/plex/). Its file says what
the devices are and how they are sliced; `jobs:` lists runs for `rlctl simulate` of the pool and
for benchmarks (a live pool takes its jobs as they attach: `launcher: pool` in their recipes).

    pool:
      name: lab
      devices: {kind: cpu, count: 2, cpus_per_device: 1, memory_gb: 2}
      quantum_s: 5
    jobs:
      - {recipe: quickstart.yaml, overrides: [pipeline.mode=sync], share: 1}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlctl.recipe.checks import FieldError, Section, at_most, within
from rlctl.recipe.choices import Device, GpuKind, Launcher


MAX_SHARE = 1000.0
"""A job's share of contended devices at most (1000x another job's time is as good as all of it)."""
MAX_MEMORY_GB = 10_000.0
"""Memory figures of a pool (per device, per engine) at most: 10 TB, past any device or host."""


@dataclass(kw_only=True)
class PoolDevices(Section):
    kind: Device = Device.CPU
    """cpu: each device is a set of cores; cuda: each device is one GPU."""
    count: int = 2
    """How many devices the pool has."""
    cpus_per_device: int = 1
    """cpu: device i is cores [i * cpus_per_device, (i + 1) * cpus_per_device)."""
    gpus: list[int] = field(default_factory=list)
    """cuda: the GPUs that are the devices (empty: 0 .. count - 1)."""
    memory_gb: float = 0.0
    """What the scheduler lets the models on one device hold at once (0: the GPU's memory; on CPU,
    the host's memory divided among the devices)."""

    def check(self) -> None:
        if self.count < 1:
            raise FieldError("count", f"must be >= 1, got {self.count}")
        if self.cpus_per_device < 1:
            raise FieldError("cpus_per_device", f"must be >= 1, got {self.cpus_per_device}")
        if self.gpus and len(self.gpus) != self.count:
            raise FieldError("gpus", f"lists {len(self.gpus)} GPUs for count={self.count} devices; list one per device")
        if self.gpus and self.kind is not Device.CUDA:
            raise FieldError("gpus", "GPU lists are for kind=cuda")
        at_most("count", self.count, 65_536)
        at_most("cpus_per_device", self.cpus_per_device, 4096)
        within("memory_gb", self.memory_gb, 0.0, MAX_MEMORY_GB)


POOL_SBATCH_MANAGED = {
    "--job-name": ("-J", "pool.name"), "--output": ("-o", "the pool's directory (logs/pool.log)"),
    "--error": ("-e", "the pool's directory (logs/pool.log)"), "--open-mode": ("", "the pool's directory"),
    "--nodes": ("-N", "pool.slurm.nodes"), "--ntasks": ("-n", "the pool's service"),
    "--ntasks-per-node": ("", "the pool's service"), "--gpus-per-node": ("", "pool.slurm.gpus_per_node"),
    "--partition": ("-p", "pool.slurm.partition"), "--account": ("-A", "pool.slurm.account"),
    "--qos": ("-q", "pool.slurm.qos"), "--time": ("-t", "pool.slurm.time"),
    "--requeue": ("", "the pool (never requeued)"), "--no-requeue": ("", "the pool (never requeued)"),
}
"""sbatch flags a pool's batch script sets itself (rlctl/launchers/pool/slurm.py), as
cluster.SBATCH_MANAGED says them for a run's."""


@dataclass(kw_only=True)
class PoolSlurm(Section):
    """launcher=slurm: the pool is one Slurm job of `nodes` nodes. Its service runs on the first
    node; each run's engines are steps of the job (srun --overlap) on the nodes their devices are
    on. The devices are spread evenly: device i is on node i // (count / nodes)."""

    nodes: int = 1
    """Nodes of the pool's job; the devices are spread evenly over them."""
    time: str = "1-00:00:00"
    """The pool's time limit, in any of Slurm's forms: the runs in it end with it."""
    partition: str = ""
    """sbatch --partition; empty = the cluster's default."""
    account: str = ""
    """sbatch --account; empty = the user's default."""
    qos: str = ""
    """sbatch --qos; empty = the cluster's default."""
    gpus_per_node: int = 0
    """--gpus-per-node (kind cuda: 0 asks for the pool's devices per node)."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra sbatch flags, e.g. ["--exclusive"]."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run first on the first node (module load, source venv/bin/activate)."""
    python: str = ""
    """The nodes' Python (as slurm.python of a recipe); empty: the one of `rlctl pool up`."""
    port_base: int = 21000
    """The runs' engines listen on ports from here up, on their nodes."""

    def check(self) -> None:
        from rlctl.recipe.cluster import check_job_lines

        if self.nodes < 1:
            raise FieldError("nodes", f"must be >= 1, got {self.nodes}")
        at_most("nodes", self.nodes, 16_384)
        within("gpus_per_node", self.gpus_per_node, 0, 64)
        check_job_lines(self, POOL_SBATCH_MANAGED)
        if not 1024 <= self.port_base <= 60000:
            raise FieldError("port_base", f"must be in 1024..60000, got {self.port_base}")


@dataclass(kw_only=True)
class PoolSimConfig(Section):
    """`rlctl simulate` of a pool: the GPUs, and what moving a model costs."""

    gpu: GpuKind = GpuKind.H200
    """The GPU kind the cost model prices (h200, h100, a100, cpu)."""
    gpus: int = 64
    """GPUs of the simulated pool."""
    host_bytes_per_s: float = 25e9
    """Device <-> host copy rate per GPU when a model is offloaded or restored (PCIe Gen5 x16 is
    64 GB/s; eight GPUs of a node share the host's links, so a sustained 25 GB/s each)."""
    move_overhead_s: float = 0.2
    """Fixed cost of one state change (release or resume: pausing the engine, remapping memory)."""
    activation_gb: float = 20.0
    """Trainer working memory besides gradients and optimizer state, per GPU."""

    def check(self) -> None:
        if self.gpus < 1:
            raise FieldError("gpus", f"must be >= 1, got {self.gpus}")
        at_most("gpus", self.gpus, 65_536)
        within("host_bytes_per_s", self.host_bytes_per_s, 0.0, 1e13, open_low=True)  # 10 TB/s
        within("move_overhead_s", self.move_overhead_s, 0.0, 3600.0)
        within("activation_gb", self.activation_gb, 0.0, MAX_MEMORY_GB)


@dataclass(kw_only=True)
class PoolSpec(Section):
    name: str = "pool"
    """The pool's name: runs attach with pool.name=NAME, and its directory is output_dir/NAME."""
    output_dir: str = "pools"
    """Where the pool's directory (state, events, logs, token) is made: on a Slurm pool, a
    filesystem the nodes share."""
    launcher: Launcher = Launcher.LOCAL
    """local: the pool's service and engines run on this host; slurm: on a Slurm allocation
    (`slurm:`), its service on the first node."""
    devices: PoolDevices = field(default_factory=PoolDevices)
    slurm: PoolSlurm = field(default_factory=PoolSlurm)
    quantum_s: float = 5.0
    """A device's time slice: once a job has held a device this long (times its share) while
    another waits, its new generates there wait for the other's turn."""
    lease_s: float = 60.0
    """A slice a run holds is a lease: the run's controller renews it every lease_s / 4 while its
    call runs. One not renewed for lease_s (a frozen run, a client that keeps its slice) is taken
    back, so that the other runs go on; `rlctl pool status` shows who holds what, for how long."""
    switch_overhead: float = 0.1
    """The largest fraction of a device's time spent moving models to hand it from one job to
    another: a turn lasts at least the moves its switch needs (as measured last time) / this."""
    overlap_syncs: bool = True
    """cpu: a weight sync whose models are already in memory runs beside the devices' holders
    instead of waiting for both sides' devices to be free (it copies bytes, it barely computes).
    A GPU pool always gives a sync its devices: its buckets take memory the cap does not count."""
    warm_start: bool = True
    """Fork the runs' engine processes from one that has imported torch and the engines already
    (rlctl/launchers/pool/warm.py), instead of starting each cold: seconds of CPU less per
    process, spent where the other runs compute. false: start each as a run of its own does."""

    def check(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name) or self.name.startswith("."):
            raise FieldError("name", f"'{self.name}' must be letters, digits, '-', '_' or '.', not starting with '.'")
        within("quantum_s", self.quantum_s, 0.0, 86_400.0, open_low=True)
        within("lease_s", self.lease_s, 1.0, 86_400.0)
        if not 0 < self.switch_overhead <= 1:
            raise FieldError("switch_overhead", f"must be in (0, 1], got {self.switch_overhead}")
        if self.launcher is Launcher.POOL:
            raise FieldError("launcher", "a pool runs on local or slurm")
        if self.launcher is Launcher.SLURM:
            if self.devices.count % self.slurm.nodes:
                raise FieldError("devices.count", f"{self.devices.count} devices do not spread evenly over "
                                 f"slurm.nodes={self.slurm.nodes}; make count a multiple of the nodes")
            if self.devices.gpus:
                raise FieldError("devices.gpus", "a Slurm pool uses the GPUs Slurm gives each node; leave it empty")

    def devices_per_node(self) -> int:
        return self.devices.count // self.slurm.nodes if self.launcher is Launcher.SLURM else self.devices.count


@dataclass(kw_only=True)
class PoolJob(Section):
    recipe: str = ""
    """A recipe file, relative to the pool file."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides of the recipe, as on `rlctl launch`'s command line."""
    share: float = 1.0
    """Its share of contended devices, as a run's pool.share."""
    name: str = ""
    """Its name in tables (default: the recipe's run.name and its index)."""

    def check(self) -> None:
        if not self.recipe:
            raise FieldError("recipe", "name a recipe file")
        within("share", self.share, 0.0, MAX_SHARE, open_low=True)


@dataclass(kw_only=True)
class PoolFile(Section):
    pool: PoolSpec = field(default_factory=PoolSpec)
    sim: PoolSimConfig = field(default_factory=PoolSimConfig)
    jobs: list[PoolJob] = field(default_factory=list)


@dataclass(kw_only=True)
class PoolConfig(Section):
    """A run's `pool:` section: with `launcher: pool`, the pool it attaches to."""

    name: str = ""
    """The pool to attach to, as `rlctl pool up` named it; required with launcher=pool."""
    dir: str = "pools"
    """Where pools' directories are (a pool is `DIR/NAME`)."""
    share: float = 1.0
    """Its share of contended devices (2: twice the device time of a share-1 job), in (0, 1000]."""
    rollout_memory_gb: float = 0.0
    """What one rollout server holds on its device when active (0: estimated from the weights,
    rlctl/launchers/pool/jobs.py). Set it from a dedicated run's peak when the estimate is short."""
    trainer_memory_gb: float = 0.0
    """The same for one trainer rank."""

    def check(self) -> None:
        within("share", self.share, 0.0, MAX_SHARE, open_low=True)
        for key in ("rollout_memory_gb", "trainer_memory_gb"):
            within(key, getattr(self, key), 0.0, MAX_MEMORY_GB)
