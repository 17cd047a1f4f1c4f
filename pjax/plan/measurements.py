"""What a calibration measures, each as a Job (`pjax.plan.calibrate` compiles them all, then times them): a
matmul shape's rate, a memory pass's bandwidth, causal attention's rate, a collective's time within groups of
devices, and a model's own compiled matmul shapes to time."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def platform() -> str:
    """'gpu' or 'cpu': which grid and dtype a calibration uses here."""
    return "gpu" if jax.default_backend() == "gpu" else "cpu"


# A measurement is a Job: its record's fixed fields, the jitted programs it times each with the jitted program
# that makes its arguments, and how the timed seconds complete the record. Jobs are compiled together first,
# makers included (XLA:GPU's autotuning costs seconds per shape, and compiles run in parallel threads; an
# eager op would compile one program per shape, one at a time), then timed one at a time, each program's
# arguments made just before and dropped after: only one job's operands are on the device at a time.
Job = tuple[dict, list[tuple[Callable, Callable[[], tuple]]], Callable[[dict, list[float]], None]]


# The operands a matmul job may hold at once: its `repeat` products' inputs and outputs live side by side.
_MATMUL_BYTES = {"cpu": 256 * 2**20, "gpu": 4 * 2**30}
_CALL_FLOPS = {"cpu": 2e8, "gpu": 2e12}  # a call's products together: its dispatch is a small share of it
# XLA:GPU compiles and autotunes every product of a call on its own, and parallel compile threads barely overlap
# that (32 products took 11 s to compile on an H200, 4 took 2 s), so a GPU call holds at most 4; calls queued
# back to back (`calibrate.timed`'s chain) hide the launch instead.
_MAX_PER_CALL = {"cpu": 32, "gpu": 4}


def products_per_call(m: int, k: int, n: int, itemsize: int, plat: str) -> int:
    """How many [m, k] x [k, n] products one timed call runs: enough FLOPs that its dispatch is a small share,
    2 to the platform's most (32 on a CPU, 4 on a GPU), within its operand budget."""
    want = math.ceil(_CALL_FLOPS[plat] / (2 * m * k * n))
    room = _MATMUL_BYTES[plat] // ((m * k + k * n + m * n) * itemsize)
    return int(max(2, min(_MAX_PER_CALL[plat], want, room)))


def matmul_job(m: int, k: int, n: int, dtype: str, repeat: int | None = None) -> Job:
    """One [m, k] x [k, n] product's seconds and FLOP/s, as the mean of `repeat` independent products in one
    call, each written to its own output as a layer's product is: no sum carried across them (an extra pass
    over the output that the step does not make), no shared input (XLA would merge the products into one)."""
    itemsize = jnp.dtype(dtype).itemsize
    repeat = repeat or products_per_call(m, k, n, itemsize, platform())

    @jax.jit
    def operands() -> tuple:
        keys = jax.random.split(jax.random.key(0), 2)
        return (jax.random.normal(keys[0], (repeat, m, k), jnp.float32).astype(dtype),
                jax.random.normal(keys[1], (repeat, k, n), jnp.float32).astype(dtype))
    out = jnp.bfloat16 if "float8" in dtype else dtype

    @jax.jit
    def products(xs, ws):
        return tuple(jnp.dot(xs[i], ws[i], preferred_element_type=out) for i in range(repeat))

    def finish(rec: dict, secs: list[float]) -> None:
        rec["seconds"] = secs[0] / repeat
        rec["flops_per_s"] = 2 * m * k * n / rec["seconds"]
    return {"m": m, "k": k, "n": n, "dtype": dtype, "repeat": repeat}, [(products, operands)], finish


