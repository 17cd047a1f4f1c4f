"""Shared by the benchmark scripts: layout names, and compiling one training step ahead of time."""
from __future__ import annotations

from typing import Any


def parse_layout(name: str) -> tuple[dict[str, int], list[str]]:
    """'dp2-tp2-zero3' -> ({'dp': 2, 'pp': 1, 'cp': 1, 'tp': 2}, ['train.zero=3']); '1' is one device.

    A `remat` part (as in 'pp2-remat') runs the layer scan with remat='full'; an `sp` part
    (as in 'dp2-tp4-sp') turns on sequence parallelism.
    """
    mesh = {"dp": 1, "pp": 1, "cp": 1, "tp": 1}
    extra = []
    for part in ([] if name == "1" else name.split("-")):
        for key in mesh:
            if part.startswith(key) and part[len(key):].isdigit():
                mesh[key] = int(part[len(key):])
                break
        else:
            if part.startswith("zero") and part[4:].isdigit():
                extra.append(f"train.zero={part[4:]}")
            elif part == "remat":  # keep only each layer's input, recompute the rest (needs the layer scan)
                extra += ["train.remat=full", "train.scan_layers=true"]
            elif part == "sp":  # sequence parallelism (with tp > 1)
                extra.append("train.sequence_parallel=true")
            else:
                raise SystemExit(f"cannot parse layout part {part!r} in {name!r}")
    return mesh, extra


def use_layout_devices(layout: str) -> None:
    """Before JAX's backend starts: as many forced CPU devices as the layout's mesh, and the pool
    threads `pjax.train` gives pipelines (accelerators are not affected)."""
    import jax

    from mesh.distributed import pipeline_cpu_threads
    from mesh.mesh import MeshConfig

    sizes, _ = parse_layout(layout)
    devices = sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]
    jax.config.update("jax_num_cpu_devices", devices)
    pipeline_cpu_threads(MeshConfig(**sizes), devices)


def layout_config(config: str, layout: str, overrides: list[str], devices: Any = None) -> tuple[Any, Any]:
    """(config, mesh) of `layout`: the named config with the layout's overrides, and its mesh over
    `devices` (default: the first mesh-size devices)."""
    import jax

    from mesh.mesh import make_mesh
    from pjax.config_io import load_config

    sizes, extra = parse_layout(layout)
    cfg = load_config(config, [f"mesh.{k}={v}" for k, v in sizes.items()] + extra + list(overrides))
    n = sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]
    return cfg, make_mesh(cfg.mesh, jax.devices()[:n] if devices is None else devices, cfg.model.num_local_experts)


def compile_step(config: str, layout: str, overrides: list[str], devices: Any = None) -> dict[str, Any]:
    """Build the trainer for `layout` and compile its step from shapes alone (no data, no params).

    Returns {'cfg', 'mesh', 'trainer', 'compiled', 'compile_s'}. `devices` defaults to the first
    mesh-size devices, so several layouts can be compiled in one process with 8 forced devices.
    """
    import time

    from pjax.step import trainer_for

    cfg, mesh = layout_config(config, layout, overrides, devices)
    trainer = trainer_for(mesh, cfg)  # every section, and pjax's XLA options on GPUs: what pjax.train runs
    t0 = time.perf_counter()
    compiled = trainer.compile_step()
    return {"cfg": cfg, "mesh": mesh, "trainer": trainer, "compiled": compiled,
            "compile_s": time.perf_counter() - t0}


def random_batch(trainer: Any, seed: int = 0) -> dict:
    """One global batch of random tokens on the trainer's mesh, in the layout the data pipeline
    would hand it over (zigzag columns under context parallelism)."""
    import jax
    import numpy as np

    from pjax.parallel.context.zigzag import zigzag_layout

    tc, mc = trainer.tc, trainer.cfg
    shape = (tc.grad_accum, tc.batch_size // tc.grad_accum, tc.seq_len)
    tokens = np.random.default_rng(seed).integers(0, mc.vocab_size, (tc.batch_size, tc.seq_len + 1)).astype(np.int32)
    tokens = tokens.reshape(tc.grad_accum, -1, tc.seq_len + 1)
    cols = np.asarray(zigzag_layout(trainer.mesh.shape["cp"])(np.arange(tc.seq_len)))
    return jax.device_put({"inputs": tokens[..., :-1][..., cols], "labels": tokens[..., 1:][..., cols],
                           "positions": np.broadcast_to(cols.astype(np.int32), shape)}, trainer.batch_sharding)


def trainer_for(config: str, overrides: list[str]) -> tuple[Any, Any]:
    """(config, trainer) of a named config with overrides, on the first mesh-size devices: every section the
    step reads (pipeline, MoE, context, precision, meta) passed on."""
    import jax

    from pjax.config_io import load_config
    from pjax import step

    cfg = load_config(config, overrides)
    n = cfg.mesh.dp * cfg.mesh.pp * cfg.mesh.cp * cfg.mesh.tp
    return cfg, step.trainer_for(step.mesh_for(cfg, jax.devices()[:n]), cfg)
