"""Precision as a policy: the dtype of each module kind, the optimizer state and the gradient accumulator, by
preset or per key (ARCHITECTURE.md, "Precision as a policy"); weights stay fp32 masters, cast where read."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from mesh.backend import target_backend
from mesh.errors import ConfigError, require, require_choice

KINDS = ("embedding", "attention", "mlp", "router", "output", "norms")
DTYPE_NAMES = ("float32", "bfloat16")
_F32, _BF16 = "float32", "bfloat16"
PRESETS: dict[str, dict[str, Any]] = {
    "fp32": {**{k: _F32 for k in KINDS}, "optimizer_state": _F32, "grad_accum": _F32},
    "bf16": {**{k: _BF16 for k in KINDS}, "norms": _F32, "optimizer_state": _F32, "grad_accum": _F32},
    "bf16-lean": {**{k: _BF16 for k in KINDS}, "norms": _F32, "optimizer_state": _BF16, "grad_accum": _F32},
}
PRESETS["fp8"] = {**PRESETS["bf16"], "fp8": True}
# A layer's weights by the kind that reads them (norm scales multiply the residual stream).
_WEIGHT_KIND = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention",
                "w_gate": "mlp", "w_up": "mlp", "w_down": "mlp", "router": "router",
                "attn_norm": "embedding", "mlp_norm": "embedding", "q_norm": "attention", "k_norm": "attention",
                "bq": "attention", "bk": "attention", "bv": "attention", "w_shared_gate": "mlp", "w_shared_up": "mlp",
                "w_shared_down": "mlp", "shared_gate": "mlp", "router_bias": "router"}


@dataclasses.dataclass(frozen=True)
class Precision:
    """Resolved dtypes: `embedding` (and the residual stream), `attention` (q/k/v/o, the kernel's inputs), `mlp`
    (dense, expert), `router`, `output` (matmul operands), `norms` (RMSNorm statistics); logits, softmax, losses: fp32.
    `fp8`: the attention, MLP and expert projections run as fp8 GEMMs (models/fp8.py)."""

    embedding: Any = jnp.float32
    attention: Any = jnp.float32
    mlp: Any = jnp.float32
    router: Any = jnp.float32
    output: Any = jnp.float32
    norms: Any = jnp.float32
    optimizer_state: Any = jnp.float32
    grad_accum: Any = jnp.float32
    fp8: bool = False

    @classmethod
    def uniform(cls, dtype: Any) -> Precision:
        """Every module kind in `dtype`, norms fp32: what `train.dtype` alone meant before the policy."""
        d = jnp.dtype(dtype)
        return cls(**{k: (jnp.dtype(jnp.float32) if k == "norms" else d) for k in KINDS})

    @classmethod
    def of(cls, names: dict[str, str]) -> Precision:
        return cls(**{k: v if k == "fp8" else jnp.dtype(v) for k, v in names.items()})

    def weight_dtype(self, name: str) -> Any:
        """The dtype a layer weight is read in (by its parameter name)."""
        return getattr(self, _WEIGHT_KIND[name])

    def cast_layer_weights(self, layers: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """A stack of layer weights, each cast to the dtype its module reads it in (pipeline stages cast once)."""
        return {k: w.astype(self.weight_dtype(k)) for k, w in layers.items()}


def compute_dtype(name: str) -> str:
    """'auto' is bf16 on accelerators and fp32 on CPU (XLA:CPU has no fast bf16 matmuls)."""
    if name == "auto":
        return _F32 if target_backend() == "cpu" else _BF16
    return name


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """The config's `precision.*` keys: a preset, and any of its dtypes set apart from it (null: the preset's)."""

    preset: str = "auto"
    embedding: str | None = None
    attention: str | None = None
    mlp: str | None = None
    router: str | None = None
    output: str | None = None
    norms: str | None = None
    optimizer_state: str | None = None
    grad_accum: str | None = None
    fp8: bool | None = None

    def __post_init__(self) -> None:
        require_choice("precision.preset", self.preset, ("auto", *PRESETS))
        for key in (*KINDS, "optimizer_state", "grad_accum"):
            if getattr(self, key) is not None:
                require_choice(f"precision.{key}", getattr(self, key), DTYPE_NAMES)
        require(self.fp8 is None or isinstance(self.fp8, bool), "precision.fp8", self.fp8, "use true or false")

    def preset_name(self, train_dtype: str) -> str:
        """The preset in force: `preset`, or under 'auto' the one `train.dtype` names."""
        if self.preset != "auto":
            if train_dtype != "auto" and PRESETS[self.preset]["attention"] != train_dtype:
                named = "fp32" if train_dtype == _F32 else "bf16"
                raise ConfigError(f"train.dtype={train_dtype} and precision.preset={self.preset} disagree; set "
                                  f"precision.preset={named} in place of train.dtype, or leave train.dtype=auto.")
            return self.preset
        return "fp32" if compute_dtype(train_dtype) == _F32 else "bf16"

    def resolve(self, train_dtype: str = "auto") -> Precision:
        """The policy of these keys over the preset (see `preset_name`)."""
        names = {"fp8": False, **PRESETS[self.preset_name(train_dtype)]}
        names.update({k: v for k, v in dataclasses.asdict(self).items() if k != "preset" and v is not None})
        return Precision.of(names)


def bytes_per(dtype: Any) -> int:
    """Bytes of one element of `dtype`."""
    return jnp.dtype(dtype).itemsize
