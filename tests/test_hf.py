"""models/hf.py: HuggingFace LLaMA checkpoints load into pjax (and save back) with the same logits."""
from __future__ import annotations

import copy
import dataclasses
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from jax.sharding import NamedSharding

from mesh import ConfigError, MeshConfig, logical_to_spec, make_mesh
from models import llama
from models.config import ROPE_KEYS, LlamaConfig
from models.hf import load_hf, save_hf

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, intermediate_size=96)  # kv_heads divisible by tp=4 below
VARIANTS = {
    "gqa_untied": dict(tie_word_embeddings=False),
    "tied": dict(tie_word_embeddings=True),
    "rope_theta_500k": dict(rope_theta=500000.0),
    # Scaled RoPE. head_dim 8 has wavelengths 6.3, 63, 628 and 6283 positions: against a 64-token
    # original context (low 1, high 4: bounds 64 and 16), llama3 keeps the first, ramps the second
    # and divides the last two, so every branch of its formula is in the logits.
    "rope_linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "rope_llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                        max_position_embeddings=512),
}
# Meta's Llama 3.1 config.json (the keys pjax reads; rope_scaling verbatim).
LLAMA_31_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
               "max_position_embeddings": 131072, "rope_theta": 500000.0,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
TOKENS = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (2, 16)).astype(np.int32)
_logits = jax.jit(llama.logits, static_argnums=2)


def _hf_model(seed: int, **overrides) -> transformers.LlamaForCausalLM:
    """A random fp32 HF LLaMA; initializer_range raised to 0.1: logits of O(1) (max |logit| ~3), so
    the 1e-5 absolute bound is ~3e-6 relative; at 0.2 (|logit| ~7) fp32 reassociation alone reaches 1e-5."""
    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(**SHAPE, initializer_range=0.1, **overrides)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF initialises norm scales to 1: perturb them so a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _hf_logits(model: transformers.LlamaForCausalLM) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS).long()).logits.float().numpy()


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_ckpt(request, tmp_path_factory) -> tuple[str, np.ndarray]:
    """(checkpoint directory, reference logits) for each variant."""
    model = _hf_model(list(VARIANTS).index(request.param), **VARIANTS[request.param])
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    return path, _hf_logits(model)


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> tuple[transformers.LlamaForCausalLM, str, np.ndarray]:
    """One untied GQA model shared by the sharding, bf16 and error tests: (model, dir, logits)."""
    model = _hf_model(7)
    path = str(tmp_path_factory.mktemp("untied"))
    model.save_pretrained(path)
    return model, path, _hf_logits(model)


def test_load_hf_logits_match_transformers(hf_ckpt):
    path, ref = hf_ckpt
    cfg, params = load_hf(path)
    assert ("lm_head" in params) == (not cfg.tie_word_embeddings)
    assert np.abs(np.asarray(_logits(params, TOKENS, cfg)) - ref).max() <= 1e-5


def test_sharded_hf_checkpoint_loads_same_params(untied, tmp_path):
    model, path, _ = untied
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert not os.path.exists(tmp_path / "model.safetensors")
    (_, whole), (_, sharded) = load_hf(path), load_hf(str(tmp_path))
    jax.tree.map(np.testing.assert_array_equal, whole, sharded)


