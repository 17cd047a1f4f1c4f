"""Per-device memory of one training step under each remat policy, from `memory_analysis()`.

    python benchmarks/memory.py                         # picotron-cpu shape, one device
    python benchmarks/memory.py --config smollm-135m --layout dp8 train.seq_len=2048
    python benchmarks/memory.py --policies names train.remat_names=[q_proj,k_proj,v_proj]

Remat trades compute for memory inside the layer scan: `none` keeps every activation the
backward needs, `dots`/`dots_no_batch` keep only matmul outputs (recomputing the cheap
elementwise ops), `names` only the activations named in `train.remat_names` (default: the q/k/v
and o projections, models/remat.py), `full` only each layer's input, recomputing the layer. Compiled AOT
from shapes on forced CPU devices: no data, no parameters allocated. The layers run under
`lax.scan` here (`train.scan_layers=true` comes before the command-line overrides): the scan is
what bounds the live activations to one layer's worth. With unrolled layers XLA:CPU schedules
the recomputation wherever it likes and the policies barely change memory (picotron-cpu:
207 MB with none, 196 MB with dots, dots_no_batch, full and offload).
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from common import compile_step  # noqa: E402
from pjax.observe.memory import step_memory_bytes  # noqa: E402

POLICIES = ("none", "dots", "dots_no_batch", "names", "full", "offload")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="picotron-cpu")
    ap.add_argument("--layout", default="1")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    results = []
    for policy in args.policies.split(","):
        # A train.remat_names override is for the names row: the other policies refuse it.
        overrides = [o for o in args.overrides if policy == "names" or not o.startswith("train.remat_names=")]
        built = compile_step(args.config, args.layout, ["train.scan_layers=true", *overrides,
                                                        f"train.remat={policy}"])
        m = built["compiled"].memory_analysis()
        result = {"config": args.config, "layout": args.layout, "remat": policy,
                  "temp_mb": round(m.temp_size_in_bytes / 2**20, 2),
                  "device_memory_mb": round(step_memory_bytes(built["compiled"]) / 2**20, 2),
                  "host_temp_mb": round(getattr(m, "host_temp_size_in_bytes", 0) / 2**20, 2),
                  "compile_s": round(built["compile_s"], 2)}
        print(json.dumps(result), flush=True)
        results.append(result)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
