"""A multi-process run watches its own processes, so that losing one ends the others in one line.

JAX's coordination service notices a dead process only after its heartbeat timeout (100 s by default) and then
aborts every other process with a fatal log and a stack trace; gloo's collectives fail at once but name only a
peer's address, and NCCL's wait. So each process beats in the coordination service's key-value store from a
thread, and reads everyone's beats: a process whose beat has not moved for `timeout` seconds is lost. The
watcher then prints one line naming it and ends this process at once (a checkpoint in flight is not committed;
the last committed one is where the next start resumes). Process 0 holds the store and JAX's coordination
service: when it is lost, JAX's clients abort the others at once with their own fatal log, which no Python code
can intercept. A process that ends says how first: having done its work (the others do not count it lost while
they finish theirs), or on an error of its own, which stops the others at once, each naming it."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Iterator

from mesh.errors import ConfigError

PREFIX = "pjax/beat/"
DONE, FAILED, STOPPED = "done", "failed", "stopped"  # ended its work, ended on its own error, ended on a loss
EXIT_LOST = 1
JAX_HEARTBEAT_FLOOR_S = 100  # JAX's own default: its detection (a fatal abort) must come after ours


class Watchdog:
    """Beats for process `index` of `count` every `timeout / 6` seconds and ends the process when another's beat
    has been silent for `timeout` seconds."""

    def __init__(self, client: Any, index: int, count: int, timeout: float) -> None:
        self.client, self.index, self.count, self.timeout = client, index, count, timeout
        self.interval = max(timeout / 6, 0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pjax-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def _run(self) -> None:
        start = time.monotonic()
        seen: dict[int, tuple[str, float]] = {j: ("", start) for j in range(self.count) if j != self.index}
        beat = 0
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                beat += 1
                self.client.key_value_set(f"{PREFIX}{self.index}", str(beat), allow_overwrite=True)
                values = dict(self.client.key_value_dir_get(PREFIX))
            except Exception:  # noqa: BLE001 - the store is process 0's; without it JAX's client aborts this one
                continue
            for j, (value, since) in seen.items():
                got = values.get(f"{PREFIX}{j}", "")
                if got in (DONE, STOPPED) or self._stop.is_set():
                    continue
                if got == FAILED:
                    self.lose(j, "stopped on an error of its own (its log says which)")
                elif got != value:
                    seen[j] = (got, now)
                elif now - since > self.timeout:
                    self.lose(j, f"was lost: its beat stopped for {self.timeout:g} s (killed, crashed or cut off)")

    def finish(self, failed: bool = False) -> None:
        """This process ends, its work done or `failed`: tell the others, stop watching."""
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(Exception):  # a store already gone has no one left to tell
            self.client.key_value_set(f"{PREFIX}{self.index}", FAILED if failed else DONE, allow_overwrite=True)

    def settle(self) -> None:
        """After a collective failed here: wait for the watcher to name a lost process (it ends the process);
        returns when none is lost within the timeout, the failure being this process's own."""
        self._thread.join(self.timeout + 2 * self.interval + 1)

    def lose(self, process: int, why: str) -> None:
        """The one line for a lost process, then the end of this one, skipping the exit handlers: JAX's would wait
        at a shutdown barrier the lost process never reaches. Process 0 goes last (`last_out`)."""
        print(f"error: process {process} of {self.count} {why}; this process stops too. Restart every process: a "
              f"run with checkpoint.dir resumes from its last checkpoint.",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        with contextlib.suppress(Exception):
            self.client.key_value_set(f"{PREFIX}{self.index}", STOPPED, allow_overwrite=True)
        self.last_out(process)
        os._exit(EXIT_LOST)

    def last_out(self, lost: int | None = None) -> None:
        """Process 0 (the coordination service's) waits, a few beats at most, until every other process but the
        `lost` one has ended: the others' JAX clients abort with a fatal log the moment its service goes."""
        deadline = time.monotonic() + 2 * self.interval + 1
        while self.index == 0 and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                values = dict(self.client.key_value_dir_get(PREFIX))
                if all(values.get(f"{PREFIX}{j}") in (DONE, FAILED, STOPPED) for j in range(1, self.count)
                       if j != lost):
                    return
            time.sleep(0.1)


_current: Watchdog | None = None


def start(client: Any, index: int, count: int, timeout: float) -> Watchdog:
    """Watch this run's processes (one watchdog per process, like JAX's own distributed state)."""
    global _current
    _current = Watchdog(client, index, count, timeout).start()
    return _current


@contextlib.contextmanager
def guarding() -> Iterator[None]:
    """Around a multi-process run's work: an error that may be a lost peer's waits for the watcher's verdict
    before it surfaces; the end of the work tells the others how it ended (an error of this process's own, a
    one-line ConfigError included, stops them)."""
    failed = True
    try:
        yield
        failed = False
    except ConfigError:
        raise
    except Exception as e:
        if _current is not None and "RESOURCE_EXHAUSTED" not in str(e):  # running out of memory is this one's own
            _current.settle()
        raise
    finally:
        if _current is not None:
            _current.finish(failed)


def exit_now(code: int) -> None:
    """End a process of a multi-process run whose error is said (the others stop on it) without JAX's shutdown
    barrier, which would wait for them; a lone process just returns."""
    if _current is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    _current.last_out()
    os._exit(code)


def check_timeout(seconds: float, flag: str) -> None:
    if not seconds > 0:
        raise ConfigError(f"{flag}={seconds:g} is invalid; give a number of seconds above 0.")
