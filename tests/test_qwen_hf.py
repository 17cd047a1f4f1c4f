"""HuggingFace Qwen2, Qwen2-MoE, Qwen3 and Qwen3-MoE checkpoints in pjax: the logits of random transformers models
loaded onto an expert-parallel mesh (Qwen3-MoE fine-grained: 16 experts, top-4, with and without the top-k
renormalisation; Qwen2-MoE with its sigmoid-gated shared expert and q/k/v biases), and each exported checkpoint
read back in transformers tensor for tensor."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from mesh import ConfigError, MeshConfig, make_mesh
from models import llama
from models.config import LlamaConfig
from models.hf import load_hf, save_hf
from pjax.parallel.data_parallel import param_shardings

SHAPE = dict(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, initializer_range=0.2, max_position_embeddings=64, rope_theta=1e6)
TOKENS = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (4, 16))


FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=64, moe_intermediate_size=24, num_experts=16, num_experts_per_tok=4)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(intermediate_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                       shared_expert_intermediate_size=40)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(intermediate_size=48)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(intermediate_size=48)),
}


def random_hf(path, family: str, **overrides):
    """A random fp32 model of `family`, its norm scales and biases perturbed (HF initialises them to 1 and 0: a
    mix-up would not show)."""
    torch.manual_seed(0)
    config, model, shape = FAMILIES[family]
    model = model(config(**SHAPE, **{**shape, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def pjax_logits(path, dp: int) -> tuple[LlamaConfig, np.ndarray]:
    cfg, params = load_hf(str(path))
    mesh = make_mesh(MeshConfig(dp=dp, ep=dp), jax.devices()[:dp])
    params = jax.device_put(params, param_shardings(mesh, cfg, zero=0))
    with jax.set_mesh(mesh):
        logits = jax.jit(llama.logits, static_argnums=2)(params, jnp.asarray(TOKENS, jnp.int32), cfg)
    return cfg, np.asarray(logits)


def hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalised", "softmax_weights"])
def test_qwen3_moe_logits_equal_transformers_with_experts_over_dp(tmp_path, norm_topk_prob):
    model = random_hf(tmp_path / "hf", "qwen3_moe", norm_topk_prob=norm_topk_prob)
    cfg, logits = pjax_logits(tmp_path / "hf", dp=4)  # 4 of the 16 experts per device
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (16, 4, 24)
    assert cfg.qk_norm and cfg.norm_topk_prob == norm_topk_prob
    want = hf_logits(model)
    assert np.max(np.abs(logits - want)) <= 1e-5 * np.max(np.abs(want))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "qwen3", "qwen2"])
def test_an_export_reads_back_in_transformers_tensor_for_tensor(tmp_path, family):
    """The logits on dp 2 (experts split) first, then `save_hf` and transformers' own loader: every tensor equal."""
    model = random_hf(tmp_path / "hf", family, **({"norm_topk_prob": True} if family == "qwen3_moe" else {}))
    cfg, logits = pjax_logits(tmp_path / "hf", dp=2)
    want = hf_logits(model)
    assert np.max(np.abs(logits - want)) <= 1e-5 * np.max(np.abs(want))
    assert cfg.hf_type == family
    _, params = load_hf(str(tmp_path / "hf"))
    save_hf(params, cfg, str(tmp_path / "out"))
    again = FAMILIES[family][1].from_pretrained(tmp_path / "out").eval()
    theirs, ours = model.state_dict(), again.state_dict()
    assert theirs.keys() == ours.keys()
    for name in theirs:
        assert torch.equal(theirs[name], ours[name]), name
    if family.endswith("_moe"):
        assert again.config.num_experts == cfg.num_local_experts and again.config.norm_topk_prob == cfg.norm_topk_prob


@pytest.mark.parametrize("change,message", [
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"model_type": "deepseek_v3"}, "model_type='deepseek_v3'"),
])
def test_what_pjax_s_layer_does_not_do_is_one_line(tmp_path, change, message):
    random_hf(tmp_path / "hf", "qwen3_moe")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        load_hf(str(tmp_path / "hf"))
    assert "\n" not in str(e.value)


def test_options_with_no_hf_form_are_one_line_at_export():
    with pytest.raises(ConfigError, match="norm_topk_prob=false has no HF Mixtral form"):
        LlamaConfig(num_local_experts=4, norm_topk_prob=False).to_hf()
    with pytest.raises(ConfigError, match="has no HF form"):
        LlamaConfig(num_local_experts=4, qk_norm=True, qkv_bias=True).to_hf()
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size=8 is invalid"):
        LlamaConfig(shared_expert_intermediate_size=8)
