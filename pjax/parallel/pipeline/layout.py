"""Which model stage each chunk of each pipeline device holds: round robin (interleaved) or a V (zb_v).
The stored layer stack is in pipeline order, so nothing is re-laid-out per step; checkpoints store model order."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np


def stage_of(device: Any, chunk: Any, p: int, vshape: bool = False) -> Any:
    """The model stage of `chunk` on `device` (ints or int arrays): c*p + s, or in a V s, 2p - 1 - s."""
    if not vshape:
        return chunk * p + device
    if isinstance(device, int) and isinstance(chunk, int):
        return device if chunk == 0 else 2 * p - 1 - device
    return np.where(np.asarray(chunk) == 0, device, 2 * p - 1 - np.asarray(device))


def device_of(stage: int, p: int, vshape: bool = False) -> int:
    """The device that holds model stage `stage` (`stage_of`'s inverse over devices)."""
    return min(stage, 2 * p - 1 - stage) if vshape else stage % p


def layer_order(num_layers: int, pp: int, v: int, vshape: bool = False) -> np.ndarray:
    """The model layer held by each row of the stored layer stack (the identity unless v > 1)."""
    per_chunk = num_layers // (pp * v)
    row = np.arange(num_layers)
    device, chunk, k = row // (v * per_chunk), (row // per_chunk) % v, row % per_chunk
    return stage_of(device, chunk, pp, vshape) * per_chunk + k


def to_pipeline_layout(params: Any, pp: int, v: int, vshape: bool = False) -> Any:
    """Model-ordered parameters -> the stored order of a pp x v pipeline."""
    rows = layer_order(jax.tree.leaves(params["layers"])[0].shape[0], pp, v, vshape)
    return {**params, "layers": jax.tree.map(lambda a: a[rows], params["layers"])}


def to_model_layout(params: Any, pp: int, v: int, vshape: bool = False) -> Any:
    """Pipeline-ordered parameters (or gradients) -> model order."""
    rows = np.argsort(layer_order(jax.tree.leaves(params["layers"])[0].shape[0], pp, v, vshape))
    return {**params, "layers": jax.tree.map(lambda a: a[rows], params["layers"])}
