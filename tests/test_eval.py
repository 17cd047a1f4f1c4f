"""pjax/eval.py: loss over a whole text equals transformers' on the same tokens; greedy generation; errors."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from hf_helpers import random_hf_llama, short_text, transformers_mean_loss
from mesh import ConfigError, MeshConfig, make_mesh
from pjax import eval as pjax_eval
from pjax.config_io import load_config
from pjax.data.text import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = "data/tokenizer/bpe4096"
SEQ = 64
OVERRIDES = [f"train.seq_len={SEQ}", "mesh.dp=2", "mesh.tp=2"]
PROMPT = "It is a truth universally acknowledged"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A random HF LLaMA saved to disk, a short text, its tokens, and a dp=2 x tp=2 mesh."""
    root = tmp_path_factory.mktemp("eval")
    model = random_hf_llama(root / "hf", vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=96, initializer_range=0.1)
    text = short_text(root / "text.txt", 3000)
    tokenizer = load_tokenizer(TOKENIZER)
    tokens = pjax_eval.read_tokens(str(text), tokenizer)
    mesh = make_mesh(MeshConfig(dp=2, tp=2), jax.devices()[:4])
    return dict(model=model, hf=str(root / "hf"), text=str(text), tokenizer=tokenizer, tokens=tokens, mesh=mesh)


@pytest.fixture(scope="module")
def reference_loss(setup) -> float:
    """transformers' mean loss: one forward per window tokens[i*T : i*T+T+1], token losses summed."""
    return transformers_mean_loss(setup["model"], setup["tokens"], SEQ)


def _args(setup, *extra: str):
    return pjax_eval.parse_args(["--hf", setup["hf"], "--text", setup["text"], "--tokenizer", TOKENIZER,
                                 *extra, *OVERRIDES])


def test_windows_predict_every_token_once():
    tokens = np.arange(1, 12, dtype=np.int32)  # 10 predictions, windows of 4: 4 + 4 + 2
    w = pjax_eval.windows(tokens, 4)
    assert w["inputs"].shape == (3, 4)
    mask = w["weights"].reshape(-1) > 0
    np.testing.assert_array_equal(w["labels"].reshape(-1)[mask], tokens[1:])
    np.testing.assert_array_equal(w["inputs"].reshape(-1)[mask], tokens[:-1])


def test_eval_loss_matches_transformers(setup, reference_loss, capsys):
    n_pred = len(setup["tokens"]) - 1
    assert n_pred % SEQ and n_pred // SEQ > 8  # a partial last window, and a padded second batch
    result = pjax_eval.run(_args(setup), load_config(None, OVERRIDES), setup["mesh"])
    assert result["tokens"] == n_pred
    # transformers' fp32 kernels against XLA's (measured 2.6e-7 on a loss of 8.5); a lost or doubled window
    # moves the mean by its share of the tokens times its gap to the mean, ~1e-3 here (reasoned)
    assert abs(result["loss"] - reference_loss) <= 1e-5
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result


def test_eval_cli_prints_matching_json_line(setup, reference_loss):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "pjax.eval", "--hf", setup["hf"], "--text", setup["text"],
                           "--tokenizer", TOKENIZER, *OVERRIDES], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"loss", "tokens", "perplexity"}
    assert result["tokens"] == len(setup["tokens"]) - 1
    assert abs(result["loss"] - reference_loss) <= 1e-5  # as in-process (measured 2.6e-7)


def _torch_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_generate_is_greedy_and_gives_max_new_tokens(setup, capsys):
    prompt = setup["tokenizer"].encode(PROMPT, add_special_tokens=False).ids
    cfg, params = pjax_eval.load_hf_on_mesh(setup["hf"], setup["mesh"])
    new = pjax_eval.generate(params, cfg, prompt, setup["mesh"], max_new_tokens=NEW_TOKENS)
    assert len(new) == NEW_TOKENS
    assert new == _torch_greedy(setup["model"], prompt, NEW_TOKENS)
    # The command-line path prints the prompt and its continuation (same shapes: no recompile).
    text = pjax_eval.run(_args(setup, "--generate", PROMPT, "--max_new_tokens", str(NEW_TOKENS)),
                         load_config(None, OVERRIDES), setup["mesh"])
    assert text == setup["tokenizer"].decode(prompt + new)
    assert capsys.readouterr().out.strip().endswith(text.strip())
    assert text.startswith(PROMPT[:10]) and len(text) > len(PROMPT)


def test_generate_stops_at_max_position_embeddings(setup):
    cfg, params = pjax_eval.load_hf_on_mesh(setup["hf"], setup["mesh"])
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        pjax_eval.generate(params, cfg, [1] * cfg.max_position_embeddings, setup["mesh"], max_new_tokens=1)


def test_tokenizer_larger_than_vocab_and_hf_dir_as_checkpoint_are_config_errors(setup):
    cfg = load_config(None, OVERRIDES)
    with pytest.raises(ConfigError, match="vocab_size"):
        pjax_eval.run(pjax_eval.parse_args(["--hf", setup["hf"], "--text", setup["text"], "--tokenizer",
                                            "data/tokenizer/gpt2"]), cfg, setup["mesh"])
    with pytest.raises(ConfigError, match="is a HuggingFace checkpoint"):
        pjax_eval.run(pjax_eval.parse_args(["--checkpoint", setup["hf"]]), cfg, setup["mesh"])


@pytest.mark.parametrize("what", ["missing_hf_dir", "missing_text"])
def test_cli_errors_are_one_line_and_exit_2(setup, tmp_path, what):
    hf = str(tmp_path / "nope") if what == "missing_hf_dir" else setup["hf"]
    text = str(tmp_path / "nope.txt") if what == "missing_text" else setup["text"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "pjax.eval", "--hf", hf, "--text", text], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "nope" in lines[0], proc.stderr


def test_eval_uses_the_steps_loss_with_padding_weighed_out():
    """pjax.eval's loss is the training step's (`vocab_parallel_cross_entropy`), padding at weight 0 left out
    even where its loss is not finite; the count is the weights' sum."""
    from pjax.parallel.tensor_parallel import vocab_parallel_cross_entropy

    rng = np.random.default_rng(0)
    hidden, kernel = rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=(8, 16)).astype(np.float32)
    labels = rng.integers(0, 16, 6).astype(np.int32)
    hidden[5] = np.inf  # a padded position's garbage
    weights = np.array([1, 1, 1, 1, 0, 0], np.float32)
    loss, count = vocab_parallel_cross_entropy(hidden, kernel, labels, weights=weights)
    alone, four = vocab_parallel_cross_entropy(hidden[:4], kernel, labels[:4])
    assert float(count) == float(four) == 4 and np.isclose(float(loss), float(alone), rtol=1e-6)
    with pytest.raises(ValueError, match="unchunked"):
        vocab_parallel_cross_entropy(hidden, kernel, labels, chunk=2, weights=weights)
