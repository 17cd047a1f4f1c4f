"""`data.streaming=true`: documents read, tokenized and packed as training consumes them (no token cache,
no read-ahead). Each document ends with EOS, so the first epoch equals the cached stream. Windows pack as in
`batches.py` but in stream order: shuffle a streamed corpus beforehand. Position, held-out split and resume:
ARCHITECTURE.md, "Streaming keeps a token position, not a window index"."""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
from jax.sharding import Mesh

from mesh.errors import ConfigError
from pjax.data.batches import Batch, SequenceLayout, identity_layout, layouts_by_length
from pjax.data.text import eos_id, encode_documents

if TYPE_CHECKING:
    from pjax.data.curriculum import Curriculum

CHUNK_CHARS = 1 << 16  # small enough not to read ahead, big enough to use every core
OpenDocuments = Callable[[int], Iterator[str]]  # documents from index `start` on, in a fixed order


class TokenStream:
    """The tokens of the documents `keep(index)` selects, each followed by EOS: endless or one pass."""

    def __init__(self, open_documents: OpenDocuments, tokenizer: Any, keep: Callable[[int], bool],
                 repeat: bool = True) -> None:
        self.open_documents, self.tokenizer, self.keep, self.repeat = open_documents, tokenizer, keep, repeat
        eos = eos_id(tokenizer)
        self.tail = [] if eos is None else [eos]
        self.seek((0, 0, 0))

    def seek(self, position: tuple[int, int, int]) -> None:
        """Continue from (epoch, document, offset)."""
        epoch, document, offset = position
        self._segments: deque[list] = deque()  # [epoch, document, tokens, first unread], oldest first
        self._buffered = 0
        self._next = (epoch, document)  # the next document the reader yields, or later
        self._skip = offset
        self._reader = self._read(epoch, document)

    @property
    def position(self) -> tuple[int, int, int]:
        if self._segments:
            epoch, document, _, first = self._segments[0]
            return epoch, document, first
        return (*self._next, self._skip)

    def _read(self, epoch: int, start: int) -> Iterator[tuple[int, int, str]]:
        while True:
            kept = False
            for index, text in enumerate(self.open_documents(start), start):
                if self.keep(index):
                    kept = True
                    yield epoch, index, text
            if not self.repeat:
                return
            if start == 0 and not kept:  # a whole pass without a document would loop for ever
                raise ConfigError("data.path holds no documents to stream; point it at a non-empty corpus.")
            epoch, start = epoch + 1, 0

    def _fill(self) -> bool:
        batch: list[tuple[int, int, str]] = []
        size = 0
        for item in self._reader:
            batch.append(item)
            size += len(item[2])
            if size >= CHUNK_CHARS:
                break
        if not batch:
            return False
        for (epoch, document, _), ids in zip(batch, encode_documents([text for *_, text in batch], self.tokenizer)):
            tokens = np.asarray(ids + self.tail, dtype=np.int32)
            first, self._skip = (self._skip, 0) if (epoch, document) == self._next else (0, 0)
            self._next = (epoch, document + 1)
            if first < len(tokens):
                self._segments.append([epoch, document, tokens, first])
                self._buffered += len(tokens) - first
        return True

    def take(self, n: int, seq_len: int) -> np.ndarray | None:
        """int32 [n, seq_len + 1]: the next n windows (None when a one-pass stream has too few)."""
        need = n * seq_len + 1
        epoch, buffered = self._next[0], self._buffered
        while self._buffered < need:
            if not self._fill():
                return None
            if self._next[0] > epoch + 1 and self._buffered == buffered:  # a whole epoch without a token
                raise ConfigError("data.path holds no text to stream (only empty documents); point it at a "
                                  "non-empty corpus.")
        if n == 0:
            return np.zeros((0, seq_len + 1), np.int32)
        flat = np.empty(need, np.int32)
        filled = 0
        for _, _, tokens, first in self._segments:
            part = tokens[first:first + need - filled]
            flat[filled:filled + len(part)] = part
            filled += len(part)
            if filled == need:
                break
        self._advance(n * seq_len)  # the last token stays: it starts the next window
        return _windows(flat, n, seq_len)

    def _advance(self, count: int) -> None:
        self._buffered -= count
        while count:
            segment = self._segments[0]
            step = min(count, len(segment[2]) - segment[3])
            segment[3] += step
            count -= step
            if segment[3] == len(segment[2]):
                self._segments.popleft()


