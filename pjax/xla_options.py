"""pjax's own XLA:GPU options, set on every step it compiles for GPUs (`pjax.train` and the planner's compiles
for compile-only GPUs alike), as per-compile options, on top of the user's XLA_FLAGS: a flag the user sets wins,
over pjax's option of that name and of its family (`FAMILIES`).
`train.xla_options=false` leaves XLA's defaults. Why each: ARCHITECTURE.md, "pjax's XLA:GPU options"."""
from __future__ import annotations

import functools
import os
import re
from typing import Any

from mesh.backend import target_backend

MIB = 2 ** 20

GPU_OPTIONS: dict[str, bool | int] = {
    # A collective inside a loop (ZeRO-3's per-layer all-gathers, sequence parallelism's gathers) is started one
    # iteration ahead, and a loop's all-reduces are finished after it. Loops are left as XLA's while-loop
    # unrolling mode leaves them: forcing double buffering unrolled every loop with a known trip count,
    # collectives or none, and overlapped no more (benchmarks/log/gpu_kernels.md, "Double buffering"). XLA's
    # own defaults cover what pjax also set until 2026-12-07 (the latency-hiding scheduler, collectives on the
    # highest-priority stream, pipelined reduce-scatters): leaving each out compiled the same programs
    # (benchmarks/log/gpu_kernels.md, "pjax's XLA options, one at a time").
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    # Small collectives combined into fewer, larger ones up to these sizes (MaxText's GPU values): a large
    # model's stacked weights stay one collective each, which the scheduler can overlap with other tensors' work.
    "xla_gpu_all_reduce_combine_threshold_bytes": 128 * MIB,
    "xla_gpu_all_gather_combine_threshold_bytes": 128 * MIB,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 64 * MIB,
    # GEMMs as cuBLAS(Lt) calls, not Triton fusions, as MaxText's and JAX-Toolbox's H100 recipes set: half the
    # fusions to compile; whether it is faster in bf16 is for a GPU visit's control run to show.
    "xla_gpu_enable_triton_gemm": False,
}


# The flags that steer what each of pjax's options steers: a user's flag of a family wins over pjax's whole family.
FAMILIES: dict[str, str] = {
    "xla_gpu_enable_pipelined_all_gather": r"xla_gpu_enable_pipelined_(all_gather|collectives)|xla_gpu_pipeline_all_gather",
    "xla_gpu_enable_pipelined_all_reduce": r"xla_gpu_enable_pipelined_(all_reduce|collectives)|xla_gpu_pipeline_all_reduce",
    "xla_gpu_all_reduce_combine_threshold_bytes": r"xla_gpu_all_reduce_combine_threshold_bytes",
    "xla_gpu_all_gather_combine_threshold_bytes": r"xla_gpu_all_gather_combine_threshold_bytes",
    "xla_gpu_reduce_scatter_combine_threshold_bytes": r"xla_gpu_reduce_scatter_combine_threshold_bytes",
    "xla_gpu_enable_triton_gemm": r"xla_gpu_enable_triton_gemm|xla_gpu_triton_gemm_\w+|xla_gpu_cublas_fallback",
}


def user_flags(flags: str | None = None) -> set[str]:
    """The option names the user's XLA_FLAGS set (`--name` or `--name=value`)."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    return set(re.findall(r"--(xla_\w+)", flags))


def overridden(flags: str | None = None) -> set[str]:
    """pjax's options the user's XLA_FLAGS steer: set by name, or through a flag of the option's family."""
    named = user_flags(flags)
    return {option for option in (*GPU_OPTIONS, IN_FLIGHT)
            if any(re.fullmatch(FAMILIES.get(option, re.escape(option)), flag) for flag in named)}


# XLA:CPU has no fp8 dot: it converts the fp8 operands to f32, and with excess precision allowed its simplifier
# then folds some convert(convert(x, f8), f32) pairs into x, so that a GEMM reads an operand fp8 never rounded
# (in one program and not in another: a layout's fp8 step then differs from one device's).
FP8_CPU_OPTIONS: dict[str, bool] = {"xla_allow_excess_precision": False}


# How many asynchronous collectives the latency-hiding scheduler keeps in flight at once (XLA's default: 1).
# Streaming DiLoCo's landing step reduces a fragment's tensors, one all-reduce per large one, beside an inner step:
# one at a time, all but the first wait for the inner step to end; `in_flight` of them overlap it together.
IN_FLIGHT = "xla_gpu_experimental_parallel_collective_overlap_limit"


def step_options(enabled: bool, device: Any = None, fp8: bool = False, in_flight: int = 1) -> dict[str, Any]:
    """The compile options of a step built for the target backend: on GPUs `GPU_OPTIONS` (and `IN_FLIGHT` where
    `in_flight` > 1) less what XLA_FLAGS sets (and, with a `device` of the target kind, less what this XLA does not
    know); on CPU with fp8 GEMMs, `FP8_CPU_OPTIONS` (whatever `enabled` says: they keep the fp8 arithmetic, not its
    speed); elsewhere none."""
    if fp8 and target_backend() == "cpu":
        return {k: v for k, v in FP8_CPU_OPTIONS.items() if k not in user_flags()}
    if not enabled or target_backend() != "gpu":
        return {}
    wanted = {**GPU_OPTIONS, IN_FLIGHT: in_flight} if in_flight > 1 else GPU_OPTIONS
    mine = {k: v for k, v in wanted.items() if k not in overridden()}
    return _known(tuple(sorted(mine.items())), device) if device is not None else mine


@functools.cache
def _known(options: tuple[tuple[str, Any], ...], device: Any) -> dict[str, Any]:
    """`options` less those this jaxlib's XLA refuses ("No such compile option"), found by compiling a
    one-element program for `device`: an option renamed in a later XLA drops out instead of failing the run."""
    import jax
    import jax.numpy as jnp

    kept = dict(options)
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=sharding)
    for _ in range(len(kept) + 1):
        try:
            jax.jit(lambda a: a + 1, compiler_options=kept).lower(x).compile()
            return kept
        except Exception as e:  # noqa: BLE001 - XLA reports an unknown option as a runtime error
            unknown = re.search(r"No such compile option: '(\w+)'", str(e))
            if not unknown or unknown.group(1) not in kept:
                raise
            kept.pop(unknown.group(1))
    return kept


def describe(options: dict[str, Any]) -> str | None:
    """The one line `pjax.train` prints of the GPU options, or None where there are none."""
    if not options or target_backend() != "gpu":
        return None
    flags = " ".join(f"--{k}={str(v).lower()}" for k, v in options.items())
    kept = sorted(overridden() & set(GPU_OPTIONS))
    own = f"; XLA_FLAGS steers {', '.join(kept)}" if kept else ""
    return f"XLA:GPU options (pjax's, added to XLA_FLAGS{own}; train.xla_options=false leaves XLA's defaults): {flags}"
