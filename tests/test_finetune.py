"""docs/finetune.md walked end to end: a checkpoint transformers wrote, a JSONL file of the user's, `--config
finetune`, an export in shards that transformers reloads with pjax's logits."""
from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from hf_helpers import SHIPPED, random_hf_llama
from models import llama
from models.config import LlamaConfig
from pjax import export as pjax_export
from pjax import train as pjax_train
from pjax.checkpoint.checkpointer import Checkpointer
from pjax.config_io import load_config, named_keys
from pjax.fit import adopt_hf_model

SHAPE = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=512)


@pytest.fixture(scope="module")
def downloaded(tmp_path_factory):
    """What `huggingface-cli download` leaves: config.json, safetensors and the model's tokenizer.json."""
    path = tmp_path_factory.mktemp("hf")
    model = random_hf_llama(path, seed=3, **SHAPE)
    shutil.copy(SHIPPED / "data/tokenizer/bpe4096/tokenizer.json", path / "tokenizer.json")
    return path, model


def test_a_named_config_s_model_section_only_states_a_default(downloaded):
    """--config llama3-8b with a checkpoint of another shape: the checkpoint's shape and tokenizer, not a refusal;
    a model key on the command line that disagrees is still refused in one line."""
    path, _ = downloaded
    overrides = [f"train.init_from={path}"]
    cfg = adopt_hf_model(load_config("llama3-8b", overrides), named_keys(None, overrides))
    assert (cfg.model.hidden_size, cfg.model.max_position_embeddings) == (64, 512)
    assert cfg.data.tokenizer == str(path / "tokenizer.json") and cfg.train.seq_len == 8192  # the rest: llama3-8b's
    with pytest.raises(Exception, match=r"model.max_position_embeddings=8192 \(config.json: 512\)"):
        clash = [*overrides, "model.max_position_embeddings=8192"]
        adopt_hf_model(load_config("llama3-8b", clash), named_keys(None, clash))


def test_finetune_a_hf_checkpoint_on_a_jsonl_file_then_export_it_in_shards(downloaded, tmp_path, monkeypatch, capsys):
    path, original = downloaded
    monkeypatch.setattr(pjax_train, "force_cpu_devices", lambda *a: 8)  # the 8 forced devices exist (conftest)
    text = (SHIPPED / "data/prideprejudice.txt").read_text(encoding="utf-8")[:20_000]
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for p in text.split("\n\n") if p.strip()))
    ckpt = tmp_path / "ckpt"
    assert pjax_train.main(["--config", "finetune", "--no_progress", f"train.init_from={path}", f"data.path={jsonl}",
                            "train.steps=3", "train.seq_len=64", "train.batch_size=8", "train.grad_accum=2",
                            "train.warmup_steps=1", "log.eval_every=0", f"log.dir={tmp_path}/log",
                            f"checkpoint.dir={ckpt}", f"data.cache_dir={tmp_path}/cache"]) == 0
    assert "mesh chosen for the model: dp=4 tp=2" in capsys.readouterr().out
    run = load_config(str(ckpt / "config.yaml"))
    assert run.model == LlamaConfig.from_hf(original.config.to_dict()) and run.train.lr == 2e-5 and run.train.zero == 3

    out = tmp_path / "export"
    assert pjax_export.main(["--checkpoint", str(ckpt), "--out", str(out), "--max-shard-size", "200KB"]) == 0
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    with Checkpointer(str(ckpt), read_only=True) as reader:
        host = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        _, cfg, params = reader.restore_params(lambda m: jax.tree.map(lambda _: host, llama.param_logical_axes(m),
                                                                      is_leaf=lambda x: isinstance(x, tuple)))
    tokens = np.random.default_rng(0).integers(0, 4096, (2, 32)).astype(np.int32)
    ours = np.asarray(jax.jit(llama.logits, static_argnums=2)(params, tokens, cfg.model))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reloaded(torch.from_numpy(tokens).long()).logits.numpy()
        before = original(torch.from_numpy(tokens).long()).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-5  # fp32 on both sides
    assert np.abs(theirs - before).max() > 1e-4  # and the 3 steps did move the weights
