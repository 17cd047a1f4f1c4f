"""`data.prefetch`: a thread builds the next batches while the step runs (numpy, the host-to-device copy and
the tokenizer release the GIL). Each batch and failure travels with the iterator's position, so `state()`
and errors are those of the batches the loop took (ARCHITECTURE.md, "The next batch off the loop's thread")."""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator

_POLL_S = 0.1  # how often a blocked put or get checks that the other side is still there


class Prefetcher:
    """`source`'s batches, up to `depth` built ahead (0: on next()'s thread), with `source`'s interface."""

    def __init__(self, source: Any, depth: int) -> None:
        self.source, self.depth = source, depth
        self._state = source.state()
        self._thread: threading.Thread | None = None
        self._waited = 0.0

    def __iter__(self) -> "Prefetcher":
        return self

    def take_wait(self) -> float:
        """Seconds `next()` has spent (building or awaiting batches) since the last call."""
        waited, self._waited = self._waited, 0.0
        return waited

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return self._next()
        finally:
            self._waited += time.perf_counter() - start

    def _next(self) -> Any:
        if self.depth == 0:
            batch = next(self.source)
            self._state = self.source.state()
            return batch
        if self._thread is None:
            self._start()
        while True:
            try:
                batch, state, error = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive():  # it ends only after queueing its error
                    raise RuntimeError("the data prefetch thread stopped without a batch or an error") from None
        if error is not None:
            self.close()
            raise error
        self._state = state
        return batch

    def _start(self) -> None:
        self._queue: queue.Queue = queue.Queue(self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(self._queue, self._stop), daemon=True,
                                        name="pjax-data-prefetch")
        self._thread.start()

    def _produce(self, out: queue.Queue, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                batch = next(self.source)
                if not _put(out, (batch, self.source.state(), None), stop):
                    return
        except BaseException as error:
            _put(out, (None, None, error), stop)

    def close(self) -> None:
        """Stop the thread (the batches built ahead are dropped)."""
        if self._thread is None:
            return
        self._stop.set()
        # A thread inside a slow read is left to end on its own: a daemon touching only `source`.
        self._thread.join(timeout=10)
        self._thread = None

    def state(self) -> dict[str, Any]:
        """The position after the last batch `next()` returned."""
        return self._state

    def restore(self, state: dict[str, Any]) -> None:
        self.close()
        self.source.restore(state)
        self._state = self.source.state()

    def num_eval_batches(self, limit: int | None = None) -> int:
        return self.source.num_eval_batches(limit)

    def eval_batches(self, n: int) -> Iterator[Any]:
        return self.source.eval_batches(n)


def _put(out: queue.Queue, item: tuple, stop: threading.Event) -> bool:
    """Queue `item` unless the consumer stops first; whether it was queued."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False