def test_load_into_shardings_places_each_array_and_keeps_logits(untied):
    _, path, ref = untied
    mesh = make_mesh(MeshConfig(dp=2, tp=4))
    cfg, _ = load_hf(path)
    shardings = jax.tree.map(lambda names: NamedSharding(mesh, logical_to_spec(names)),
                             llama.param_logical_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    _, params = load_hf(path, shardings)
    jax.tree.map(lambda a, s: (a.sharding == s) or pytest.fail(f"{a.sharding} != {s}"), params, shardings)
    assert params["layers"]["wq"].addressable_shards[0].data.shape == (2, 64, 2, 8)  # heads split 4-way
    with jax.set_mesh(mesh):
        out = np.asarray(_logits(params, TOKENS, cfg))
    assert np.abs(out - ref).max() <= 1e-5


def test_bf16_checkpoint_loads_exact_bf16_values(untied, tmp_path):
    model, path, _ = untied
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.save_pretrained(tmp_path)
    cfg, params = load_hf(str(tmp_path))
    _, as_stored = load_hf(str(tmp_path), dtype=None)
    assert as_stored["layers"]["wq"].dtype == ml_dtypes.bfloat16
    sd = {k: v.float().numpy() for k, v in bf16.state_dict().items()}
    h, dh, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    np.testing.assert_array_equal(params["embed"]["embedding"], sd["model.embed_tokens.weight"])
    q1, o0 = sd["model.layers.1.self_attn.q_proj.weight"], sd["model.layers.0.self_attn.o_proj.weight"]
    np.testing.assert_array_equal(params["layers"]["wq"][1], q1.T.reshape(d, h, dh))
    np.testing.assert_array_equal(params["layers"]["wo"][0], o0.T.reshape(h, dh, d))
    np.testing.assert_array_equal(params["lm_head"]["kernel"], sd["lm_head.weight"].T)
    # Every tensor: the fp32 checkpoint rounded to bf16 (torch and ml_dtypes both round to nearest even).
    _, fp32 = load_hf(path)
    rounded = jax.tree.map(lambda b: np.asarray(b).astype(ml_dtypes.bfloat16).astype(np.float32), fp32)
    jax.tree.map(np.testing.assert_array_equal, params, rounded)


@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_save_hf_reloads_in_transformers_with_same_logits(hf_ckpt, tmp_path, max_shard_bytes):
    cfg, params = load_hf(hf_ckpt[0])
    save_hf(params, cfg, str(tmp_path), max_shard_bytes)
    written = "model.safetensors" if max_shard_bytes is None else "model.safetensors.index.json"
    assert os.path.exists(tmp_path / written)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert model.config.tie_word_embeddings == cfg.tie_word_embeddings
    assert model.config.rope_parameters["rope_type"] == cfg.rope_type
    ours = np.asarray(_logits(params, TOKENS, cfg))
    assert np.abs(_hf_logits(model) - ours).max() <= 1e-5


def test_missing_directory_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        load_hf(str(tmp_path / "nope"))


def test_missing_config_json_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        load_hf(str(tmp_path))


def test_missing_weights_file_raises_config_error(untied, tmp_path):
    (tmp_path / "config.json").write_text(open(os.path.join(untied[1], "config.json")).read())
    with pytest.raises(ConfigError, match="no model.safetensors"):
        load_hf(str(tmp_path))


def _copy_without(path: str, out, name: str) -> str:
    """A copy of the checkpoint at `path` in `out` with tensor `name` removed."""
    tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
    del tensors[name]
    safetensors.numpy.save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    return str(out)


@pytest.mark.parametrize("name,message", [
    ("model.layers.1.mlp.up_proj.weight", r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
    ("lm_head.weight", "lm_head.weight"),  # an untied checkpoint must have its output layer
])
def test_missing_weight_names_the_tensor(untied, tmp_path, name, message):
    with pytest.raises(ConfigError, match=message):
        load_hf(_copy_without(untied[1], tmp_path, name))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "rope_scaling" in VARIANTS[v]])
def test_rope_inv_freq_equals_transformers_and_differs_from_unscaled(variant):
    hf_cfg = transformers.LlamaConfig(**SHAPE, **VARIANTS[variant])
    cfg = LlamaConfig.from_hf(hf_cfg.to_dict())
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[cfg.rope_type]
    ours, unscaled = llama.rope_inv_freq(cfg), llama.rope_inv_freq(dataclasses.replace(
        cfg, rope_type="default", **dict.fromkeys(ROPE_KEYS)))
    np.testing.assert_array_equal(ours, init(hf_cfg, None)[0].numpy())
    assert (np.asarray(ours) != np.asarray(unscaled)).any()


def test_llama_31_config_json_reads_and_writes_back_its_rope_scaling():
    cfg = LlamaConfig.from_hf(LLAMA_31_8B)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_position_embeddings, cfg.rope_theta) == ("llama3", 8.0, 1.0, 4.0, 8192, 500000.0)
    written = cfg.to_hf()
    assert written["rope_scaling"] == {**LLAMA_31_8B["rope_scaling"]} and written["rope_theta"] == 500000.0
    assert LlamaConfig.from_hf(written) == cfg
    # As transformers reads them: no original context -> max_position_embeddings; the RoPE object's
    # rope_theta (transformers 5's rope_parameters carries one) before the top-level key.
    rope = {k: v for k, v in LLAMA_31_8B["rope_scaling"].items() if k != "original_max_position_embeddings"}
    assert LlamaConfig.from_hf({**LLAMA_31_8B, "rope_scaling": rope}).rope_original_max_position_embeddings == 131072
    five = {**LLAMA_31_8B, "rope_scaling": None, "rope_parameters": {**rope, "rope_theta": 1e6}}
    assert LlamaConfig.from_hf(five).rope_theta == 1e6


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_type='dynamic' is refused: dynamic NTK scaling"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, r"'yarn' is refused: YaRN"),
    ({"rope_type": "rotating"}, r"use default, linear, llama3 RoPE; rope_type='rotating' is refused: it is not "
                                r"implemented"),
    ({"rope_type": "linear"}, r"rope_type='linear' without its 'factor'; add it to rope_scaling"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, r"without its 'low_freq_factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     r"rope_high_freq_factor=1.0 must exceed rope_low_freq_factor=4.0"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5; pjax rotates the whole"),
])
def test_unsupported_rope_scaling_is_one_config_error(rope, message):
    with pytest.raises(ConfigError, match=message):
        LlamaConfig.from_hf({**LLAMA_31_8B, "rope_scaling": rope})
