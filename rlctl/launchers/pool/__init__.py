"""A live pool (`rlctl pool up`): one long-lived service on this host that starts the engines of
the runs attached to it (`launcher: pool`) on its devices and schedules their calls
(rlctl/plex/scheduler.py). pooldir.py: its directory; service.py: the service; jobs.py: one
attached run's processes and model moves; client.py: how a run and the CLI talk to it."""
