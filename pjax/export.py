"""`python -m pjax.export --checkpoint DIR [--step N] --out HF_DIR`: a pjax checkpoint -> HuggingFace LLaMA.

Reads only the parameters of one checkpoint (the latest unless --step), onto the host CPU, and
writes `config.json` + `model.safetensors` that `transformers.LlamaForCausalLM.from_pretrained`
loads (`models.hf.save_hf`); the run's tokenizer.json is copied along when it has one. The
checkpoint's own stored config gives the model shape, so any mesh the run used is fine.
Fine-tune from the export with `python -m pjax.train train.init_from=HF_DIR`.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Sequence

import jax
from jax.sharding import SingleDeviceSharding

from mesh.errors import ConfigError
from models import llama
from models.hf import save_hf
from pjax.checkpoint import Checkpointer


def export(checkpoint: str, out: str, step: int | None = None) -> int:
    """Write checkpoint `step` (default: the latest) of `checkpoint` to `out` in HF format; returns the step."""
    with Checkpointer(checkpoint, read_only=True) as ckpt:
        step = ckpt.resolve_step(step)
        cfg = ckpt.config(step)
        # The host CPU holds the whole model whatever the run's mesh was: the file is written from there.
        host = SingleDeviceSharding(jax.devices("cpu")[0])
        params = ckpt.restore_params(jax.tree.map(lambda _: host, llama.param_logical_axes(cfg.model),
                                                  is_leaf=lambda x: isinstance(x, tuple)), step)
    if jax.process_index() == 0:
        save_hf(params, cfg.model, out)
        tokenizer = Path(cfg.data.tokenizer, "tokenizer.json")
        if tokenizer.is_file():  # then `pjax.eval --hf OUT` finds the tokenizer the model was trained with
            shutil.copy(tokenizer, Path(out, "tokenizer.json"))
    return step


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pjax.export", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, metavar="DIR", help="a run's checkpoint.dir")
    ap.add_argument("--step", type=int, default=None, help="the step to export (default: the latest)")
    ap.add_argument("--out", required=True, metavar="HF_DIR", help="where to write config.json + model.safetensors")
    args = ap.parse_args(argv)
    try:
        step = export(args.checkpoint, args.out, args.step)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {step} of {args.checkpoint} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
