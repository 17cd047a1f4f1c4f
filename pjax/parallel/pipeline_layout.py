"""The stored order of the stacked layers under pipeline parallelism.

Device s holds rows [s*L/p, (s+1)*L/p) of the stacked 'layers' parameters (the 'layers' dim is
split over pp). With v chunks per device (interleaved), model stage j = c*p + s is chunk c of
device s, so a device's layers are not contiguous in the model; the stored stack is then kept
in *pipeline order* (`layer_order`): each device's block holds its v chunks, and nothing is
re-laid-out per step. Checkpoints store model order (`to_model_layout` converts back).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np


def layer_order(num_layers: int, pp: int, v: int) -> np.ndarray:
    """The model layer held by each row of the stored layer stack (the identity unless v > 1)."""
    per_chunk = num_layers // (pp * v)
    row = np.arange(num_layers)
    device, chunk, k = row // (v * per_chunk), (row // per_chunk) % v, row % per_chunk
    return (chunk * pp + device) * per_chunk + k


def to_pipeline_layout(params: Any, pp: int, v: int) -> Any:
    """Model-ordered parameters -> the stored order of a pp x v pipeline."""
    rows = layer_order(jax.tree.leaves(params["layers"])[0].shape[0], pp, v)
    return {**params, "layers": jax.tree.map(lambda a: a[rows], params["layers"])}


def to_model_layout(params: Any, pp: int, v: int) -> Any:
    """Pipeline-ordered parameters (or gradients) -> model order."""
    rows = np.argsort(layer_order(jax.tree.leaves(params["layers"])[0].shape[0], pp, v))
    return {**params, "layers": jax.tree.map(lambda a: a[rows], params["layers"])}
