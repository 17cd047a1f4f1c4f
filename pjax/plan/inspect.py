"""The sharding inspector: where every parameter lives, what a device holds, and what a step communicates
(`python -m pjax.plan --explain LAYOUT` for any layout, through `explain`; `log.inspect=true` for a training
run's own)."""
from __future__ import annotations

import math
from typing import Any, Callable

import jax

from mesh.mesh import data_size
from pjax.config import Config
from pjax.observe.hlo import collectives_by_axis
from pjax.observe.hlo_flops import StepMatmuls, fused_attention, gemm_census, kind_order
from pjax.observe.memory import step_memory_bytes
from pjax.parallel.pipeline.table import part_runs, tick_runs
from pjax.plan.layouts import Layout, state_bytes


def readable_bytes(n: float) -> str:
    """GiB from one GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def parameter_table(params: Any, logical_axes: Any) -> str:
    """Parameter, shape, logical axes, PartitionSpec and bytes per device as stored (arrays or ShapeDtypeStructs)."""
    rows = [("parameter", "shape", "logical axes", "sharding", "per device")]
    flat_axes = dict(jax.tree_util.tree_leaves_with_path(logical_axes, is_leaf=lambda x: isinstance(x, tuple)))
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        name = "/".join(str(k.key) for k in path)
        names = ",".join(n or "-" for n in flat_axes[path])  # '-': a dimension with no logical name (the router's experts)
        per_device = math.prod(p.sharding.shard_shape(p.shape)) * p.dtype.itemsize
        rows.append((name, "x".join(map(str, p.shape)), names, str(tuple(p.sharding.spec)), readable_bytes(per_device)))
    return _table(rows)


def _count(n: float) -> str:
    """An op count; a pipeline's per-tick ops are averaged over its devices, so maybe a fraction."""
    return f"{n:,.0f}" if n == int(n) else f"{n:,.1f}"


def step_collectives(config: Config, mesh_shape: dict[str, int], hlo_text: str, devices_per_host: int
                     ) -> dict[str, dict[str, Any]]:
    """`collectives_by_axis` of a compiled step, a pipeline's per-tick ops counted as often as its table runs them."""
    pp, cp = mesh_shape.get("pp", 1), mesh_shape.get("cp", 1)
    scale = tick_runs(config.pipeline, pp, config.train.grad_accum, cp > 1) if pp > 1 else None
    return collectives_by_axis(hlo_text, mesh_shape, devices_per_host, scale)


def step_part_runs(config: Config, mesh_shape: dict[str, int] | None = None) -> Callable[[str], float | None] | None:
    """A pipelined step's tick parts' runs per tick (`pipeline.table.part_runs`), on `mesh_shape` (default: the
    config's mesh); None where pp = 1."""
    shape = mesh_shape or {"pp": config.mesh.pp, "cp": config.mesh.cp}
    pp, cp = shape.get("pp", 1), shape.get("cp", 1)
    return part_runs(config.pipeline, pp, config.train.grad_accum, cp > 1) if pp > 1 else None


def step_matmuls(config: Config, mesh_shape: dict[str, int], hlo_text: str) -> StepMatmuls:
    """The matmuls of a compiled step per device, a pipeline's tick parts counted as often as its table runs them."""
    return StepMatmuls.from_hlo(hlo_text, step_part_runs(config, mesh_shape))


def step_report(config: Config, mesh: Any, compiled: Any, devices_per_host: int, comm: dict | None = None) -> str:
    """Per-device memory of the compiled step and its collectives per mesh axes (`comm`: from its HLO if None)."""
    layout = Layout(data_size(mesh), *(mesh.shape[a] for a in ("pp", "cp", "tp")), zero=config.train.zero,
                    sequence_parallel=config.train.sequence_parallel, ep=mesh.shape["ep"],
                    zero_shard=config.train.zero_shard)
    state = state_bytes(config, layout)
    m = compiled.memory_analysis()
    need = step_memory_bytes(compiled)
    memory = [
        ("per device", "bytes"),
        ("fp32 parameters", readable_bytes(state["params"])),
        ("AdamW moments", readable_bytes(state["opt_state"])),
        ("fp32 gradient (in the temporaries)", readable_bytes(state["grads"])),
        ("step arguments (parameters, moments, batch)", readable_bytes(m.argument_size_in_bytes)),
        ("temporaries (gradient, activations, buffers)", readable_bytes(m.temp_size_in_bytes)),
        ("step in all (arguments + outputs - donated + temporaries)", readable_bytes(need)),
    ]
    if comm is None:
        comm = step_collectives(config, dict(mesh.shape), compiled.as_text(), devices_per_host)
    rows = [("mesh axes", "ops per step", "bytes per device", "link bytes inside a host", "across hosts", "kinds")]
    for axes, row in sorted(comm.items(), key=lambda kv: -kv[1]["link_bytes"]):
        kinds = ", ".join(f"{k} x{_count(n)}" for k, n in sorted(row["kinds"].items()))
        across = row["inter_link_bytes"]
        rows.append((axes, _count(row["count"]), readable_bytes(row["bytes"]),
                     readable_bytes(row["link_bytes"] - across), readable_bytes(across), kinds))
    if len(rows) == 1:
        rows.append(("(none)", "0", "0", "0", "0", "-"))
    return "\n\n".join([_table(memory), _table(rows)])


def kernel_report(config: Config, hlo_text: str) -> str:
    """The compiled step's attention kernel and its GEMMs by operand dtype: runs per step and share of the
    GEMM FLOPs (a pipeline's tick parts counted as often as its table runs them on an average device)."""
    weights = step_part_runs(config)
    fused = fused_attention(hlo_text, weights)
    if fused["forward"] or fused["backward"]:
        attention = (f"cuDNN's fused attention ({_count(fused['forward'])} forward and {_count(fused['backward'])} "
                     f"backward calls per step)")
    else:
        attention = f"{config.train.attention} (no fused attention kernel in the program)"
    census = gemm_census(hlo_text, weights)
    total = sum(row["flops"] for row in census.values()) or 1.0
    gemms = ", ".join(f"{k} {_count(census[k]['gemms'])} ({100 * census[k]['flops'] / total:.1f}% of the FLOPs)"
                      for k in sorted(census, key=kind_order)) or "none"
    return f"attention: {attention}\nGEMMs per step by operand dtype: {gemms}"
