"""A HuggingFace checkpoint written in shards, as transformers' `save_pretrained(max_shard_size=...)` lays it out:
`model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`, or one `model.safetensors` where everything
fits one shard.

The plan comes from the shapes alone (`plan`), so every process knows every shard's name before anything is read.
Each HF tensor is then read on its own (`read`: one layer and expert of a pjax parameter, e.g.
`pjax.checkpoint.param_reader`) and converted as its shard is written: a process holds one shard's tensors, never
the model. With several processes, process k writes shards k, k + n, ...; process 0 writes config.json and the
index. No process waits on another."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import ml_dtypes
import numpy as np
import safetensors.numpy

from mesh.errors import ConfigError
from models.config import LlamaConfig
from models.hf import tensor_table

DTYPES = {"fp32": (np.dtype(np.float32), "float32"), "bf16": (np.dtype(ml_dtypes.bfloat16), "bfloat16")}
# transformers' units: "5GB" is 5 * 10^9 bytes, "5GiB" 5 * 2^30.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_META = {"format": "pt"}  # transformers refuses safetensors files without a known format tag


def parse_size(text: str | int) -> int:
    """Bytes from transformers' `max_shard_size` spelling: an integer, or '5GB', '500MB', '2GiB'."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text), re.IGNORECASE)
    unit = match and match.group(2).upper()
    if not match or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise ConfigError(f"--max-shard-size {text} is not a size; write it as transformers does, e.g. 5GB, 500MB, "
                          f"2GiB or a number of bytes.")
    return int(float(match.group(1)) * _UNITS[unit])


class Piece(NamedTuple):
    """One HF tensor: its name, the pjax parameter it is cut from, its layer and expert there, its bytes."""

    name: str
    tensor: Any  # models.hf's table row
    layer: int
    expert: int
    nbytes: int

    @property
    def index(self) -> tuple[int, ...]:
        """Its leading indices in the pjax parameter: (layer, expert), (layer,) or ()."""
        return ((self.layer,) if self.tensor.stacked else ()) + ((self.expert,) if self.tensor.experts else ())


def plan(cfg: LlamaConfig, dtype: np.dtype, max_shard_bytes: int | None) -> list[list[Piece]]:
    """The shards, each a list of pieces in parameter order (a parameter's pieces are consecutive, so each is read
    once); a shard closes before the piece that would take it past `max_shard_bytes` (None: one shard)."""
    shards: list[list[Piece]] = [[]]
    size = 0
    for t in tensor_table(cfg):
        nbytes = math.prod(t.hf_shape) * dtype.itemsize
        for i, names in enumerate(t.names(cfg.num_hidden_layers)):
            for j, name in enumerate(names):
                if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
                    shards.append([])
                    size = 0
                shards[-1].append(Piece(name, t, i, j, nbytes))
                size += nbytes
    return shards


def file_names(count: int) -> list[str]:
    """transformers' names for `count` shards."""
    return ["model.safetensors"] if count == 1 else [f"model-{k:05d}-of-{count:05d}.safetensors"
                                                     for k in range(1, count + 1)]


def write(cfg: LlamaConfig, out_dir: str, read: Callable[[tuple[str, str], tuple[int, ...]], Any],
          dtype: str = "fp32", max_shard_bytes: int | None = None, process: tuple[int, int] | None = None) -> list[str]:
    """Write the checkpoint whose pjax parameter at path ('layers', 'wq') and leading (layer, expert) indices `read`
    returns (a host array) into `out_dir` in `dtype` ('fp32' or 'bf16'), as process `process` (index, count;
    default JAX's) of the export; returns the shard files it wrote."""
    np_dtype, torch_name = DTYPES[dtype]
    shards = plan(cfg, np_dtype, max_shard_bytes)
    names = file_names(len(shards))
    me, processes = process or (jax.process_index(), jax.process_count())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if me == 0:
        # A file of another layout would shadow this one (transformers prefers model.safetensors). This export's own
        # names are never removed, so the other processes need not wait for this.
        index_file = out / "model.safetensors.index.json"
        for stale in [index_file, *out.glob("model*.safetensors")]:
            if stale.name not in names:
                stale.unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps({**cfg.to_hf(), "torch_dtype": torch_name}, indent=2))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(p.nbytes for s in shards for p in s)},
                     "weight_map": {p.name: name for s, name in zip(shards, names) for p in s}}
            index_file.write_text(json.dumps(index, indent=2))
    written = []
    for k in range(me, len(shards), processes):
        # astype copies: the shard holds no view of what `read` returned
        tensors = {p.name: p.tensor.to_hf(np.asarray(read(p.tensor.path, p.index))).astype(np_dtype)
                   for p in shards[k]}
        safetensors.numpy.save_file(tensors, os.fspath(out / names[k]), metadata=_META)
        written.append(names[k])
        del tensors
    return written