def _windows(flat: np.ndarray, n: int, seq_len: int) -> np.ndarray:
    """[n, seq_len + 1] windows of n * seq_len + 1 tokens, neighbours sharing one token."""
    return np.lib.stride_tricks.sliding_window_view(flat, seq_len + 1)[::seq_len].copy()


class StreamIterator:
    """`DataIterator`'s interface (state, restore, eval batches) over a document stream."""

    def __init__(self, open_documents: OpenDocuments, tokenizer: Any, seq_len: int, batch_size: int,
                 grad_accum: int, mesh: Mesh | None = None, *, eval_stride: int = 0,
                 sequence_layout: SequenceLayout = identity_layout, curriculum: Curriculum | None = None) -> None:
        self.curriculum = curriculum
        self.layouts = layouts_by_length(curriculum, seq_len, batch_size, grad_accum, mesh, sequence_layout)
        self.layout = self.layouts[seq_len]
        self.seq_len, self.batch_size, self.eval_stride = seq_len, batch_size, eval_stride
        self.shape = (grad_accum, batch_size // grad_accum, seq_len + 1)
        self.batches = 0  # taken so far: the curriculum's clock (the token position alone does not say)

        def held_out(index: int) -> bool:
            return eval_stride > 0 and index % eval_stride == eval_stride - 1

        self._train = TokenStream(open_documents, tokenizer, lambda i: not held_out(i))
        self._held_out = TokenStream(open_documents, tokenizer, held_out, repeat=False)
        self._eval: list[np.ndarray] = []
        self._eval_done = eval_stride == 0
        self._train.take(0, seq_len)  # read the first chunk now: an unreadable source fails before compiling

    def __iter__(self) -> "StreamIterator":
        return self

    def __next__(self) -> Batch:
        length = self.seq_len if self.curriculum is None else self.curriculum.length(self.batches)
        k = self.seq_len // length  # k consecutive windows of `length` hold one of seq_len's tokens
        windows = self._train.take(self.batch_size * k, length).reshape(self.shape[0], -1, length + 1)
        self.batches += 1
        layout = self.layouts[length]
        return layout.place(layout.local(windows))

    def num_eval_batches(self, limit: int | None = None) -> int:
        """Held-out batches available (at most `limit`); a ConfigError if none."""
        while not self._eval_done and (limit is None or len(self._eval) < limit):
            windows = self._held_out.take(self.batch_size, self.seq_len)
            if windows is None:
                self._eval_done = True
            else:
                self._eval.append(windows.reshape(self.shape))
        if not self._eval:
            held = f"every {self.eval_stride}th document" if self.eval_stride else "no document"
            raise ConfigError(f"the held-out split ({held}) is under one batch of train.batch_size={self.batch_size} "
                              f"windows of train.seq_len={self.seq_len}: raise data.eval_fraction, shrink the batch "
                              f"or set log.eval_every=0.")
        return len(self._eval) if limit is None else min(len(self._eval), limit)

    def eval_batches(self, n: int) -> Iterator[Batch]:
        """The first `n` held-out batches (always the same ones)."""
        for windows in self._eval[:self.num_eval_batches(n)]:
            yield self.layout.place(self.layout.local(windows))

    def state(self) -> dict[str, Any]:
        """The stream position (JSON-serialisable) and what defines the stream."""
        epoch, document, offset = self._train.position
        return {"streaming": True, "epoch": epoch, "document": document, "offset": offset,
                "eval_stride": self.eval_stride, "batches": self.batches}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state()` was taken."""
        if not state.get("streaming"):
            raise ConfigError("the checkpoint's data position is not a streamed one (data.streaming=false); resume "
                              "with data.streaming=false, or start afresh.")
        if state["eval_stride"] != self.eval_stride:
            raise ConfigError(f"the checkpoint held out every {state['eval_stride']}th document, this run every "
                              f"{self.eval_stride}th; resume with the same data.eval_fraction, or start afresh.")
        if "batches" not in state and self.curriculum is not None:
            raise ConfigError("the checkpoint's streamed position does not count its batches (it predates "
                              "data.curriculum), so the curriculum cannot resume from it; start afresh, or resume "
                              "without data.curriculum.")
        self._train.seek((int(state["epoch"]), int(state["document"]), int(state["offset"])))
        self.batches = int(state.get("batches", 0))
