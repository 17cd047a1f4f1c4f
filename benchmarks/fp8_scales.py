"""fp8's per-device scales over the data axes (pjax's) against an amax over the whole tensor: loss and collectives.

    python benchmarks/fp8_scales.py --part loss        # debug model, dp 2 on 2 CPU devices, 200 steps
    python benchmarks/fp8_scales.py --part collectives # SmolLM-1.7B dp8 ZeRO-1 on 8 compile-only H100s

`models/fp8.py` takes each activation's and cotangent's amax over one data replica's block (over cp's and tp's
token blocks, never over rp, dp or ep): each replica's GEMMs read only its own rows, as one device's
micro-batches do. `whole` here is the variant pjax shipped before, one amax over every device that holds a block
(a `pmax` over the data axes too), patched in for this process only. Prints one JSON line per run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@contextlib.contextmanager
def scales(kind: str):
    """`per-device` (pjax's) or `whole`: the data axes put back into activations' and cotangents' amax exchange."""
    import jax
    from jax import lax

    from models import fp8

    if kind == "per-device":
        yield
        return
    original = fp8.whole_amax

    def whole(x, copies=()):
        if copies:  # a dense weight: its blocks over the data axes are copies, as pjax has them
            return original(x, copies)
        amax = original(x)
        data = tuple(ax for ax in fp8.BATCH_AXES if ax in jax.typeof(x).manual_axis_type.varying)
        return lax.pmax(amax, data) if data else amax

    fp8.whole_amax = whole
    try:
        yield
    finally:
        fp8.whole_amax = original


def loss(kind: str, preset: str, steps: int, dp: int) -> dict:
    import jax

    from pjax.config_io import load_config
    from pjax.train import train

    with tempfile.TemporaryDirectory() as tmp, scales(kind):
        cfg = load_config("debug", [f"mesh.dp={dp}", "mesh.tp=1", f"train.steps={steps}", f"log.every={steps}",
                                    f"log.eval_every={steps}", f"log.dir={tmp}", "checkpoint.dir=null",
                                    f"precision.preset={preset}"])
        records = train(cfg, progress=False, devices=jax.devices()[:dp])
    return {"part": "loss", "scales": kind, "preset": preset, "dp": dp, "steps": steps,
            "train_loss": round([r["loss"] for r in records if "loss" in r][-1], 4),
            "eval_loss": round([r["eval_loss"] for r in records if "eval_loss" in r][-1], 4)}


def collectives(kind: str, layout: str) -> dict:
    from pjax.config_io import load_config
    from pjax.observe.hlo import collective_stats
    from pjax.plan import gpu_target
    from pjax.plan.compile import compile_planned
    from pjax.plan.layouts import Layout
    from pjax.plan.profiles import PROFILES

    profile = gpu_target.planned_profile(PROFILES["h100"], "gpu")
    overrides = ["precision.preset=fp8", "train.batch_size=32", "train.remat=none"]
    with scales(kind):
        _, _, compiled = compile_planned(load_config("smollm-1.7b", overrides), Layout.parse(layout), profile, 8,
                                         "gpu")
    stats = collective_stats(compiled.as_text())
    return {"part": "collectives", "scales": kind, "layout": layout,
            "collectives": {k: v["count"] for k, v in stats.items() if v["count"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("loss", "collectives"), default="loss")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--layout", default="dp8-zero1-m4")
    args = ap.parse_args()
    if args.part == "loss":
        import jax

        jax.config.update("jax_num_cpu_devices", args.dp)
        runs = [("per-device", "bf16"), ("per-device", "fp8"), ("whole", "fp8")]
        for kind, preset in runs:
            print(json.dumps(loss(kind, preset, args.steps, args.dp)), flush=True)
    else:
        for kind in ("per-device", "whole"):
            print(json.dumps(collectives(kind, args.layout)), flush=True)


if __name__ == "__main__":
    main()
