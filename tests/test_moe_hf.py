"""HuggingFace Mixtral checkpoints in pjax: the logits and the load-balancing loss of a random
`transformers.MixtralForCausalLM` (top-2 of 8 and top-1 of 4), loaded onto an expert-parallel mesh,
and the export that transformers reads back."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from mesh import MeshConfig, make_mesh
from models import llama
from models.hf import load_hf, save_hf
from models.moe import aux_losses
from hf_helpers import short_text, transformers_mean_loss
from pjax import eval as pjax_eval
from pjax.data.text import load_tokenizer
from pjax.parallel.data_parallel import param_shardings

SHAPE = dict(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=64)


def random_hf_mixtral(path, experts: int, top_k: int, **shape) -> transformers.MixtralForCausalLM:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**{**SHAPE, **shape}, num_local_experts=experts, num_experts_per_tok=top_k,
                                        router_jitter_noise=0.0, output_router_logits=True)
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("experts,top_k,dp", [(8, 2, 4), (4, 1, 2)], ids=["top2_of_8_dp4", "top1_of_4_dp2"])
def test_mixtral_logits_and_aux_loss_equal_transformers(tmp_path, experts, top_k, dp):
    model = random_hf_mixtral(tmp_path / "hf", experts, top_k)
    tokens = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (4, 16))
    with torch.no_grad():
        out = model(torch.tensor(tokens), labels=torch.tensor(tokens))
    mesh = make_mesh(MeshConfig(dp=dp, ep=dp), jax.devices()[:dp])
    cfg, params = load_hf(str(tmp_path / "hf"))
    params = jax.device_put(params, param_shardings(mesh, cfg, zero=0))  # experts split over ep
    assert params["layers"]["w_gate"].sharding.spec[1] == "ep"

    def forward(params, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        _, stats = llama.final_hidden(params, tokens, positions, cfg)
        return llama.logits(params, tokens, cfg), aux_losses(stats, cfg.num_hidden_layers)["aux_loss"]

    with jax.set_mesh(mesh):
        logits, aux = jax.jit(forward)(params, jnp.asarray(tokens, jnp.int32))
    want = out.logits.numpy()
    assert np.max(np.abs(np.asarray(logits) - want)) <= 1e-5 * np.max(np.abs(want))
    assert float(aux) == pytest.approx(float(out.aux_loss), rel=1e-5)


def test_mixtral_export_reads_back_in_transformers_tensor_for_tensor(tmp_path):
    model = random_hf_mixtral(tmp_path / "hf", 4, 2)
    cfg, params = load_hf(str(tmp_path / "hf"))
    save_hf(params, cfg, str(tmp_path / "out"), max_shard_bytes=200_000)  # sharded, with an index
    again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.num_local_experts == 4 and again.config.num_experts_per_tok == 2
    theirs, ours = model.state_dict(), again.state_dict()
    assert theirs.keys() == ours.keys()
    for name in theirs:
        assert torch.equal(theirs[name], ours[name]), name


def test_eval_of_a_mixtral_with_6_experts_needs_no_mesh_flags(tmp_path, monkeypatch, capsys):
    """6 experts on 8 devices: the fitted mesh is dp=4 x tp=2, the experts over ep=2 (the largest divisor of dp
    that 6 divides), copied over dp's 2 replicas."""
    model = random_hf_mixtral(tmp_path / "hf", 6, 2, vocab_size=4096)
    model.config.output_router_logits = False  # pjax.eval's loss is the next-token loss alone
    text = short_text(tmp_path / "text.txt", 500)
    tokenizer = "data/tokenizer/bpe4096"  # the shipped one (pjax.assets)
    reference = transformers_mean_loss(model, pjax_eval.read_tokens(str(text), load_tokenizer(tokenizer)), 32)
    monkeypatch.setattr(pjax_eval, "force_cpu_devices", lambda *a: 8)  # the 8 forced devices exist already
    assert pjax_eval.main(["--hf", str(tmp_path / "hf"), "--text", str(text), "--tokenizer", tokenizer,
                           "train.seq_len=32"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("mesh chosen for the model: dp=4 ep=2 tp=2"), out[0]
    assert abs(json.loads(out[-1])["loss"] - reference) <= 1e-5
