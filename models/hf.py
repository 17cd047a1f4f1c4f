"""HuggingFace LLaMA, Mixtral, Qwen2(-MoE) and Qwen3(-MoE) checkpoints (config.json + safetensors) <-> pjax parameters.

HF stores one tensor per layer (and expert), Linear weights as (out, in); pjax stacks the layers and stores kernels as
(in, out), head dimensions split out, so `x @ W` and sharding by head are direct. HF's q/k rows are in rotate-half
order already (unlike Meta's). Loading memory-maps the files (bf16 needs no torch); each device reads only its slice."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import ml_dtypes
import numpy as np

from mesh.errors import ConfigError, first_line
from models.config import LlamaConfig

Params = dict[str, Any]

# safetensors dtype codes (little-endian); bf16 and fp8 from ml_dtypes, as in JAX.
_DTYPES: dict[str, Any] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One pjax parameter: its HF name (`{i}`: per layer, `{j}`: per expert) and pjax shape; `n_in` leading
    pjax dims form the HF Linear's input dim (0: not a Linear, copied as is)."""

    path: tuple[str, str]
    hf_name: str
    shape: tuple[int, ...]  # per layer and expert
    n_in: int = 0
    unpadded: tuple[int, ...] | None = None  # without the vocabulary padding
    experts: int = 0
    flat: bool = False  # HF keeps it 1-D (a bias over the heads' outputs)

    @property
    def stacked(self) -> bool:
        return self.path[0] == "layers"

    def names(self, num_layers: int) -> list[list[str]]:
        layers = range(num_layers) if self.stacked else [None]
        return [[self.hf_name.format(i=i, j=j) for j in range(self.experts or 1)] for i in layers]

    @property
    def lead(self) -> int:
        """How many leading axes index its HF tensors: layer, then expert."""
        return int(self.stacked) + int(bool(self.experts))

    def stack_shape(self, num_layers: int) -> tuple[int, ...]:
        return (*((num_layers,) if self.stacked else ()), *((self.experts,) if self.experts else ()), *self.shape)

    @property
    def real(self) -> tuple[int, ...]:
        return self.unpadded or self.shape

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.flat:
            return (math.prod(self.real),)
        if not self.n_in:
            return self.real
        return (math.prod(self.real[self.n_in:]), math.prod(self.real[:self.n_in]))

    def to_pjax(self, w: np.ndarray) -> np.ndarray:
        """HF layout -> pjax layout, as a view: a memory-mapped tensor stays unread."""
        return w.T.reshape(self.real) if self.n_in else w.reshape(self.real) if self.flat else w

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        w = w[tuple(slice(0, n) for n in self.real)]
        if self.flat:
            return np.ascontiguousarray(w.reshape(-1))
        return np.ascontiguousarray(w.reshape(math.prod(w.shape[:self.n_in]), -1).T if self.n_in else w)


