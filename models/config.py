"""LLaMA architecture hyper-parameters, named as in HuggingFace's `LlamaConfig`; the Mixtral, Qwen3 and Qwen3-MoE
variants are a few more keys (experts, the top-k weights' renormalisation, per-head q/k RMSNorm)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from mesh.errors import ConfigError


def _number(value: Any) -> bool:
    """A finite int or float, not a bool: what every numeric model key takes."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _non_finite(tree: Any, path: str = "") -> tuple[str, float] | None:
    """(dotted key, value) of the first infinite or NaN number in a JSON tree, or None."""
    if isinstance(tree, float) and not math.isfinite(tree):
        return path, tree
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        found = _non_finite(value, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


# HF's defaults for absent config.json keys (its rms_norm_eps differs from pjax's).
_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
                "initializer_range": 0.02}


# The keys that fix the parameters' shapes or meaning: a checkpoint and the run reading it must agree.
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_theta", "rope_type", "rope_factor",
              "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position_embeddings", "rms_norm_eps",
              "num_local_experts", "num_experts_per_tok", "norm_topk_prob", "qk_norm", "qkv_bias",
              "shared_expert_intermediate_size", "router_score")
MOE_KEYS = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "router_z_loss_coef", "norm_topk_prob",
            "shared_expert_intermediate_size", "router_score")
# HF model types pjax reads: LLaMA's layer, with experts (Mixtral, Qwen2-MoE, Qwen3-MoE), q/k/v biases (Qwen2) or
# per-head q/k norms (Qwen3).
HF_TYPES = ("llama", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def shape_keys(num_local_experts: int) -> tuple[str, ...]:
    """The SHAPE_KEYS a checkpoint of a model with this many experts must match: a dense model (0)
    reads no num_experts_per_tok or norm_topk_prob, so a value there must not refuse a resume."""
    routing = ("num_experts_per_tok", "norm_topk_prob", "shared_expert_intermediate_size", "router_score")
    return SHAPE_KEYS if num_local_experts else tuple(k for k in SHAPE_KEYS if k not in routing)

# RoPE scalings (`models.rope.rope_inv_freq`) and their model keys: HF's rope_scaling keys prefixed "rope_".
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("rope_factor",),
    "llama3": ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position_embeddings"),
}
ROPE_KEYS = ROPE_TYPES["llama3"]  # every scaling key (llama3 uses them all)
# HF rope types pjax refuses, and why (any other unknown type is refused too).
_ROPE_REFUSED = {
    "dynamic": "dynamic NTK scaling varies with each input's length, and pjax's RoPE is fixed",
    "yarn": "YaRN is not implemented",
    "longrope": "LongRoPE is not implemented",
}


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope_theta and rope_* model keys of a config.json, read as transformers reads them: the
    rope_scaling object (transformers 4.x, Meta's Llama 3.1 files) before rope_parameters (5.x), its
    rope_type before the older "type", its rope_theta before the top-level one."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"config.json has rope_scaling={rope!r}; use an object or null.")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        why = _ROPE_REFUSED.get(rope_type, "it is not implemented") if isinstance(rope_type, str) else "not a name"
        raise ConfigError(f"config.json: use {', '.join(ROPE_TYPES)} RoPE; rope_type={rope_type!r} is refused: {why}.")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"config.json sets partial_rotary_factor={partial!r}; pjax rotates the whole head "
                          f"(1.0).")
    theta = rope.get("rope_theta")
    out = {"rope_theta": theta if theta is not None else hf.get("rope_theta", 10000.0), "rope_type": rope_type}
    for key in ROPE_TYPES[rope_type]:
        hf_key = key.removeprefix("rope_")
        if rope.get(hf_key) is None and hf_key != "original_max_position_embeddings":  # that one has a default
            needs = ", ".join(k.removeprefix("rope_") for k in ROPE_TYPES[rope_type])
            raise ConfigError(f"config.json asks for rope_type={rope_type!r} without its {hf_key!r}; add it to "
                              f"rope_scaling ({rope_type} RoPE reads {needs}).")
        out[key] = rope.get(hf_key)
    return out


