"""Slots that hold one of several kinds of per-micro-batch state: a forward's residuals, then what B leaves W
(ARCHITECTURE.md, "Zero-bubble memory: one slot from arrival to W"). JAX arrays cannot share memory, so with two
kinds the slots are flat: per dtype one [slots, width] buffer, each kind from offset 0. With one kind, or tp > 1
(`separate`: a flat row has no tp layout), each leaf has a buffer of its own, which kind 1 may take over (`reused`)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Pool = dict[str, jax.Array]  # flat: dtype name -> [slots, width]; else 'kind:leaf' -> [slots, *shape]


@dataclasses.dataclass(frozen=True)
class SlotPool:
    """The layout of `kinds`, a slot's leaves; `kept`: per kind-1 leaf, the kind-0 leaf with its value, or None."""

    kinds: tuple[tuple[jax.ShapeDtypeStruct, ...], ...]
    kept: tuple[int | None, ...] = ()
    separate: bool = False
    splits: tuple[tuple[object, ...], ...] = ()  # per kind and leaf, `slot_splits.Split`

    def offsets(self, kind: int) -> list[tuple[str, int, int]]:
        """Per leaf of `kind`: (dtype name, offset, size) in its dtype's row."""
        if kind == 1 and any(k is not None for k in self.kept):
            return self._around_kept()
        at: dict[str, int] = {}
        out = []
        for leaf in self.kinds[kind]:
            name, size = np.dtype(leaf.dtype).name, int(np.prod(leaf.shape))
            out.append((name, at.get(name, 0), size))
            at[name] = at.get(name, 0) + size
        return out

    def _around_kept(self) -> list[tuple[str, int, int]]:
        """Kind 1's layout: kept leaves where kind 0 has them, the others first-fit in between."""
        first = self.offsets(0)
        taken = {i: first[k] for i, k in enumerate(self.kept) if k is not None}
        used: dict[str, list[tuple[int, int]]] = {}
        for name, offset, size in taken.values():
            used.setdefault(name, []).append((offset, offset + size))
        out = []
        for i, leaf in enumerate(self.kinds[1]):
            if i in taken:
                out.append(taken[i])
                continue
            name, size = np.dtype(leaf.dtype).name, int(np.prod(leaf.shape))
            at = 0
            for lo, hi in sorted(used.get(name, [])):
                if at + size <= lo:
                    break
                at = max(at, hi)
            used.setdefault(name, []).append((at, at + size))
            out.append((name, at, size))
        return out

    def written(self, kind: int) -> list[int]:
        """The leaves of `kind` that `write` stores (kind 1's kept leaves are in the slot already)."""
        skip = {i for i, k in enumerate(self.kept) if k is not None} if kind == 1 else set()
        return [i for i in range(len(self.kinds[kind])) if i not in skip]

    def widths(self) -> dict[str, int]:
        """Per dtype, the row width: the most elements of it that any kind holds."""
        widths: dict[str, int] = {}
        for kind in range(len(self.kinds)):
            for name, offset, size in self.offsets(kind):
                widths[name] = max(widths.get(name, 0), offset + size)
        return widths

    @property
    def flat(self) -> bool:
        return not self.separate and sum(1 for kind in self.kinds if kind) > 1

    @functools.cached_property
    def reused(self) -> dict[int, int]:
        """Separate buffers: kind 1's leaves that take over a kind-0 buffer of the same shape, dtype and tp split."""
        if not self.splits or len(self.kinds) < 2:
            return {}
        free = [j for j in range(len(self.kinds[0])) if j not in set(self.kept) and self.splits[0][j] is not None]
        out = {}
        for i in self.written(1):
            same = lambda j: self.kinds[0][j] == self.kinds[1][i] and self.splits[0][j] == self.splits[1][i]
            j = next((j for j in free if same(j)), None) if self.splits[1][i] is not None else None
            if j is not None:
                out[i] = j
                free.remove(j)
        return out

    def _own(self, kind: int, i: int) -> str:
        k = self.kept[i] if kind == 1 and i < len(self.kept) else None
        k = self.reused.get(i) if kind == 1 and k is None else k
        return f"0:{k}" if k is not None else f"{kind}:{i}"

    def zeros(self, slots: int) -> Pool:
        if not self.flat:
            return {f"{kind}:{i}": jnp.zeros((slots, *self.kinds[kind][i].shape), self.kinds[kind][i].dtype)
                    for kind in range(len(self.kinds)) for i in self.written(kind)
                    if self._own(kind, i) == f"{kind}:{i}"}
        return {name: jnp.zeros((slots, width), name) for name, width in self.widths().items()}

    def write(self, pool: Pool, slot: jax.Array, kind: int, leaves: Sequence[jax.Array]) -> Pool:
        """`pool` with slot `slot` holding `leaves`: the leaves `written(kind)` lists, shaped as in `kinds[kind]`."""
        pool = dict(pool)
        if not self.flat:
            for i, leaf in zip(self.written(kind), leaves, strict=True):
                pool[self._own(kind, i)] = pool[self._own(kind, i)].at[slot].set(leaf)
            return pool
        where = self.offsets(kind)
        for i, leaf in zip(self.written(kind), leaves, strict=True):
            name, offset, size = where[i]
            if size:
                row = leaf.reshape(1, size)
                pool[name] = lax.dynamic_update_slice(pool[name], row, (slot, jnp.int32(offset)))
        return pool

    def read(self, pool: Pool, slot: jax.Array, kind: int) -> list[jax.Array]:
        """The leaves of `kind` in slot `slot`."""
        if not self.flat:
            return [pool[self._own(kind, i)][slot].reshape(leaf.shape) for i, leaf in enumerate(self.kinds[kind])]
        out = []
        for (name, offset, size), leaf in zip(self.offsets(kind), self.kinds[kind]):
            row = lax.dynamic_slice(pool[name], (slot, jnp.int32(offset)), (1, size)) if size else pool[name][:1, :0]
            out.append(row.reshape(leaf.shape))
        return out