def tensor_table(cfg: LlamaConfig) -> list[_Tensor]:
    """HF name -> pjax path and shape, for this config."""
    d, f, v, vp = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.padded_vocab_size
    h, k, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pre = "model.layers.{i}."
    table = [
        _Tensor(("embed", "embedding"), "model.embed_tokens.weight", (vp, d), unpadded=(v, d)),
        _Tensor(("layers", "attn_norm"), pre + "input_layernorm.weight", (d,)),
        _Tensor(("layers", "wq"), pre + "self_attn.q_proj.weight", (d, h, dh), 1),
        _Tensor(("layers", "wk"), pre + "self_attn.k_proj.weight", (d, k, dh), 1),
        _Tensor(("layers", "wv"), pre + "self_attn.v_proj.weight", (d, k, dh), 1),
        _Tensor(("layers", "wo"), pre + "self_attn.o_proj.weight", (h, dh, d), 2),
        _Tensor(("layers", "mlp_norm"), pre + "post_attention_layernorm.weight", (d,)),
        _Tensor(("layers", "w_gate"), pre + "mlp.gate_proj.weight", (d, f), 1),
        _Tensor(("layers", "w_up"), pre + "mlp.up_proj.weight", (d, f), 1),
        _Tensor(("layers", "w_down"), pre + "mlp.down_proj.weight", (f, d), 1),
        _Tensor(("final_norm", "scale"), "model.norm.weight", (d,)),
    ]
    kind = cfg.hf_type
    if cfg.num_local_experts:  # Mixtral's names, or Qwen-MoE's (an MLP's per expert)
        e = cfg.num_local_experts
        moe, names = ((pre + "block_sparse_moe.", ("w1", "w3", "w2")) if kind == "mixtral"
                      else (pre + "mlp.", ("gate_proj", "up_proj", "down_proj")))
        table[7:10] = [
            _Tensor(("layers", "router"), moe + "gate.weight", (d, e), 1),
            _Tensor(("layers", "w_gate"), moe + f"experts.{{j}}.{names[0]}.weight", (d, f), 1, experts=e),
            _Tensor(("layers", "w_up"), moe + f"experts.{{j}}.{names[1]}.weight", (d, f), 1, experts=e),
            _Tensor(("layers", "w_down"), moe + f"experts.{{j}}.{names[2]}.weight", (f, d), 1, experts=e),
        ]
    fs = cfg.shared_expert_intermediate_size
    if fs:  # Qwen2-MoE's shared expert and its gate
        shared = pre + "mlp.shared_expert."
        table += [_Tensor(("layers", "w_shared_gate"), shared + "gate_proj.weight", (d, fs), 1),
                  _Tensor(("layers", "w_shared_up"), shared + "up_proj.weight", (d, fs), 1),
                  _Tensor(("layers", "w_shared_down"), shared + "down_proj.weight", (fs, d), 1),
                  _Tensor(("layers", "shared_gate"), pre + "mlp.shared_expert_gate.weight", (d, 1), 1)]
    if cfg.qk_norm:  # Qwen3's per-head RMSNorm scales
        table[6:6] = [_Tensor(("layers", "q_norm"), pre + "self_attn.q_norm.weight", (dh,)),
                      _Tensor(("layers", "k_norm"), pre + "self_attn.k_norm.weight", (dh,))]
    if cfg.qkv_bias:  # Qwen2's
        table[6:6] = [_Tensor(("layers", name), pre + f"self_attn.{proj}.bias", (n, dh), flat=True)
                      for name, proj, n in (("bq", "q_proj", h), ("bk", "k_proj", k), ("bv", "v_proj", k))]
    if not cfg.tie_word_embeddings:  # tied: HF reuses embed_tokens and may omit lm_head.weight
        table.append(_Tensor(("lm_head", "kernel"), "lm_head.weight", (d, vp), 1, unpadded=(d, v)))
    return table


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Memory-map a .safetensors file: {name: read-only array view}; nothing is read until used."""
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        n = int.from_bytes(buf[:8].tobytes(), "little")
        header = json.loads(buf[8:8 + n].tobytes())
        header.pop("__metadata__", None)
        out = {}
        for name, info in header.items():
            if info["dtype"] not in _DTYPES:
                raise ConfigError(f"tensor {name!r} in {path} has unsupported dtype {info['dtype']}; "
                                  "convert the checkpoint to F32, F16 or BF16.")
            begin, end = (8 + n + o for o in info["data_offsets"])
            if end > len(buf):
                raise ConfigError(f"{path} is truncated (tensor {name!r} ends past the end of the file); "
                                  f"copy or download it again.")
            out[name] = buf[begin:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{path} is not a valid safetensors file ({first_line(e, 40)}); re-save or re-download "
                          f"it.") from None
    return out


def _open_checkpoint(path: str) -> dict[str, np.ndarray]:
    """All tensors of a single-file or sharded checkpoint directory, memory-mapped."""
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(single):  # HF's own preference when both are present
        return read_safetensors(single)
    if not os.path.exists(index):
        raise ConfigError(f"no model.safetensors or model.safetensors.index.json in {path}; "
                          "save the checkpoint as safetensors (save_pretrained's default).")
    try:
        with open(index, encoding="utf-8") as fh:
            shard_names = sorted(set(json.load(fh)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise ConfigError(f"{index} is not a valid safetensors index ({first_line(e, 40)}); copy the checkpoint "
                          f"again.") from None
    tensors: dict[str, np.ndarray] = {}
    for shard in shard_names:
        if not os.path.exists(os.path.join(path, shard)):
            raise ConfigError(f"model.safetensors.index.json in {path} names {shard}, which is missing; "
                              "copy the whole checkpoint.")
        tensors.update(read_safetensors(os.path.join(path, shard)))
    return tensors


def _mapped(t: _Tensor, tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
    """The HF tensor `name`, checked against the config, as a pjax-layout view."""
    if name not in tensors and t.path == ("lm_head", "kernel"):
        raise ConfigError("the checkpoint has no lm_head.weight but its config.json says tie_word_embeddings="
                          "false; set \"tie_word_embeddings\": true in config.json if the output layer is "
                          "the embedding.")
    if name not in tensors:
        raise ConfigError(f"the checkpoint has no tensor {name!r}; "
                          "it does not match its config.json (or is incomplete).")
    if tuple(tensors[name].shape) != t.hf_shape:
        raise ConfigError(f"tensor {name!r} has shape {tuple(tensors[name].shape)} but config.json implies "
                          f"{t.hf_shape}; the weights do not match the config.")
    return t.to_pjax(tensors[name])


def _slicer(t: _Tensor, tensors: dict[str, np.ndarray], num_layers: int, dtype) -> tuple[tuple[int, ...], Any]:
    """The pjax shape of `t` and a function index -> host array holding just that slice of it."""
    parts = [[_mapped(t, tensors, name) for name in names] for names in t.names(num_layers)]
    shape = t.stack_shape(num_layers)
    lead = t.lead

    def host(idx: tuple[slice, ...]) -> np.ndarray:
        # A fresh copy: JAX could alias a view of the map on CPU.
        out_dtype = dtype or parts[0][0].dtype
        if not lead:
            return _read_padded(parts[0][0], idx, t.shape, out_dtype)
        layers = range(num_layers)[idx[0]] if t.stacked else [0]
        experts = range(t.experts)[idx[lead - 1]] if t.experts else [0]
        out = np.empty((len(layers), len(experts), *parts[0][0][idx[lead:]].shape), out_dtype)
        for a, i in enumerate(layers):
            for b, j in enumerate(experts):
                out[a, b] = parts[i][j][idx[lead:]]
        return out.reshape(*(len(layers),) * t.stacked, *(len(experts),) * bool(t.experts), *out.shape[2:])

    return shape, host


def _read_padded(w: np.ndarray, idx: tuple[slice, ...], shape: tuple[int, ...], dtype) -> np.ndarray:
    """w[idx] as a fresh array, `idx` indexing `shape` (w zero-padded at the end: the padded vocabulary)."""
    idx = tuple(slice(*s.indices(n)) for s, n in zip(idx, shape))
    out = np.zeros([s.stop - s.start for s in idx], dtype)
    inside = tuple(slice(s.start, min(s.stop, n)) for s, n in zip(idx, w.shape))
    if all(s.stop > s.start for s in inside):
        out[tuple(slice(0, s.stop - s.start) for s in inside)] = w[inside]
    return out


def read_hf_config(path: str) -> LlamaConfig:
    """The model shape in a HuggingFace checkpoint directory's config.json (one-line errors)."""
    if not os.path.isdir(path):
        raise ConfigError(f"{path} is not a directory; pass a HuggingFace LLaMA checkpoint directory.")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ConfigError(f"{path} has no config.json; pass a HuggingFace LLaMA checkpoint directory.")
    try:
        with open(cfg_file, encoding="utf-8") as fh:
            hf = json.load(fh)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{cfg_file} is not a readable JSON file ({first_line(e, 40)}); re-save the "
                          f"checkpoint.") from None
    try:
        return LlamaConfig.from_hf(hf)
    except ConfigError as e:
        said = str(e)  # "config.json ..." names the file by its path
        raise ConfigError(f"{cfg_file} {said.removeprefix('config.json ')}" if said.startswith("config.json ")
                          else f"{cfg_file}: {said.removeprefix('config.json: ')}") from None


