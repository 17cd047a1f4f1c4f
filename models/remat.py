"""Remat (activation checkpointing) of a decoder layer: the policies `train.remat` chooses from, and
the names of the activations that `train.remat=names` keeps.

A policy decides which values computed in a layer's forward are kept for its backward; the rest
are recomputed there from the layer's input. `dots` keeps every matmul output (attention's score
matmuls included), `dots_no_batch` only those without batch dimensions (the projections), `full`
nothing, and `names` exactly the activations tagged with the names in `train.remat_names`, as
MaxText's `save_only_these_names` policies do. `DecoderLayer` tags each activation below with
`jax.ad_checkpoint.checkpoint_name` at the line that makes it, outside any `custom_vjp` (CPU's
transposed projection, sequence parallelism's, the zero-bubble taps), so the tag marks the value
the layer goes on with, whichever form computed it.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax

# Every name a layer tags, in the order the layer computes them; N tokens, D hidden, H heads and
# K kv-heads of Dh, F the MLP width (per device: heads and F split over tp).
NAMES: dict[str, str] = {
    "attn_norm": "RMSNorm of the layer input, the q/k/v projections' input [N, D]",
    "q_proj": "queries before RoPE [N, H*Dh]",
    "k_proj": "keys before RoPE [N, K*Dh]",
    "v_proj": "values [N, K*Dh]",
    "attn_out": "attention's output, the o projection's input [N, H*Dh]",
    "o_proj": "the o projection's output, added to the residual stream [N, D]",
    "mlp_norm": "RMSNorm of the residual stream after attention, the MLP's input [N, D]",
    "gate_proj": "the gate projection, before SiLU [N, F] (dense layers only)",
    "up_proj": "the up projection [N, F] (dense layers only)",
}
# The down projection's output has no name: the backward never reads it (it is only added to the
# residual stream, and the layer's output is the next layer's input, kept by the scan anyway).

# The attention projections' outputs, narrow ((H + 2K) * Dh + D per token): the backward re-runs
# no q/k/v or o matmul (the MLP's input comes back as x + o_proj), only the norms, RoPE, attention's
# forward (its backward and the o weight gradient need its inside) and the gate and up matmuls,
# whose [N, F] outputs are the widest activations a layer has and are therefore not kept.
DEFAULT_NAMES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    "names": None,  # built from the names by `policy`
}


def policy(remat: str, names: Sequence[str] = DEFAULT_NAMES) -> Any:
    """The `jax.checkpoint` policy of `remat` (None for 'none'); `names` are what 'names' keeps."""
    if remat not in POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; choose one of {sorted(POLICIES)}")
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"unknown remat names {unknown}; choose from {list(NAMES)}")
    if remat == "names":
        return jax.checkpoint_policies.save_only_these_names(*names)
    return POLICIES[remat]