def _refuse_hf_variants(hf: dict[str, Any], model_type: str) -> None:
    """One line for what a Mixtral or Qwen3 checkpoint may ask that pjax's layer does not do."""
    if model_type == "mixtral" and hf.get("sliding_window") is not None:
        raise ConfigError(f"config.json sets sliding_window={hf['sliding_window']!r}; pjax attends to the whole "
                          f"context, so use a checkpoint with sliding_window null.")
    if model_type.startswith("qwen") and hf.get("use_sliding_window"):
        raise ConfigError("config.json sets use_sliding_window=true; pjax attends to the whole context, so use a "
                          "checkpoint with use_sliding_window false.")
    if model_type.endswith("_moe") and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
        step, dense = hf.get("decoder_sparse_step"), hf.get("mlp_only_layers")
        raise ConfigError(f"config.json makes some layers dense (decoder_sparse_step={step!r}, mlp_only_layers={dense!r}); "
                          f"pjax puts experts in every layer.")


def _hf_experts(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE model keys of a Mixtral or Qwen3-MoE config.json, HF's defaults for absent ones (router_z_loss_coef
    is pjax's: HF has no z-loss); none for a dense model."""
    if model_type == "mixtral":
        keys = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}
        return {k: hf.get(k, v) for k, v in keys.items()}
    if model_type.endswith("_moe"):  # Qwen's: the experts' width is moe_intermediate_size; HF's defaults by version
        qwen2 = model_type == "qwen2_moe"
        return {"num_local_experts": hf.get("num_experts", hf.get("num_local_experts", 60 if qwen2 else 128)),
                "num_experts_per_tok": hf.get("num_experts_per_tok", 4 if qwen2 else 8),
                "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
                "norm_topk_prob": hf.get("norm_topk_prob", False),
                "intermediate_size": hf.get("moe_intermediate_size", 1408 if qwen2 else 768),
                "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 5632) if qwen2 else 0}
    return {}


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
    # HF's rope_scaling as flat keys, null when unused: hashable (a static jit argument), one override each.
    rope_type: str = "default"
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_position_embeddings: int | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int = 4096
    # Megatron's key, not HF's (ARCHITECTURE.md, "A padded vocabulary with masked logits").
    make_vocab_size_divisible_by: int = 128
    # Mixture of Experts in HF Mixtral's names (models/moe.py); 0 experts: dense MLPs. With experts,
    # intermediate_size is each expert's width (HF Qwen3-MoE's moe_intermediate_size).
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to 1 (Mixtral; Qwen-MoE's flag)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on MLP this wide, gated by a sigmoid (0: none)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    # The router's scores: "softmax" (Mixtral, Qwen), or "sigmoid" with a per-expert selection bias that each step
    # moves against the load (DeepSeek-V3's auxiliary-loss-free balancing; models/bias_balance.py).
    router_score: str = "softmax"

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
            if not _number(value) or not value > 0:
                raise ConfigError(f"model.{key}={value!r} is invalid; use a finite number > 0.")
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
            if not _number(value) or value < 0:
                raise ConfigError(f"model.{key}={value!r} is invalid; use a finite number >= 0.")
            object.__setattr__(self, key, float(value))
        shared = self.shared_expert_intermediate_size
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0 or (shared and not self.num_local_experts):
            raise ConfigError(f"model.shared_expert_intermediate_size={shared!r} is invalid; use an integer >= 0, "
                              f"and 0 for a dense model (a shared expert sits beside routed ones).")
        if self.router_score not in ("softmax", "sigmoid"):
            raise ConfigError(f"model.router_score={self.router_score!r} is invalid; choose softmax or sigmoid.")
        for key in ("tie_word_embeddings", "norm_topk_prob", "qk_norm", "qkv_bias"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"model.{key}={getattr(self, key)!r} is invalid; use true or false.")
        self._check_rope_scaling()
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

    def _check_rope_scaling(self) -> None:
        """rope_type is one pjax implements, with exactly the keys it uses, each a valid value."""
        if not isinstance(self.rope_type, str) or self.rope_type not in ROPE_TYPES:
            why = f": {_ROPE_REFUSED[self.rope_type]}" if isinstance(self.rope_type, str) and \
                self.rope_type in _ROPE_REFUSED else ""
            raise ConfigError(f"model.rope_type={self.rope_type!r} is not supported{why}; use one of "
                              f"{', '.join(ROPE_TYPES)}.")
        used = ROPE_TYPES[self.rope_type]
        missing = [f"model.{k}" for k in used if getattr(self, k) is None]
        if missing:
            raise ConfigError(f"model.rope_type={self.rope_type!r} needs {', '.join(missing)}; set "
                              f"{'it' if len(missing) == 1 else 'them'} (HF's rope_scaling keys, prefixed rope_).")
        unused = [f"model.{k}" for k in ROPE_KEYS if k not in used and getattr(self, k) is not None]
        if unused:
            raise ConfigError(f"model.rope_type={self.rope_type!r} does not use {', '.join(unused)}; set "
                              f"{'it' if len(unused) == 1 else 'them'} to null.")
        for key in used:
            value = getattr(self, key)
            if key == "rope_original_max_position_embeddings":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ConfigError(f"model.{key}={value!r} is invalid; use an integer >= 1.")
                continue
            if not _number(value) or not value > 0:
                raise ConfigError(f"model.{key}={value!r} is invalid; use a finite number > 0.")
            object.__setattr__(self, key, float(value))
        if self.rope_type == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                              f"model.rope_low_freq_factor={self.rope_low_freq_factor} (Llama 3.1: 4 and 1).")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """Build from a HuggingFace `config.json` dict (unknown keys ignored, absent ones HF's defaults)."""
        if not isinstance(hf, dict):
            raise ConfigError("config.json must hold a JSON object of model settings.")
        model_type = hf.get("model_type", "llama")
        if model_type not in HF_TYPES:
            raise ConfigError(f"config.json has model_type={model_type!r}; pjax reads {', '.join(map(repr, HF_TYPES))} "
                              f"checkpoints.")
        _refuse_hf_variants(hf, model_type)
        bad = _non_finite(hf)
        if bad is not None:
            raise ConfigError(f"config.json: {bad[0]}={bad[1]!r} is not a finite number; fix the file.")
        missing = [k for k in _HF_REQUIRED if k not in hf]
        if missing:
            raise ConfigError(f"config.json has no {', '.join(missing)}; it is not a complete LLaMA config.")
        rope = _rope_from_hf(hf)
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ConfigError("config.json enables attention_bias or mlp_bias; LLaMA in pjax has no biases.")
        names = {f.name for f in dataclasses.fields(cls)} - {"make_vocab_size_divisible_by", "rope_theta", "rope_type",
                                                             "qk_norm", "qkv_bias", *ROPE_KEYS, *MOE_KEYS}
        kwargs = {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if k in names}, **rope, **_hf_experts(hf, model_type),
                  "qk_norm": model_type.startswith("qwen3"),
                  "qkv_bias": model_type.startswith("qwen2") and bool(hf.get("qkv_bias", True))}
        if kwargs.get("rope_original_max_position_embeddings", 0) is None:  # HF's default for llama3
            kwargs["rope_original_max_position_embeddings"] = kwargs["max_position_embeddings"]
        kwargs.setdefault("num_key_value_heads", hf["num_attention_heads"])
        if kwargs["num_key_value_heads"] is None:
            kwargs["num_key_value_heads"] = hf["num_attention_heads"]
        try:
            return cls(**kwargs)
        except ConfigError as e:  # "model.x=..." -> "config.json: x=...": the file is what to fix
            raise ConfigError("config.json: " + str(e).replace("model.", "")) from None

    def to_hf(self) -> dict[str, Any]:
        """The HuggingFace `config.json` dict for this shape, of the model type `hf_type` names."""
        d = dataclasses.asdict(self)
        del d["make_vocab_size_divisible_by"]  # pjax's padding: HF sees the real vocabulary
        for key in ("rope_type", *ROPE_KEYS):
            del d[key]
        if self.rope_type != "default":
            # Named rope_scaling, rope_theta top-level (Meta's Llama 3.1 files): transformers 4.x and 5.x read it.
            d["rope_scaling"] = {"rope_type": self.rope_type,
                                 **{k.removeprefix("rope_"): getattr(self, k) for k in ROPE_TYPES[self.rope_type]}}
        kind = self.hf_type
        for key in ("qk_norm", "qkv_bias", *(MOE_KEYS if not self.num_local_experts else ("router_z_loss_coef",))):
            del d[key]
        arch = {"llama": "Llama", "mixtral": "Mixtral", "qwen2": "Qwen2", "qwen2_moe": "Qwen2Moe", "qwen3": "Qwen3",
                "qwen3_moe": "Qwen3Moe"}[kind]
        d.update(model_type=kind, architectures=[f"{arch}ForCausalLM"], hidden_act="silu")
        if kind == "mixtral":
            del d["norm_topk_prob"], d["shared_expert_intermediate_size"]
            d.update(sliding_window=None, router_jitter_noise=0.0)
            return d
        if kind == "llama":
            d.update(attention_bias=False, mlp_bias=False)
            return d
        d.update(use_sliding_window=False, sliding_window=None)  # Qwen's
        if kind.startswith("qwen2"):
            d["qkv_bias"] = self.qkv_bias
        if kind.endswith("_moe"):
            d["num_experts"] = d.pop("num_local_experts")
            d.update(moe_intermediate_size=self.intermediate_size, decoder_sparse_step=1, mlp_only_layers=[])
            if kind == "qwen3_moe":
                del d["shared_expert_intermediate_size"]
        return d

    @property
    def hf_type(self) -> str:
        """The HF model type this shape exports as (one line where none has its options)."""
        experts = bool(self.num_local_experts)
        if experts and self.router_score != "softmax":
            raise ConfigError(f"model.router_score={self.router_score} has no HF form pjax exports (Mixtral and Qwen "
                              f"route by softmax); export a model with router_score=softmax.")
        if self.qk_norm and (self.qkv_bias or self.shared_expert_intermediate_size):
            raise ConfigError("model.qk_norm (Qwen3's) with model.qkv_bias or a shared expert (Qwen2's) has no HF "
                              "form; export one family's options.")
        if self.qk_norm:
            return "qwen3_moe" if experts else "qwen3"
        if self.qkv_bias or self.shared_expert_intermediate_size:
            return "qwen2_moe" if experts else "qwen2"
        if experts and not self.norm_topk_prob:
            raise ConfigError("model.norm_topk_prob=false has no HF Mixtral form (Mixtral renormalises its top-k "
                              "weights); export a model with norm_topk_prob=true, or with Qwen's options.")
        return "mixtral" if experts else "llama"

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of make_vocab_size_divisible_by (GPT-2's 50,257 -> 50,304 at 128)."""
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @property
    def num_params(self) -> int:
        """Total parameter count as HF counts it (the real vocabulary, not the padded rows)."""
        d, f, l, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        hd, h, kv = self.head_dim, self.num_attention_heads, self.num_key_value_heads
        experts = self.num_local_experts
        mlp = experts * 3 * d * f + d * experts if experts else 3 * d * f  # MoE: E expert MLPs and the router
        shared = 3 * d * self.shared_expert_intermediate_size + d if self.shared_expert_intermediate_size else 0
        extras = (2 * hd if self.qk_norm else 0) + ((h + 2 * kv) * hd if self.qkv_bias else 0) + shared
        per_layer = d * hd * (2 * h + 2 * kv) + mlp + 2 * d + extras
        return v * d * (1 if self.tie_word_embeddings else 2) + l * per_layer + d
