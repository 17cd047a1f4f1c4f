"""Checkpoints: save, resume, restore onto any mesh, never lose a run's work.

    checkpointer.py  Orbax: async saves, exact resume, restore onto any mesh, atomic steps
    resume.py        how a run takes up its checkpoint.dir: compatibility, where to continue
    dirlock.py       one writer per checkpoint.dir
    save_faults.py   a full disk as one line; Orbax's abandoned I/O kept off the terminal
"""
