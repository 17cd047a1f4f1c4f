"""pjax/fit.py and mesh.validate.fit_mesh: a model from a checkpoint runs with no mesh flags, on a
mesh it divides into (SmolLM2-135M's 3 kv-heads, GPT-2's vocabulary); a mesh the user names is
used as given."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hf_helpers import SHIPPED, random_hf_llama, short_text, transformers_mean_loss
from mesh import MeshConfig
from mesh.validate import fit_mesh
from pjax import eval as pjax_eval
from pjax import train as pjax_train
from pjax.config_io import named_keys
from pjax.data.text import load_tokenizer
from pjax.fit import names_a_mesh

@pytest.mark.parametrize("kv_heads,devices,per_host,vocab,want", [
    (3, 8, 8, 49152, MeshConfig(dp=8, tp=1)),  # SmolLM2-135M on 8 devices: 3 does not divide 8
    (3, 6, 6, 49152, MeshConfig(dp=2, tp=3)),
    (32, 8, 8, 32000, MeshConfig(dp=1, tp=8)),  # LLaMA-2-7B
    (8, 64, 8, 128256, MeshConfig(dp=8, tp=8)),  # LLaMA-3-8B on 8 hosts: tp stays inside a host
    (4, 8, 8, 50304, MeshConfig(dp=2, tp=4)),  # GPT-2's vocabulary padded to 50,304
    (4, 8, 8, 50257, MeshConfig(dp=8, tp=1)),  # unpadded (make_vocab_size_divisible_by=1): odd, tp=1
    (2, 1, 1, 4096, MeshConfig(dp=1, tp=1)),
])
def test_fit_mesh_picks_the_largest_kv_head_divisor_that_fits_a_host(kv_heads, devices, per_host, vocab, want):
    assert fit_mesh(devices, per_host, num_kv_heads=kv_heads, intermediate_size=1536,
                    padded_vocab_size=vocab) == want


@pytest.mark.parametrize("kv_heads,experts,devices,per_host,want", [
    (2, 8, 8, 8, MeshConfig(dp=4, tp=2, ep=4)),  # mixtral-tiny: 2 experts per device
    (8, 8, 8, 8, MeshConfig(dp=1, tp=8, ep=1)),  # Mixtral-8x7B on one host
    (8, 8, 64, 8, MeshConfig(dp=8, tp=8, ep=8)),  # ... on 8 hosts
    (8, 8, 128, 8, MeshConfig(dp=16, tp=8, ep=8)),  # ... on 16: the experts copied over 2 replicas
    (2, 6, 8, 8, MeshConfig(dp=4, tp=2, ep=2)),  # 6 experts: ep 2 divides both; every device used
    (1, 6, 8, 8, MeshConfig(dp=8, tp=1, ep=2)),
    (2, 3, 8, 8, MeshConfig(dp=4, tp=2, ep=1)),  # 3 experts: on every device
])
def test_fit_mesh_splits_an_moe_model_s_experts_over_ep(kv_heads, experts, devices, per_host, want):
    mesh = fit_mesh(devices, per_host, num_kv_heads=kv_heads, intermediate_size=1536, padded_vocab_size=4096,
                    num_experts=experts)
    assert mesh == want and experts % mesh.ep == 0 and mesh.dp % mesh.ep == 0


def test_named_keys_are_the_users_not_the_default_configs():
    assert named_keys(None, ["train.steps=3"]) == {"train.steps"}
    assert not names_a_mesh(named_keys(None, ["train.steps=3"]))  # debug.yaml's mesh is not the user's
    assert names_a_mesh(named_keys(None, ["mesh.tp=1"]))
    assert "mesh.tp" in named_keys("picotron-cpu", [])  # a config file the user named counts


@pytest.fixture(scope="module")
def smollm_like(tmp_path_factory):
    """A random HF LLaMA with SmolLM2-135M's head layout (9 heads, 3 kv-heads) and GPT-2's vocabulary,
    a short text, and transformers' mean loss over it in windows of 32."""
    root = tmp_path_factory.mktemp("smollm_like")
    model = random_hf_llama(root / "hf", vocab_size=50257, hidden_size=72, num_hidden_layers=2, num_attention_heads=9,
                            num_key_value_heads=3, intermediate_size=96, initializer_range=0.1)
    text = short_text(root / "text.txt", 1200)
    tokens = pjax_eval.read_tokens(str(text), load_tokenizer("data/tokenizer/gpt2"))
    return root / "hf", text, transformers_mean_loss(model, tokens, 32)


@pytest.fixture
def no_forced_devices(monkeypatch):
    """The CLIs in this process: the 8 forced devices exist already (conftest)."""
    for module in (pjax_eval, pjax_train):
        monkeypatch.setattr(module, "force_cpu_devices", lambda *a: 8)


def test_eval_of_a_smollm_shaped_hf_model_needs_no_mesh_flags(smollm_like, no_forced_devices, capsys):
    hf, text, reference = smollm_like
    argv = ["--hf", str(hf), "--text", str(text), "--tokenizer", "data/tokenizer/gpt2", "train.seq_len=32"]
    assert pjax_eval.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("mesh chosen for the model: dp=8 tp=1 (tp: the largest divisor of its 3 kv-heads")
    result = json.loads(out[-1])
    assert abs(result["loss"] - reference) <= 1e-5, (result, reference)  # fp32, as test_eval's (measured 0.0)


def test_an_impossible_mesh_the_user_names_stays_a_one_line_error(smollm_like, no_forced_devices, capsys):
    hf, text, _ = smollm_like
    argv = ["--hf", str(hf), "--text", str(text), "--tokenizer", "data/tokenizer/gpt2", "mesh.tp=2"]
    assert pjax_eval.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: model.num_attention_heads=9 is not divisible by mesh.tp=2" in err, err


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory) -> Path:
    """A HF LLaMA of another shape than configs/debug.yaml's, shipping its own tokenizer (SmolLM2's
    49,152 tokens, where debug.yaml has a 4,096-token BPE)."""
    path = tmp_path_factory.mktemp("small_hf")
    random_hf_llama(path, seed=1, vocab_size=49152, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                    num_key_value_heads=2, intermediate_size=96)
    shutil.copy(SHIPPED / "data/tokenizer/smollm2/tokenizer.json", path / "tokenizer.json")
    return path


def test_init_from_takes_the_model_from_config_json_and_fits_the_mesh(small_hf, no_forced_devices, tmp_path, capsys):
    common = ["--no_progress", f"train.init_from={small_hf}", "train.steps=1", "log.eval_every=0",
              f"log.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"]
    assert pjax_train.main(common) == 0
    out = capsys.readouterr().out
    assert "mesh chosen for the model: dp=4 tp=2" in out and "mesh dp=4 pp=1 cp=1 tp=2 over 8 cpu devices" in out
    assert "layers/wq         2x48x6x8" in out  # the checkpoint's shape, not debug.yaml's 2 x 128 x 4 x 32
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] > 10.5  # ~ln(49,152): the model's own tokenizer, not debug.yaml's (ln 4,096 = 8.3)
    # A model key the user set that disagrees with config.json is refused, not overridden.
    assert pjax_train.main([*common, "model.hidden_size=256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.hidden_size=256 (config.json: 48)" in err, err
