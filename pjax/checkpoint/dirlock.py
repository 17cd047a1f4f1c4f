"""One writer per checkpoint directory: an `fcntl.flock` on `<dir>/.pjax-lock` held for a training run's
whole life (ARCHITECTURE.md, "One writer per checkpoint directory"). The file is never deleted
(unlinking a lock file races with a run opening it); it holds the holder's pid and host for the error."""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys

import jax
import numpy as np

from mesh.errors import ConfigError

LOCK_NAME = ".pjax-lock"
# A file system without advisory locks answers with one of these; the run goes on with a warning.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


class DirectoryLock:
    """An exclusive, non-blocking lock on `directory` (which must exist), held until `release`."""

    def __init__(self, directory: str, key: str = "checkpoint.dir") -> None:
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip()
            self.release()
            raise ConfigError(f"{key}={directory} is in use by another run ({holder or 'it has just started'}): "
                              f"wait for it or stop it, or use another {key}.") from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                self.release()
                raise
            self.release()
            print(f"warning: {key}={directory} is on a file system without file locks ({e.strerror}); make sure "
                  f"no other run saves into it at the same time.", file=sys.stderr, flush=True)
            return
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Close the file, which drops the lock (a second call does nothing)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def take_run_lock(directory: str, given: str) -> DirectoryLock | None:
    """Process 0 locks `directory` for writing, and every process learns whether it did, to stop together."""
    lock, refusal = None, None
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        try:
            lock = DirectoryLock(directory)
        except ConfigError as e:
            refusal = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if int(multihost_utils.broadcast_one_to_all(np.int32(refusal is None))) == 0 and refusal is None:
            refusal = ConfigError(f"checkpoint.dir={given} is in use by another run (process 0 found it locked); wait "
                                  f"for that run to end or stop it, or point checkpoint.dir at another directory.")
    if refusal is not None:
        raise refusal
    return lock
