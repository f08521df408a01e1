"""The Slurm launcher: a run is one heterogeneous Slurm job.

    script.py     the batch script, rendered from the recipe (a pure function)
    client.py     Slurm's command-line client: sbatch, squeue, scontrol, sacct, scancel
    job.py        a job's state as rlctl records and describes it
    reconcile.py  the run's state in run.json joined with its job's
    steps.py      the steps the batch script runs besides the roles (plan, health, state, ...),
                  on the job's first node

Callers use the names below: `from rlctl.launchers import slurm`.
"""

from rlctl.launchers.slurm.client import cancel, query, submit
from rlctl.launchers.slurm.job import ACTIVE, PENDING_REASONS, JobInfo
from rlctl.launchers.slurm.reconcile import job_id_of, needs_query, reconcile, refresh
from rlctl.launchers.slurm.script import render_batch_script

__all__ = ["ACTIVE", "PENDING_REASONS", "JobInfo", "cancel", "job_id_of", "needs_query", "query", "reconcile",
           "refresh", "render_batch_script", "submit"]
