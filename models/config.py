"""LLaMA architecture hyper-parameters, named as in HuggingFace's `LlamaConfig`."""
from __future__ import annotations

import dataclasses
from typing import Any

from mesh.errors import ConfigError


# config.json keys without which a LLaMA shape is unknown, and HF's defaults for optional ones
# (HF's rms_norm_eps default differs from pjax's own).
_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
                "initializer_range": 0.02}


# The keys that fix the parameters' shapes or their meaning: a checkpoint and the run reading it
# must agree on all of them.
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_theta", "rms_norm_eps",
              "num_local_experts", "num_experts_per_tok")
MOE_KEYS = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "router_z_loss_coef")


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
    # Megatron's key (not an HF one): the embedding and the output layer hold the vocabulary rounded
    # up to a multiple of this, so that it splits over tp and the output matmul gets aligned shapes.
    # The padded logits are masked out (`padded_vocab_size`, `models.llama.mask_padded_vocab`).
    make_vocab_size_divisible_by: int = 128
    # Mixture of Experts (HF Mixtral's names; models/moe.py). 0 experts: every layer has the dense
    # SwiGLU MLP. Otherwise every layer's MLP is num_local_experts SwiGLUs of intermediate_size,
    # each token routed to num_experts_per_tok of them; the load-balancing loss (Switch/Mixtral) and
    # the router z-loss (ST-MoE) are added to the training loss with these coefficients.
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings", "make_vocab_size_divisible_by"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{key}={value!r} is invalid; use an integer >= 1.")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2):
            raise ConfigError(f"model.head_dim={self.head_dim!r} is invalid; use an even integer >= 2 (RoPE rotates "
                              f"pairs), or null for hidden_size / num_attention_heads.")
        for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"model.{key}={value!r} is invalid; use a number > 0.")
            object.__setattr__(self, key, float(value))
        if not isinstance(self.num_local_experts, int) or isinstance(self.num_local_experts, bool) \
                or self.num_local_experts < 0:
            raise ConfigError(f"model.num_local_experts={self.num_local_experts!r} is invalid; use an integer >= 0 "
                              f"(0: a dense MLP).")
        k = self.num_experts_per_tok
        if self.num_local_experts and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.num_local_experts):
            raise ConfigError(f"model.num_experts_per_tok={k!r} is invalid; use an integer from 1 to "
                              f"model.num_local_experts={self.num_local_experts}.")
        for key in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"model.{key}={value!r} is invalid; use a number >= 0.")
            object.__setattr__(self, key, float(value))
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"model.tie_word_embeddings={self.tie_word_embeddings!r} is invalid; use true or false.")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
                    f"{self.num_attention_heads}; set model.head_dim explicitly or change one of them."
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
            if self.head_dim % 2:
                raise ConfigError(f"model.hidden_size / model.num_attention_heads = {self.head_dim} is odd; RoPE rotates "
                                  f"pairs of dimensions, so choose sizes whose head_dim is even (or set model.head_dim).")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_key_value_heads={self.num_key_value_heads}; grouped-query attention needs whole groups."
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """Build from a HuggingFace `config.json` dict (unknown HF keys are ignored; absent optional
        keys take HF's LlamaConfig defaults). Errors name the config.json key."""
        if not isinstance(hf, dict):
            raise ConfigError("config.json must hold a JSON object of model settings.")
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "mixtral"):
            raise ConfigError(f"config.json has model_type={model_type!r}; only 'llama' and 'mixtral' checkpoints "
                              f"are supported.")
        if model_type == "mixtral" and hf.get("sliding_window") is not None:
            raise ConfigError(f"config.json sets sliding_window={hf['sliding_window']!r}; pjax attends to the whole "
                              f"context, so use a checkpoint with sliding_window null.")
        missing = [k for k in _HF_REQUIRED if k not in hf]
        if missing:
            raise ConfigError(f"config.json has no {', '.join(missing)}; it is not a complete LLaMA config.")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config.json has rope_scaling={rope!r}; use an object or null.")
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ConfigError(f"config.json asks for rope_type={rope.get('rope_type')!r}; only default RoPE is supported.")
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ConfigError("config.json enables attention_bias or mlp_bias; LLaMA in pjax has no biases.")
        # Mixtral's own keys (router_z_loss_coef is pjax's: HF has no z-loss) only from a mixtral config.
        moe = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef") if model_type == "mixtral" else ()
        names = {f.name for f in dataclasses.fields(cls)} - {"make_vocab_size_divisible_by", *MOE_KEYS} | set(moe)
        kwargs = {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if k in names}, "rope_theta": theta}
        if model_type == "mixtral":  # HF MixtralConfig's defaults
            kwargs = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, **kwargs}
        kwargs.setdefault("num_key_value_heads", hf["num_attention_heads"])
        if kwargs["num_key_value_heads"] is None:
            kwargs["num_key_value_heads"] = hf["num_attention_heads"]
        try:
            return cls(**kwargs)
        except ConfigError as e:  # "model.x=..." -> "config.json: x=...": the file is what to fix
            raise ConfigError("config.json: " + str(e).replace("model.", "")) from None

    def to_hf(self) -> dict[str, Any]:
        """The HuggingFace `config.json` dict for this shape (a MixtralConfig's when it has experts)."""
        d = dataclasses.asdict(self)
        del d["make_vocab_size_divisible_by"]  # pjax's padding: HF sees the real vocabulary
        if self.num_local_experts:  # Mixtral (HF has no router z-loss)
            del d["router_z_loss_coef"]
            d.update(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_act="silu",
                     sliding_window=None, router_jitter_noise=0.0)
            return d
        for key in MOE_KEYS:
            del d[key]
        d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                 attention_bias=False, mlp_bias=False)
        return d

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and columns of the output layer: vocab_size rounded up to a
        multiple of make_vocab_size_divisible_by (GPT-2's 50,257 -> 50,304 at 128)."""
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @property
    def num_params(self) -> int:
        """Total parameter count of the model (embedding and output layer counted once each, unless
        tied; the real vocabulary, as HF counts it, not the padded rows)."""
        d, f, l, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        hd, h, kv = self.head_dim, self.num_attention_heads, self.num_key_value_heads
        experts = self.num_local_experts
        mlp = experts * 3 * d * f + d * experts if experts else 3 * d * f  # MoE: E expert MLPs and the router
        per_layer = d * hd * (2 * h + 2 * kv) + mlp + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + l * per_layer + d
