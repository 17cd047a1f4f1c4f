"""`python -m pjax.export --checkpoint DIR [--step N] --out HF_DIR [--max-shard-size 5GB] [--dtype bf16]`: a pjax
checkpoint -> HuggingFace.

The parameters alone, whatever the run's mesh, as config.json + safetensors (sharded as transformers'
`save_pretrained` shards them, `models/hf_shards.py`) with the real vocabulary, and the run's tokenizer.json. Each
HF tensor is read from disk on its own (`checkpoint/param_reader.py`): host memory holds one shard's tensors
(benchmarks/log/export.md). Several processes (`--num_processes`, or srun's tasks) each write their own shards,
with no device and no coordinator. Fine-tune from it with `pjax.train train.init_from=HF_DIR`."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from mesh.distributed import check_flags_match_slurm, slurm_process
from mesh.errors import ConfigError
from models import hf_shards
from pjax import assets
from pjax.checkpoint.checkpointer import Checkpointer
from pjax.checkpoint.param_reader import ParamReader
from pjax.cli import ArgumentParser, run_main, writable_dir


def export(checkpoint: str, out: str, step: int | None = None, max_shard_size: str | None = None,
           dtype: str = "fp32", process: tuple[int, int] = (0, 1)) -> tuple[int, list[str]]:
    """Write checkpoint `step` (default: the newest readable) to `out` in HF format, in `dtype` ('fp32' or
    'bf16'), in shards of at most `max_shard_size` (transformers' spelling, '5GB'; None: one file), as process
    `process` (index, count) of the export; returns the step and the shard files this process wrote."""
    writable_dir(out, "--out")
    max_bytes = None if max_shard_size is None else hf_shards.parse_size(max_shard_size)

    def write(s: int) -> Any:  # a step some parameter of which cannot be read gives way to the one before it
        cfg = ckpt.read_config(s)
        return cfg, hf_shards.write(cfg.model, out, ParamReader(Path(ckpt.directory, str(s))), dtype, max_bytes,
                                    process)

    with Checkpointer(checkpoint, read_only=True) as ckpt:
        step, (cfg, written) = ckpt.readable(write, step)
    if process[0] == 0:
        tokenizer = assets.locate(cfg.data.tokenizer)
        if tokenizer is not None and tokenizer.is_dir():
            tokenizer = tokenizer / "tokenizer.json"
        if tokenizer is not None and tokenizer.is_file() and tokenizer.suffix == ".json":
            # then `pjax.eval --hf OUT` finds the tokenizer the model was trained with
            shutil.copy(tokenizer, Path(out, "tokenizer.json"))
    return step, written


def this_process(num_processes: int | None, process_id: int | None) -> tuple[int, int]:
    """(index, count) of this export process: from the flags, else from a multi-task srun step, else (0, 1)."""
    slurm = slurm_process()
    if num_processes is None and process_id is None:
        return (slurm[2], slurm[1]) if slurm else (0, 1)
    if num_processes is None or process_id is None or not 0 <= process_id < num_processes:
        raise ConfigError(f"pass --num_processes N and --process_id K together, K from 0 to N - 1 and its own per "
                          f"process (got --num_processes={num_processes} --process_id={process_id}).")
    if slurm:
        check_flags_match_slurm(num_processes, process_id, *slurm[1:])
    return process_id, num_processes


def parser() -> ArgumentParser:
    """The command line's parser (tests/test_docs.py parses the commands the docs show with it)."""
    ap = ArgumentParser(prog="python -m pjax.export", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, metavar="DIR", help="a run's checkpoint.dir")
    ap.add_argument("--step", type=int, default=None, help="the step to export (default: the newest readable)")
    ap.add_argument("--out", required=True, metavar="HF_DIR", help="where to write config.json + safetensors")
    ap.add_argument("--max-shard-size", "--max_shard_size", dest="max_shard_size", default=None, metavar="SIZE",
                    help="shard the weights as transformers' save_pretrained does, e.g. 5GB (default: one file)")
    ap.add_argument("--num_processes", type=int, default=None, metavar="N",
                    help="export with N processes (e.g. one per host), each writing its own shards; under srun, "
                         "SLURM's task count")
    ap.add_argument("--process_id", type=int, default=None, metavar="K", help="this process's index, 0 to N - 1")
    ap.add_argument("--dtype", choices=sorted(hf_shards.DTYPES), default="fp32",
                    help="the weights' dtype on disk (default fp32, the checkpoint's; bf16 halves the files)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def body() -> None:
        process = this_process(args.num_processes, args.process_id)
        step, written = export(args.checkpoint, args.out, args.step, args.max_shard_size, args.dtype, process)
        mine = f" (process {process[0]} of {process[1]}: {len(written)} shards)" if process[1] > 1 else ""
        print(f"exported step {step} of {args.checkpoint} to {args.out}{mine}")

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
