"""Launchers start a run's processes and end them: local.py (every role on this host, watched by
a supervisor process) and slurm/ (one heterogeneous Slurm job). health.py is the blocking /health
check both poll."""
