"""Rotary position embeddings: the inverse frequencies (plain, `linear` or `llama3` scaled), the
cos/sin tables shared by every layer, and the rotation (HF's rotate-half convention)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.config import LlamaConfig


def rope_inv_freq(cfg: LlamaConfig) -> jax.Array:
    """RoPE's [Dh/2] inverse frequencies in fp32, scaled as `cfg.rope_type` says, in transformers' operations and order."""
    dh = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    if cfg.rope_type == "linear":  # position interpolation: position p rotates as p / factor did
        return inv_freq / cfg.rope_factor
    if cfg.rope_type == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        context = cfg.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < context / high) & ~(wavelen > context / low)
        return jnp.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(positions: jax.Array, cfg: LlamaConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the positions' angles, [B, T, Dh/2] fp32 (ARCHITECTURE.md, "RoPE tables once per forward pass")."""
    freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
    return jax.lax.optimization_barrier((jnp.cos(freqs), jnp.sin(freqs)))


def rope(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary embedding with HF's rotate-half convention. x: [B, T, heads, Dh]; tables from `rope_tables`."""
    cos, sin = (jnp.concatenate([t, t], axis=-1)[:, :, None, :].astype(x.dtype) for t in tables)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
