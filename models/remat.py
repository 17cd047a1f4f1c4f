"""Remat of a decoder layer: `train.remat`'s policies and the activation names `train.remat=names` keeps
(ARCHITECTURE.md, "Remat by name"). The tags sit on the layer's values outside every `custom_vjp` form,
so `jax.checkpoint` sees them whichever form computed them."""
from __future__ import annotations

from typing import Any, Sequence

import jax

# In the layer's order; N tokens, D hidden, H heads and K kv-heads of Dh, F the MLP width.
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
# The down projection's output has no name: the backward never reads it.

# cuDNN's attention residuals besides q, k and v (its output and log-sum-exp, `attention.keeping_residuals`): every
# policy but `full` keeps them, so that none recomputes the fused kernel's forward in the backward.
ATTENTION = "cudnn_attention"

# Narrow tensors kept, the wide [N, F] gate/up outputs recomputed: no q/k/v or o matmul is re-run.
DEFAULT_NAMES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    "names": None,  # built by `policy`
}


def policy(remat: str, names: Sequence[str] = DEFAULT_NAMES) -> Any:
    """The `jax.checkpoint` policy of `remat` (None for 'none'); `names` are what 'names' keeps. Every policy
    but 'full' also keeps cuDNN's attention residuals (`ATTENTION`)."""
    if remat not in POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; choose one of {sorted(POLICIES)}")
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"unknown remat names {unknown}; choose from {list(NAMES)}")
    if remat == "names":
        return jax.checkpoint_policies.save_only_these_names(*names, ATTENTION)
    if remat in ("none", "full"):
        return POLICIES[remat]
    return _keeping_attention(POLICIES[remat])


def _keeping_attention(base: Any) -> Any:
    """`base`, and cuDNN's attention residuals saved on the device (`save_from_both_policies` takes booleans
    only, and the offload policy answers `Offloadable` or `Recompute`)."""
    keep = jax.checkpoint_policies.save_only_these_names(ATTENTION)

    def keeping(prim: Any, *args: Any, **params: Any) -> Any:
        return True if keep(prim, *args, **params) else base(prim, *args, **params)
    return keeping