def load_hf(path: str, shardings: Params | None = None, dtype=np.float32,
            make_vocab_size_divisible_by: int = 128) -> tuple[LlamaConfig, Params]:
    """A HuggingFace checkpoint directory: (config, parameters) placed by `shardings`; `dtype=None` keeps its dtype."""
    cfg = dataclasses.replace(read_hf_config(path), make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    tensors = _open_checkpoint(path)
    params: Params = {}
    for t in tensor_table(cfg):
        shape, host = _slicer(t, tensors, cfg.num_hidden_layers, dtype)
        if shardings is None:
            arr = jax.device_put(host(tuple(slice(None) for _ in shape)))
        else:
            arr = jax.make_array_from_callback(shape, shardings[t.path[0]][t.path[1]], host)
        params.setdefault(t.path[0], {})[t.path[1]] = arr
    return cfg, params


def save_hf(params: Params, cfg: LlamaConfig, out_dir: str, max_shard_bytes: int | None = None,
            dtype: str = "fp32") -> None:
    """Write `params` (on host or devices) as a HuggingFace checkpoint in `dtype` ('fp32' or 'bf16'), in shards of
    `max_shard_bytes` if given (`models.hf_shards`)."""
    from models import hf_shards

    # np.asarray of a jax.Array is cached on it: a parameter leaves its devices once
    hf_shards.write(cfg, out_dir, lambda path, index: np.asarray(params[path[0]][path[1]])[index], dtype,
                    max_shard_bytes)
