"""One layer (and expert) of a saved parameter at a time, read on the host: what `pjax.export` reads a checkpoint
with, so that its memory holds one HF shard, not a model or a stacked parameter.

A checkpoint stores each parameter under `<step>/params` as a Zarr array in Orbax's OCDBT database, keyed by its
path joined with dots ('layers.wq'). `Checkpointer.save` writes stacked parameters in one chunk per layer (and per
expert), so reading `[layer, expert]` decompresses that chunk alone. A checkpoint saved before that holds one chunk
per device's slice: reading a slice there would decompress the whole chunk every time, so such a parameter is read
whole, once, and kept until another is asked for."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts


class ParamReader:
    """Reads `[index]` of the parameter at `path` ('layers', 'wq') of one saved step, `index` its leading (layer,
    expert) indices; no device and no other process is involved."""

    def __init__(self, step_dir: str | Path) -> None:
        self._dir = Path(step_dir, "params")
        metadata = json.loads((self._dir / "_METADATA").read_text())
        self._driver = "zarr3" if metadata.get("use_zarr3") else "zarr"
        self._whole: tuple[tuple[str, ...], np.ndarray] | None = None  # a parameter read whole (see the docstring)
        # No cache: a chunk read is used once.
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})

    def __call__(self, path: tuple[str, ...], index: tuple[int, ...] = ()) -> np.ndarray:
        if self._whole is not None and self._whole[0] == path:
            return self._whole[1][index]
        self._whole = None  # the last parameter goes before the next is read
        array = self._open(path)
        chunk = array.chunk_layout.read_chunk.shape
        if all(c == 1 for c in chunk[:len(index)]):
            return array[index].read().result()
        whole = array.read().result()
        self._whole = (path, whole)
        return whole[index]

    def _open(self, path: tuple[str, ...]) -> Any:
        kvstore = {"driver": "ocdbt", "base": f"file://{self._dir.resolve()}/", "path": ".".join(path)}
        return ts.open({"driver": self._driver, "kvstore": kvstore}, open=True, read=True,
                       context=self._context).result()
