"""LLaMA architecture hyper-parameters, named as in HuggingFace's `LlamaConfig`."""
from __future__ import annotations

import dataclasses
from typing import Any

from mesh.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The model's shape. Field names follow HF so a `config.json` maps onto it directly."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_attention_heads, as in HF
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
                    f"{self.num_attention_heads}; set model.head_dim explicitly or change one of them."
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_key_value_heads={self.num_key_value_heads}; grouped-query attention needs whole groups."
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """Build from a HuggingFace `config.json` dict (unknown HF keys are ignored)."""
        if hf.get("model_type", "llama") != "llama":
            raise ConfigError(f"config.json has model_type={hf.get('model_type')!r}; only 'llama' checkpoints are supported.")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ConfigError(f"config.json asks for rope_type={rope.get('rope_type')!r}; only default RoPE is supported.")
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ConfigError("config.json enables attention_bias or mlp_bias; LLaMA in pjax has no biases.")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["rope_theta"] = float(theta)
        kwargs.setdefault("num_key_value_heads", hf["num_attention_heads"])
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The HuggingFace `config.json` dict for this shape."""
        d = dataclasses.asdict(self)
        d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                 attention_bias=False, mlp_bias=False)
        return d

    @property
    def num_params(self) -> int:
        """Total parameter count (embedding and output layer counted once each, unless tied)."""
        d, f, l, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        hd, h, kv = self.head_dim, self.num_attention_heads, self.num_key_value_heads
        per_layer = d * hd * (2 * h + 2 * kv) + 3 * d * f + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + l * per_layer + d
