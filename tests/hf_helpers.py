"""Helpers the tests share for HuggingFace references: a random transformers LLaMA on disk, a
short text, and transformers' own loss over it (what pjax.eval must reproduce)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "pjax" / "assets"  # the files pjax ships as package data


def random_hf_llama(path: Path, seed: int = 0, **shape) -> transformers.LlamaForCausalLM:
    """A random fp32 transformers LLaMA of `shape` (LlamaConfig keys), saved to `path`."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    model.save_pretrained(path)
    return model


def short_text(path: Path, chars: int) -> Path:
    """The first `chars` characters of the shipped Pride and Prejudice, written to `path`."""
    path.write_text((SHIPPED / "data/prideprejudice.txt").read_text(encoding="utf-8")[:chars], encoding="utf-8")
    return path


def transformers_mean_loss(model: transformers.LlamaForCausalLM, tokens: np.ndarray, seq_len: int) -> float:
    """Mean next-token loss of `tokens` in windows tokens[i*T : i*T+T+1], as pjax.eval counts it."""
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, seq_len):
            ids = torch.from_numpy(tokens[start:start + seq_len + 1].astype(np.int64))[None]
            total += model(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
    return total / (len(tokens) - 1)
