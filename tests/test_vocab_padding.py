"""A vocabulary padded to a multiple of make_vocab_size_divisible_by computes exactly what the
unpadded model does: GPT-2's 50,257 tokens split over tp=2 and tp=4, HF sees the real vocabulary,
and no padded logit ever takes probability mass or wins an argmax."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
import transformers

from mesh import MeshConfig, make_mesh
from models import llama
from models.config import LlamaConfig
from models.hf import load_hf, save_hf
from pjax.config import TrainConfig
from pjax.eval import evaluate
from pjax.generate import generate
from pjax.step import build_trainer

GPT2_VOCAB = 50257
CFG = LlamaConfig(vocab_size=GPT2_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, initializer_range=0.1)
TC = TrainConfig(batch_size=4, seq_len=32, dtype="float32")


def test_gpt2_vocabulary_is_padded_to_a_multiple_of_128():
    assert CFG.padded_vocab_size == 50304
    assert dataclasses.replace(CFG, make_vocab_size_divisible_by=1).padded_vocab_size == GPT2_VOCAB
    assert dataclasses.replace(CFG, vocab_size=4096).padded_vocab_size == 4096  # a multiple already: untouched
    params = jax.eval_shape(lambda: llama.init_params(CFG, jax.random.key(0)))
    assert params["embed"]["embedding"].shape == (50304, 64) and params["lm_head"]["kernel"].shape == (64, 50304)
    assert "make_vocab_size_divisible_by" not in CFG.to_hf() and CFG.to_hf()["vocab_size"] == GPT2_VOCAB


def _batch() -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, GPT2_VOCAB, (1, TC.batch_size, TC.seq_len + 1)).astype(np.int32)
    tokens[0, 0, :8] = GPT2_VOCAB - 1 - np.arange(8)  # the last real ids, which share a tp shard with the padding
    positions = np.broadcast_to(np.arange(TC.seq_len, dtype=np.int32), (1, TC.batch_size, TC.seq_len))
    return {"inputs": tokens[..., :-1], "labels": tokens[..., 1:], "positions": positions}


def _loss_and_grads(cfg: LlamaConfig, params, tp: int):
    mesh = make_mesh(MeshConfig(dp=1, tp=tp), jax.devices()[:tp])
    trainer = build_trainer(mesh, cfg, TC)
    params = jax.device_put(params, trainer.state_sharding.params)
    loss, grads = trainer.grads(params, jax.device_put(_batch(), trainer.batch_sharding))
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def one_device():
    params = jax.tree.map(np.asarray, llama.init_params(CFG, jax.random.key(1)))
    return params, *_loss_and_grads(CFG, params, 1)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_vocabulary_under_tp_gives_the_one_device_loss_and_gradients(one_device, tp):
    params, loss, grads = one_device
    tp_loss, tp_grads = _loss_and_grads(CFG, params, tp)
    assert abs(tp_loss - loss) <= 1e-5 * abs(loss), (tp_loss, loss)
    for got, want in zip(jax.tree.leaves(tp_grads), jax.tree.leaves(grads)):
        # the vocabulary's sums split over tp: measured 1.5e-6 of a leaf's largest, each entry within atol alone
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)


def test_padded_model_equals_the_unpadded_one_and_padding_gets_no_gradient(one_device):
    params, loss, grads = one_device
    unpadded_cfg = dataclasses.replace(CFG, make_vocab_size_divisible_by=1)
    cut = {**params, "embed": {"embedding": params["embed"]["embedding"][:GPT2_VOCAB]},
           "lm_head": {"kernel": params["lm_head"]["kernel"][:, :GPT2_VOCAB]}}
    unpadded_loss, unpadded_grads = _loss_and_grads(unpadded_cfg, cut, 1)
    assert abs(unpadded_loss - loss) <= 1e-6 * abs(loss), (unpadded_loss, loss)
    np.testing.assert_allclose(grads["lm_head"]["kernel"][:, :GPT2_VOCAB], unpadded_grads["lm_head"]["kernel"],
                               atol=1e-7, rtol=1e-5)
    assert not grads["lm_head"]["kernel"][:, GPT2_VOCAB:].any()  # masked logits: exactly zero gradient
    assert not grads["embed"]["embedding"][GPT2_VOCAB:].any()  # never looked up


def test_padded_logits_take_no_mass_and_never_win_argmax(one_device):
    params, _, _ = one_device
    mesh = make_mesh(MeshConfig(dp=2, tp=2), jax.devices()[:4])
    shardings = build_trainer(mesh, CFG, TC).state_sharding.params
    boosted = jax.tree.map(np.copy, params)
    boosted["lm_head"]["kernel"][:, GPT2_VOCAB:] = 1e4  # padding that would win every argmax if it counted
    tokens = np.random.default_rng(2).integers(0, GPT2_VOCAB, 300).astype(np.int32)
    results = [evaluate(jax.device_put(p, shardings), CFG, tokens, mesh, seq_len=32) for p in (params, boosted)]
    assert results[0] == results[1]
    new = generate(jax.device_put(boosted, shardings), CFG, [5, 6, 7], mesh, max_new_tokens=6)
    assert len(new) == 6 and max(new) < GPT2_VOCAB
    assert new == generate(jax.device_put(params, shardings), CFG, [5, 6, 7], mesh, max_new_tokens=6)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_checkpoint_with_gpt2_vocabulary_round_trips_with_the_real_vocabulary(tmp_path, tied):
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=GPT2_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                                      tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    model.save_pretrained(tmp_path / "in")
    cfg, params = load_hf(str(tmp_path / "in"))
    assert cfg.vocab_size == GPT2_VOCAB and params["embed"]["embedding"].shape[0] == 50304
    assert not np.asarray(params["embed"]["embedding"])[GPT2_VOCAB:].any()  # padded with zeros
    tokens = np.array([[GPT2_VOCAB - 1, 0, 17, 50000, 3]], np.int32)
    ours = np.asarray(jax.jit(llama.logits, static_argnums=2)(params, tokens, cfg))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
    assert ours.shape == theirs.shape and np.abs(ours - theirs).max() <= 1e-5
    save_hf(params, cfg, str(tmp_path / "out"))
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.vocab_size == GPT2_VOCAB
    assert again.get_input_embeddings().weight.shape == (GPT2_VOCAB, 32)
    with torch.no_grad():
        np.testing.assert_allclose(again(torch.from_numpy(tokens).long()).logits.numpy(), theirs, atol=1e-6)
