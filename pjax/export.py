"""`python -m pjax.export --checkpoint DIR [--step N] --out HF_DIR [--max-shard-size 5GB] [--dtype bf16]`: a pjax
checkpoint -> HuggingFace.

The parameters alone, whatever the run's mesh, as config.json + safetensors (sharded as transformers'
`save_pretrained` shards them, `models/hf_shards.py`) with the real vocabulary, and the run's tokenizer.json. One
parameter is restored at a time, onto this process's first device: host memory holds one shard's tensors and,
while it is read, that parameter (benchmarks/log/export.md). Fine-tune from it with `pjax.train
train.init_from=HF_DIR`."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models import hf_shards
from pjax import assets
from pjax.checkpoint.checkpointer import Checkpointer
from pjax.cli import ArgumentParser, run_main, writable_dir


def export(checkpoint: str, out: str, step: int | None = None, max_shard_size: str | None = None,
           dtype: str = "fp32") -> int:
    """Write checkpoint `step` (default: the newest readable) to `out` in HF format, in `dtype` ('fp32' or
    'bf16'), in shards of at most `max_shard_size` (transformers' spelling, '5GB'; None: one file); returns the
    step."""
    writable_dir(out, "--out")
    max_bytes = None if max_shard_size is None else hf_shards.parse_size(max_shard_size)
    # The first device of each process, each holding the parameter whole: no process waits on another's slice.
    firsts = list({d.process_index: d for d in reversed(jax.devices())}.values())
    whole = NamedSharding(Mesh(np.array(firsts), ("process",)), P())
    def write(s: int) -> Any:  # a step some parameter of which cannot be read gives way to the one before it
        cfg = ckpt.read_config(s)
        hf_shards.write(cfg.model, out, lambda path: ckpt.restore_param(s, path, whole).addressable_data(0),
                        dtype, max_bytes)
        return cfg

    with Checkpointer(checkpoint, read_only=True) as ckpt:
        step, cfg = ckpt.readable(write, step)
    if jax.process_index() == 0:
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
    ap.add_argument("--out", required=True, metavar="HF_DIR", help="where to write config.json + safetensors")
    ap.add_argument("--max-shard-size", "--max_shard_size", dest="max_shard_size", default=None, metavar="SIZE",
                    help="shard the weights as transformers' save_pretrained does, e.g. 5GB (default: one file)")
    ap.add_argument("--dtype", choices=sorted(hf_shards.DTYPES), default="fp32",
                    help="the weights' dtype on disk (default fp32, the checkpoint's; bf16 halves the files)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def body() -> None:
        step = export(args.checkpoint, args.out, args.step, args.max_shard_size, args.dtype)
        print(f"exported step {step} of {args.checkpoint} to {args.out}")

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
