"""A run as files: the run directory that is its source of truth, and what reads and writes it.

    dir.py         the run directory (recipe, run.json, events.jsonl, metrics.jsonl, logs, checkpoints)
    ids.py         run ids and the directory each names
    find.py        a run found by path, id or name; every run of an output directory
    check.py       what a run.json must hold before anything reads it
    tail.py        the end of a large, growing file (a log, metrics.jsonl)
    checkpoint.py  a step's checkpoint: what it holds, saving it whole, finding the newest good one
    manifest.py    a checkpoint's files with their sizes and hashes, checked before loading
    samples.py     samples.jsonl read back (`rlctl samples`)
    evals.py       eval.jsonl read back: each held-out set's first and latest evaluation
    step_records.py  metrics.jsonl read back, one record per step (what compare reads)
    compare.py     two or more runs side by side (`rlctl compare`)
    sweep.py       one recipe over a grid of overrides and seeds
    tracking.py    experiment trackers (wandb) fed a copy of what the run directory holds
"""
