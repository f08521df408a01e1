"""A Slurm job's state as rlctl shows and records it, in words a user can act on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Slurm's pending reason codes (squeue's Reason), in words.
PENDING_REASONS = {
    "Resources": "waiting for nodes to free up",
    "Priority": "other jobs have higher priority",
    "Dependency": "waiting for a job it depends on",
    "DependencyNeverSatisfied": "a job it depends on failed: it will never start",
    "BeginTime": "its start time has not come yet",
    "JobHeldUser": "held by its user (scontrol release)",
    "JobHeldAdmin": "held by an administrator",
    "ReqNodeNotAvail": "the nodes it needs are down, drained or reserved",
    "PartitionDown": "its partition is down",
    "PartitionInactive": "its partition is inactive",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionConfig": "it asks for more than the partition's configuration allows (nodes, CPUs or GPUs)",
    "PartitionTimeLimit": "its time limit is above the partition's",
    "QOSMaxGRESPerUser": "you are at your QOS's GPU limit",
    "QOSMaxJobsPerUserLimit": "you are at your QOS's running-job limit",
    "QOSMaxNodePerUserLimit": "you are at your QOS's node limit",
    "QOSMaxWallDurationPerJobLimit": "its time limit is above the QOS's",
    "AssocGrpGRES": "your account is at its GPU limit",
    "AssocGrpNodeLimit": "your account is at its node limit",
    "AssocMaxJobsLimit": "your account is at its job limit",
    "AssocGrpCPUMinutesLimit": "your account has used its CPU minutes",
    "InvalidAccount": "the account is not valid for you (check slurm.account)",
    "InvalidQOS": "the QOS is not valid for you (check slurm.qos)",
    "Reservation": "waiting for its reservation",
    "NodeDown": "a node it needs is down",
    "BadConstraints": "no nodes satisfy its constraints",
    "None": "just submitted",
}
# States in which a job still waits for its nodes or holds them.
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
          "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED"}


@dataclass
class JobInfo:
    """What Slurm said about a job, kept in run.json as `slurm.last` (Slurm forgets finished jobs)."""

    job_id: str
    """The job id sbatch gave; a heterogeneous job's components share it."""
    state: str
    """Slurm's state name: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ..."""
    reason: str = ""
    elapsed: str = ""
    nodes: list[str] = field(default_factory=list)
    """Node list per het component (trainer, rollout), in Slurm's compressed form."""
    exit_code: str = ""
    """Slurm's exit code, CODE:SIGNAL, once the job has ended."""
    states: list[str] = field(default_factory=list)
    """Each het component's state, in order (`state` is component 0's)."""

    @property
    def active(self) -> bool:
        """Until every component has ended: a het job's rollout component may still be
        COMPLETING (its processes being killed) after its trainer component is CANCELLED."""
        return any(state in ACTIVE for state in (self.states or [self.state]))

    def describe(self) -> str:
        """One line in words: PENDING with why, RUNNING with where and how long, or how it ended."""
        if self.state == "PENDING":
            return f"PENDING: {PENDING_REASONS.get(self.reason, self.reason or 'queued')}"
        if self.active and self.state not in ACTIVE:  # component 0 has ended, another has not yet
            return f"{self.state}, its other components {' | '.join(s for s in self.states[1:] if s in ACTIVE)}"
        if self.active:
            where = " | ".join(self.nodes)
            return f"{self.state} on {where} for {self.elapsed}" if where else self.state
        code = f" (exit code {self.exit_code})" if self.exit_code else ""
        return f"{self.state}{code}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
