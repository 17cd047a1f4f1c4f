"""`python -m pjax.export --checkpoint DIR [--step N] --out HF_DIR`: a pjax checkpoint -> HuggingFace LLaMA.

Reads only the parameters of one checkpoint (the newest readable one unless --step: a corrupt
newer step is passed over with a warning), onto the host CPU, and writes `config.json` +
`model.safetensors` that `transformers.LlamaForCausalLM.from_pretrained` loads
(`models.hf.save_hf`), with the real vocabulary (pjax's padding is cut off); the run's
tokenizer.json is copied along when it has one. The checkpoint's own stored config gives the
model shape, so any mesh the run used is fine.
Fine-tune from the export with `python -m pjax.train train.init_from=HF_DIR`.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Sequence

import jax
from jax.sharding import SingleDeviceSharding

from models import llama
from models.hf import save_hf
from pjax import assets
from pjax.checkpoint import Checkpointer
from pjax.cli import ArgumentParser, run_main, writable_dir


def export(checkpoint: str, out: str, step: int | None = None) -> int:
    """Write checkpoint `step` (default: the newest readable one) of `checkpoint` to `out` in HF
    format; returns the step."""
    writable_dir(out, "--out")
    # The host CPU holds the whole model whatever the run's mesh was: the file is written from there.
    host = SingleDeviceSharding(jax.devices("cpu")[0])
    on_host = lambda model: jax.tree.map(lambda _: host, llama.param_logical_axes(model),
                                         is_leaf=lambda x: isinstance(x, tuple))
    with Checkpointer(checkpoint, read_only=True) as ckpt:
        step, cfg, params = ckpt.restore_params(on_host, step)
    if jax.process_index() == 0:
        save_hf(params, cfg.model, out)
        tokenizer = assets.locate(cfg.data.tokenizer)  # a tokenizer.json or a folder; may be a shipped one
        if tokenizer is not None and tokenizer.is_dir():
            tokenizer = tokenizer / "tokenizer.json"
        if tokenizer is not None and tokenizer.is_file() and tokenizer.suffix == ".json":
            # then `pjax.eval --hf OUT` finds the tokenizer the model was trained with
            shutil.copy(tokenizer, Path(out, "tokenizer.json"))
    return step


def main(argv: Sequence[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m pjax.export", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, metavar="DIR", help="a run's checkpoint.dir")
    ap.add_argument("--step", type=int, default=None, help="the step to export (default: the newest readable)")
    ap.add_argument("--out", required=True, metavar="HF_DIR", help="where to write config.json + model.safetensors")
    args = ap.parse_args(argv)

    def body() -> None:
        step = export(args.checkpoint, args.out, args.step)
        print(f"exported step {step} of {args.checkpoint} to {args.out}")

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
