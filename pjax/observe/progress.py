"""What a training run shows and obeys while it runs: the progress bar (or log lines) and the stop flag."""
from __future__ import annotations

import signal
import sys


class StopFlag:
    """SIGTERM/SIGINT finish the current step and leave the loop cleanly (metrics flushed)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, _frame) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


class ProgressBar:
    """tqdm with loss, tok/s, MFU and memory in use/peak ('bar'), log lines ('lines'), or nothing ('off')."""

    def __init__(self, total: int, mode: str, initial: int = 0) -> None:
        self._bar, self._quiet = None, mode == "off"
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, n: int, r: dict) -> None:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        fields = {"loss": f"{r['loss']:.4f}", "tok/s": f"{r['tokens_per_sec']:,.0f}", "mfu": mfu,
                  "mem": f"{_size(r['memory_in_use_bytes'])}/{_size(r['memory_peak_bytes'])}"}
        if self._bar is not None:
            self._bar.set_postfix(fields, refresh=False)
            self._bar.update(n)
        elif not self._quiet:
            print(f"step {r['step']}: " + " ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

    def note(self, text: str) -> None:
        if not self._quiet:
            (self._bar.write if self._bar is not None else print)(text)

    def warn(self, text: str) -> None:
        """A one-line warning, on stderr (above the bar, which keeps its place)."""
        if self._quiet:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _size(n: int) -> str:
    return f"{n / 2**30:.2f}G" if n >= 2**30 else f"{n / 2**20:.0f}M"
