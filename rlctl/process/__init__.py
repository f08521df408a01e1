"""What every process of a run shares, below the engines and the launchers:

    auth.py       the run's token and the door every endpoint keeps (docs/security.md)
    topology.py   which processes a run has and where they listen
    devices.py    which GPUs a process uses
    lifetime.py   a process that dies with its parent
    watchdog.py   deadlines on the calls to the trainer and the controller's liveness
"""
