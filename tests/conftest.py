"""Test setup: 8 forced CPU devices and a persistent compilation cache, before JAX is imported."""
import os

# LLVM at -O0: the tests' programs are small, and optimising XLA:CPU's kernels costs more compile time than they
# then save (benchmarks/README.md, "The suite's time"); the HLO, its collectives and its memory are XLA's own.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The pipelines here run in this process: the thread pools pjax.train gives 8 devices that pipeline
# (mesh.distributed.pipeline_cpu_threads), so no test waits on a pool with every thread in a collective.
os.environ.setdefault("PJRT_NPROC", "16")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
assert jax.device_count() == 8, f"tests need 8 forced CPU devices, got {jax.device_count()}"
