"""Observability: what a step costs and what a run did.

    metrics.py    model FLOPs, MFU, metrics.jsonl and TensorBoard
    memory.py     memory per device: a compiled step's need against the device's limit
    hlo.py        collectives (and their bytes) read from compiled HLO
    profiling.py  `log.profile_steps`: a jax.profiler trace of chosen steps
    progress.py   the progress bar and the SIGTERM/SIGINT stop flag
    pictures.py   matplotlib pictures of layouts and pipeline tables
"""
