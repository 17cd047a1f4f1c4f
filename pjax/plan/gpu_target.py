"""Compile-only GPUs: XLA:GPU compiles a step for a device kind on a host that has no GPU.

JAX's CUDA plugin can describe a topology from a target description instead of from local devices
(`jax.experimental.topologies.get_topology_desc(platform="cuda", topology="1xHOSTSxPER_HOST",
target_config=...)`); jit then lowers and compiles for those devices, and nothing can run on them. So the
planner reads XLA:GPU's own memory plan and collectives (async pairs, its scheduler, its fusions) instead of
XLA:CPU's. It needs `pip install 'pjax[gpu-plan]'` (the plugin, ptxas from NVIDIA's nvcc wheel, and cuDNN for
its fused attention); without it the planner compiles on fake CPU devices and says so. Autotuning needs a
device, so XLA picks its default kernels: the memory plan is the one to trust, the kernels' speed is not
measured here."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Iterator

from mesh.errors import ConfigError

@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA:GPU's compiler reads of a device (data-sheet figures; `memory`: what nvidia-smi reports)."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float
    memory: int
    memory_bandwidth: float  # bytes/s
    l2_cache: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int

    def target_config(self) -> str:
        """A `stream_executor.GpuTargetConfigProto` in text form, as the CUDA plugin's topology reads it."""
        major, minor = self.compute_capability
        return "\n".join([
            "gpu_device_info {",
            "  threads_per_block_limit: 1024", "  threads_per_warp: 32", "  shared_memory_per_block: 49152",
            f"  shared_memory_per_core: {self.shared_memory_per_sm}", "  threads_per_core_limit: 2048",
            f"  core_count: {self.sm_count}", "  fpus_per_core: 128",
            "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535", "  block_dim_limit_z: 65535",
            f"  memory_bandwidth: {int(self.memory_bandwidth)}", f"  l2_cache_size: {self.l2_cache}",
            f"  clock_rate_ghz: {self.clock_ghz}", f"  device_memory_size: {self.memory}",
            f"  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}",
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
            "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
            "}",
            'platform_name: "CUDA"',
            "dnn_version_info { major: 9 minor: 10 }",
            "runtime_version { major: 13 minor: 0 }",
            f'device_description_str: "{self.name}"',
        ])


MIB = 2 ** 20
SPECS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 81559 * MIB, 3.35e12, 50 * MIB, 233472, 232448),
    "h200": GpuSpec("NVIDIA H200", (9, 0), 132, 1.98, 143771 * MIB, 4.8e12, 50 * MIB, 233472, 232448),
    "a100": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1.41, 81920 * MIB, 2.039e12, 40 * MIB, 167936, 166912),
}


@functools.cache
def unavailable_reason() -> str | None:
    """None where this process can make compile-only CUDA devices, else why not (one line)."""
    try:
        _topology("h100", 1, 1)
    except Exception as e:  # noqa: BLE001 - a missing plugin, a broken one, or a JAX without the API
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return (f"XLA:GPU cannot compile here ({first}); pip install 'pjax[gpu-plan]' installs JAX's CUDA plugin, "
                f"ptxas and cuDNN")
    return None


def _topology(kind: str, hosts: int, per_host: int) -> list[Any]:
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", topology=f"1x{hosts}x{per_host}",
                                        target_config=SPECS[kind].target_config())
    return list(topo.devices)


def gpu_devices(kind: str, count: int, per_host: int) -> list[Any]:
    """`count` compile-only devices of `kind`, `per_host` to a host (process)."""
    if kind not in SPECS:
        raise ConfigError(f"--xla gpu compiles for {', '.join(SPECS)}; --device-kind {kind} is not one of them.")
    reason = unavailable_reason()
    if reason:
        raise ConfigError(f"--xla gpu: {reason}; or plan with --xla cpu.")
    return _topology(kind, count // per_host, per_host)


@functools.cache
def cudnn_reason() -> str | None:
    """None where XLA:GPU compiles cuDNN's fused attention here (it needs the cuDNN library, not a GPU),
    else why not: a one-head causal attention compiled for one compile-only H100 is the probe."""
    import jax
    import jax.numpy as jnp

    try:
        sharding = jax.sharding.SingleDeviceSharding(gpu_devices("h100", 1, 1)[0])
        q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16, sharding=sharding)
        attend = lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn")
        with persistent_cache(False):
            jax.jit(attend).lower(q).compile()
    except Exception as e:  # noqa: BLE001 - no cuDNN, or one XLA cannot use
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return None


def planned_profile(profile: Any, backend: str) -> Any:
    """The profile a plan compiles with: under XLA:GPU, cuDNN's fused attention wherever it compiles here
    (the kernel `pjax.train` runs on GPUs), else `chunked`, which keeps for the backward what it keeps."""
    if backend == "gpu" and cudnn_reason() is None:
        return dataclasses.replace(profile, attention="cudnn")
    return profile


@contextlib.contextmanager
def persistent_cache(enabled: bool) -> Iterator[None]:
    """JAX's compilation cache writes nothing in this block unless `enabled`: a compile-only device's executable
    cannot be read back without a client (JAX would warn at every later hit), and the planner caches its own
    results. JAX decides once per process whether the cache is used, so it is the writes that are stopped."""
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    if not enabled:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def resolve_backend(requested: str, kind: str) -> str:
    """'cpu' or 'gpu' from --xla auto|cpu|gpu: auto is XLA:GPU for a GPU kind wherever it can compile here."""
    if requested == "auto":
        return "gpu" if kind in SPECS and unavailable_reason() is None else "cpu"
    if requested == "gpu" and kind not in SPECS:
        raise ConfigError(f"--xla gpu compiles for {', '.join(SPECS)}; --device-kind {kind} is not one of them.")
    return requested


def compile_devices(backend: str, kind: str, count: int, per_host: int) -> list[Any]:
    """The devices a layout's step is compiled for: fake CPU devices of this process, or compile-only GPUs."""
    if backend == "gpu":
        return gpu_devices(kind, count, per_host)
    import jax

    return jax.devices("cpu")[:count]
