"""`python -m pjax.export --checkpoint DIR [--step N] --out HF_DIR`: a pjax checkpoint -> HuggingFace LLaMA.

The parameters alone, on the host CPU whatever the run's mesh, as config.json + model.safetensors with the
real vocabulary, and the run's tokenizer.json; fine-tune from it with `pjax.train train.init_from=HF_DIR`."""
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
from pjax.checkpoint.checkpointer import Checkpointer
from pjax.cli import ArgumentParser, run_main, writable_dir


def export(checkpoint: str, out: str, step: int | None = None) -> int:
    """Write checkpoint `step` (default: the newest readable) to `out` in HF format; returns the step."""
    writable_dir(out, "--out")
    host = SingleDeviceSharding(jax.devices("cpu")[0])
    on_host = lambda model: jax.tree.map(lambda _: host, llama.param_logical_axes(model),
                                         is_leaf=lambda x: isinstance(x, tuple))
    with Checkpointer(checkpoint, read_only=True) as ckpt:
        step, cfg, params = ckpt.restore_params(on_host, step)
    if jax.process_index() == 0:
        save_hf(params, cfg.model, out)
        tokenizer = assets.locate(cfg.data.tokenizer)
        if tokenizer is not None and tokenizer.is_dir():
            tokenizer = tokenizer / "tokenizer.json"
        if tokenizer is not None and tokenizer.is_file() and tokenizer.suffix == ".json":
            # then `pjax.eval --hf OUT` finds the tokenizer the model was trained with
            shutil.copy(tokenizer, Path(out, "tokenizer.json"))
    return step


def parser() -> ArgumentParser:
    """The command line's parser (tests/test_docs.py parses the commands the docs show with it)."""
    ap = ArgumentParser(prog="python -m pjax.export", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, metavar="DIR", help="a run's checkpoint.dir")
    ap.add_argument("--step", type=int, default=None, help="the step to export (default: the newest readable)")
    ap.add_argument("--out", required=True, metavar="HF_DIR", help="where to write config.json + model.safetensors")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def body() -> None:
        step = export(args.checkpoint, args.out, args.step)
        print(f"exported step {step} of {args.checkpoint} to {args.out}")

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
