"""Launchers start a run's processes and end them, and say how a run stands: local.py (every
role on this host, watched by a supervisor process) and slurm/ (one heterogeneous Slurm job).
health.py is the blocking /health check both poll; liveness.py reads whether a run's processes
are alive; status.py is a run's state as `rlctl status`, `launch`'s follow, `cancel` and `resume`
read it."""