def model_products(config_name: str, overrides: Sequence[str] = ()) -> list[tuple[int, int, int]]:
    """The matmul shapes the named config's training step runs, compiled for one device of this machine: XLA's
    own forms (the q, k, v products it merges into one, the weight gradients it splits), every one the step's
    `dot_products` counts."""
    from mesh.mesh import make_mesh
    from pjax.config_io import load_config
    from pjax.observe.hlo_flops import dot_products
    from pjax.step import trainer_for

    one = [f"mesh.{axis}=1" for axis in ("dp", "ep", "pp", "cp", "tp")]
    cfg = load_config(config_name, [*overrides, *one])
    trainer = trainer_for(make_mesh(cfg.mesh, jax.devices()[:1]), cfg)
    return list(dot_products(trainer.compile_step().as_text()))


def bandwidth_job(megabytes: int) -> Job:
    """Bytes per second of an elementwise pass (read once, written once) over `megabytes` of fp32."""
    size = megabytes * 2**20 // 4
    ones = jax.jit(lambda: (jnp.ones((size,)),))

    def finish(rec: dict, secs: list[float]) -> None:
        rec["seconds"], rec["bytes_per_s"] = secs[0], 2 * 4 * size / secs[0]
    return {"megabytes": megabytes}, [(jax.jit(lambda x: x * 1.0001 + 1.0), ones)], finish


def attention_job(batch: int, seq: int, heads: int, head_dim: int) -> Job:
    """Causal attention's forward and forward + backward seconds with the kernel `auto` picks, and the model
    FLOP/s they stand for (QK^T and PV over half the keys: 4·B·H·T²·D/2 forward, three times that both ways)."""
    from models.attention import select_attention

    dtype = jnp.bfloat16 if platform() == "gpu" else jnp.float32

    @jax.jit
    def qkv() -> tuple:
        keys = jax.random.split(jax.random.key(1), 3)
        return tuple(jax.random.normal(keys[i], (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
                     for i in range(3))
    pos = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    fn = select_attention("auto")
    forward = jax.jit(lambda q, k, v: fn(q, k, v, pos, pos))
    both = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v, pos, pos).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    flops = 2 * batch * heads * seq * seq * head_dim

    def finish(rec: dict, secs: list[float]) -> None:
        rec["forward_s"], rec["forward_backward_s"] = secs
        rec["forward_flops_per_s"], rec["forward_backward_flops_per_s"] = flops / secs[0], 3 * flops / secs[1]
    fixed = {"batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim, "dtype": str(jnp.dtype(dtype))}
    return fixed, [(forward, qkv), (both, qkv)], finish


def collective_groups(n: int) -> list[int]:
    """The group sizes a calibration times collectives in on `n` devices: every power of two that divides
    `n`, and `n`: the sizes a mesh axis (or two together) can have."""
    return sorted({g for g in (2 ** i for i in range(1, n.bit_length())) if n % g == 0} | ({n} if n > 1 else set()))


def collective_job(kind: str, megabytes: float, devices: list, group: int | None = None) -> Job:
    """One collective within every group of `group` consecutive devices at once (default: all of them), as a
    mesh axis of that size runs it: seconds for a per-device buffer of `megabytes` fp32."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    n = len(devices)
    g = group or n
    mesh = Mesh(np.array(devices).reshape(n // g, g), ("rest", "x"))
    per_device = max(g, int(megabytes * 2**20 / 4) // g * g)
    ops = {"psum": lambda x: jax.lax.psum(x, "x"),
           "all_gather": lambda x: jax.lax.all_gather(x, "x", tiled=True),
           "psum_scatter": lambda x: jax.lax.psum_scatter(x, "x", tiled=True),
           "all_to_all": lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True),
           "ppermute": lambda x: jax.lax.ppermute(x, "x", [(i, (i + 1) % g) for i in range(g)])}
    spec = P(("rest", "x"))
    body = jax.shard_map(ops[kind], mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    x = jax.jit(lambda: (jnp.ones((n * per_device,), jnp.float32),), out_shardings=(NamedSharding(mesh, spec),))

    def finish(rec: dict, secs: list[float]) -> None:
        rec["seconds"] = secs[0]
    fixed = {"kind": kind, "devices": n, "group": g, "megabytes": per_device * 4 / 2**20}
    return fixed, [(jax.jit(body), x)], finish
