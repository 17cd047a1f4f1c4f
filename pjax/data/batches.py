"""Token stream -> training batches: packed windows, a shuffled order per epoch, sharded arrays.

Window i is tokens[i*seq_len : i*seq_len + seq_len + 1]: neighbours share one boundary token, so every
token is predicted once per epoch and nothing is padded. Epoch e's order is a permutation by (seed, epoch),
the remainder dropped, never dependent on the mesh (ARCHITECTURE.md, "Data order from the seed alone")."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh.errors import ConfigError, listed
from mesh.mesh import CP, DATA, MeshConfig
from mesh.validate import validate_batch

if TYPE_CHECKING:
    from pjax.data.curriculum import Curriculum

# A permutation of the sequence positions, e.g. context parallelism's zigzag layout.
SequenceLayout = Callable[[np.ndarray], np.ndarray]
Batch = dict[str, jax.Array]


def identity_layout(x: np.ndarray) -> np.ndarray:
    return x


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many seq_len+1 windows the stream packs into (they overlap by one token)."""
    return max(num_tokens - 1, 0) // seq_len


def epoch_order(seed: int, epoch: int, n_windows: int) -> np.ndarray:
    """The order in which epoch `epoch` visits the windows."""
    return np.random.default_rng([seed, epoch]).permutation(n_windows)


def read_windows(tokens: np.ndarray, ids: np.ndarray, seq_len: int) -> np.ndarray:
    """int32 [*ids.shape, seq_len + 1]: the windows with these indices."""
    offsets = np.asarray(ids, dtype=np.int64)[..., None] * seq_len + np.arange(seq_len + 1)
    return np.asarray(tokens[offsets], dtype=np.int32)


def window_arrays(windows: np.ndarray, columns: np.ndarray) -> dict[str, np.ndarray]:
    """inputs/labels/positions of windows [..., seq_len + 1] at the (laid-out) sequence positions `columns`."""
    return {
        "inputs": windows[..., columns],
        "labels": windows[..., columns + 1],
        "positions": np.broadcast_to(columns.astype(np.int32), (*windows.shape[:-1], len(columns))).copy(),
    }


def batch_arrays(tokens: np.ndarray, ids: np.ndarray, seq_len: int, columns: np.ndarray) -> dict[str, np.ndarray]:
    """`window_arrays` of the windows `ids`."""
    return window_arrays(read_windows(tokens, ids, seq_len), columns)


def process_local_indices(sharding: NamedSharding, global_shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Per dimension, the global indices this process's devices hold, in `make_array_from_process_local_data` order."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    indices = []
    for dim, size in enumerate(global_shape):
        ranges = sorted({index[dim].indices(size)[:2] for index in index_map.values()})
        indices.append(np.concatenate([np.arange(start, stop) for start, stop in ranges]))
    return tuple(indices)


class BatchLayout:
    """Where a global batch goes: sharded P(None, dp, cp), each process holding only its rows and chunks."""

    def __init__(self, seq_len: int, batch_size: int, grad_accum: int, mesh: Mesh | None = None,
                 sequence_layout: SequenceLayout = identity_layout) -> None:
        if mesh is None:
            if min(seq_len, batch_size, grad_accum) < 1 or batch_size % grad_accum:
                raise ConfigError(f"train.batch_size={batch_size} is not divisible by train.grad_accum={grad_accum} "
                                  f"(all three of batch_size, grad_accum, seq_len must be positive); change one.")
        else:
            validate_batch(MeshConfig.of(mesh), batch_size=batch_size, grad_accum=grad_accum, seq_len=seq_len)
        self.columns = np.asarray(sequence_layout(np.arange(seq_len)))
        if not np.array_equal(np.sort(self.columns), np.arange(seq_len)):
            raise ValueError("sequence_layout must permute the last axis (it returned something else for arange).")
        self.global_shape = (grad_accum, batch_size // grad_accum, seq_len)
        self.sharding = None if mesh is None else NamedSharding(mesh, P(None, DATA, CP))
        if self.sharding is not None:
            self._local = process_local_indices(self.sharding, self.global_shape)

    def local(self, rows: np.ndarray) -> np.ndarray:
        """The part of a [grad_accum, micro_batch, ...] array whose rows this process's devices hold."""
        return rows if self.sharding is None else rows[np.ix_(self._local[0], self._local[1])]

    def place(self, windows: np.ndarray) -> Batch:
        """This process's windows [.., .., seq_len + 1] (`local`'s rows) -> the sharded global batch."""
        if self.sharding is None:
            return {k: jnp.asarray(v) for k, v in window_arrays(windows, self.columns).items()}
        local = window_arrays(windows, self.columns[self._local[2]])
        return {k: jax.make_array_from_process_local_data(self.sharding, v, self.global_shape) for k, v in local.items()}


def layouts_by_length(curriculum: Curriculum | None, seq_len: int, batch_size: int, grad_accum: int,
                      mesh: Mesh | None, sequence_layout: SequenceLayout) -> dict[int, BatchLayout]:
    """A BatchLayout per length the run trains on (`data.curriculum`): at seq_len / k, k times the rows."""
    lengths = (seq_len,) if curriculum is None else curriculum.lengths
    return {length: BatchLayout(length, batch_size * (seq_len // length), grad_accum, mesh, sequence_layout)
            for length in lengths}


class DataIterator:
    """Endless, resumable iterator of global batches {inputs, labels, positions}, int32 [grad_accum, micro, seq_len]."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, grad_accum: int, seed: int,
                 mesh: Mesh | None = None, *, eval_tokens: np.ndarray | None = None,
                 sequence_layout: SequenceLayout = identity_layout, curriculum: Curriculum | None = None) -> None:
        self.curriculum = curriculum
        self.layouts = layouts_by_length(curriculum, seq_len, batch_size, grad_accum, mesh, sequence_layout)
        self.layout = self.layouts[seq_len]
        self.tokens, self.eval_tokens = tokens, eval_tokens
        self.seq_len, self.batch_size, self.grad_accum, self.seed = seq_len, batch_size, grad_accum, seed
        self.micro_batch = batch_size // grad_accum
        self.num_windows = num_windows(len(tokens), seq_len)
        if self.num_windows < batch_size:
            raise ConfigError(
                f"the training tokens ({len(tokens)}) pack into only {self.num_windows} windows of train.seq_len="
                f"{seq_len}, fewer than train.batch_size={batch_size}; use more data or a smaller seq_len or batch_size."
            )
        self.batches_per_epoch = self.num_windows // batch_size
        self.epoch = 0
        self.step_in_epoch = 0
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation)

    def window_ids(self, epoch: int, step_in_epoch: int) -> np.ndarray:
        """int [grad_accum, micro_batch]: the windows of one global batch, micro-batch-major."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.seed, epoch, self.num_windows))
        start = step_in_epoch * self.batch_size
        return self._order[1][start:start + self.batch_size].reshape(self.grad_accum, self.micro_batch)

    def global_batch(self, epoch: int, step_in_epoch: int) -> dict[str, np.ndarray]:
        """The whole global batch as numpy arrays, for checks."""
        return batch_arrays(self.tokens, self.window_ids(epoch, step_in_epoch), self.seq_len, self.layout.columns)

    def __iter__(self) -> "DataIterator":
        return self

    def __next__(self) -> Batch:
        # The batch's index in the run is its position: a curriculum's length resumes with it.
        index = self.epoch * self.batches_per_epoch + self.step_in_epoch
        length = self.seq_len if self.curriculum is None else self.curriculum.length(index)
        return self._assemble(self.tokens, self.next_ids(), length)

    def next_ids(self) -> np.ndarray:
        """The next global batch's window ids [grad_accum, micro_batch]; the stream moves past them."""
        ids = self.window_ids(self.epoch, self.step_in_epoch)
        self.step_in_epoch += 1
        if self.step_in_epoch == self.batches_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return ids

    def num_eval_batches(self, limit: int | None = None) -> int:
        """Whole batches in the held-out split (at most `limit`); a ConfigError if there is not even one."""
        if self.eval_tokens is None:
            raise ValueError("this DataIterator was built without eval_tokens.")
        available = num_windows(len(self.eval_tokens), self.seq_len) // self.batch_size
        if available == 0:
            raise ConfigError(
                f"the held-out split has {len(self.eval_tokens)} tokens, less than one batch of train.batch_size="
                f"{self.batch_size} windows of train.seq_len={self.seq_len}; raise data.eval_fraction, shrink the "
                f"batch or set log.eval_every=0."
            )
        return available if limit is None else min(available, limit)

    def eval_batches(self, n: int) -> Iterator[Batch]:
        """At most `n` batches of the held-out windows, in stream order (no shuffle)."""
        for k in range(self.num_eval_batches(n)):
            ids = np.arange(k * self.batch_size, (k + 1) * self.batch_size).reshape(self.grad_accum, self.micro_batch)
            yield self._assemble(self.eval_tokens, ids, self.seq_len)

    def _assemble(self, tokens: np.ndarray, ids: np.ndarray, length: int) -> Batch:
        """The batch of full-length windows `ids`, cut into windows of `length` tokens."""
        if length != self.seq_len:
            ids = self.curriculum.split(ids, length)
        layout = self.layouts[length]
        return layout.place(read_windows(tokens, layout.local(ids), length))

    def state(self) -> dict[str, Any]:
        """A small JSON-serialisable position in the stream, plus the settings that define it."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "num_windows": self.num_windows}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state()` was taken."""
        if state.get("streaming"):
            raise ConfigError("the checkpoint's data position is a streamed one (data.streaming=true); resume with "
                              "data.streaming=true, or start afresh.")
        ours = self.state()
        keys = ("seed", "batch_size", "seq_len", "num_windows")
        if any(state[k] != ours[k] for k in keys):
            differ = listed([f"{k}={ours[k]} (saved: {state[k]})" for k in keys if state[k] != ours[k]], 55)
            raise ConfigError(f"the saved data stream differs from this run's: {differ}; resume with the same "
                              f"train.seed, batch_size, seq_len and data, or start afresh.")
        if not 0 <= state["step_in_epoch"] < self.batches_per_epoch:
            raise ConfigError(f"the saved data state has step_in_epoch={state['step_in_epoch']}, outside "
                              f"[0, {self.batches_per_epoch}); the checkpoint does not match this data.")
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
