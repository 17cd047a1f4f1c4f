"""Test setup: 8 forced CPU devices, XLA:CPU options and no persistent compilation cache, before JAX is imported;
the suite's two plugins."""
import os

# LLVM at -O0, and XLA:CPU's loop emitters in place of its MLIR fusion emitters: the tests' programs are small, and
# optimising XLA:CPU's kernels costs more compile time than they then save (benchmarks/README.md, "The suite's
# time"); the HLO, its collectives and its memory are XLA's own. The loop emitters order some sums otherwise than
# the fusion emitters do, so two programs of the same math may differ in a last bit: tests/closeness.py.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The pipelines here run in this process: the thread pools pjax.train gives 8 devices that pipeline
# (mesh.distributed.pipeline_cpu_threads), so no test waits on a pool with every thread in a collective.
os.environ.setdefault("PJRT_NPROC", "16")
# No persistent cache (this process's and the runs it starts): jaxlib 0.10's write of an XLA:CPU executable now and
# then segfaults, which loses a worker and its queued files (benchmarks/log/suite.md).
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
assert jax.device_count() == 8, f"tests need 8 forced CPU devices, got {jax.device_count()}"

# Two plugins of the suite's own, their hooks imported here: every `proves` mark held to the runs its test made
# (tests/proofs.py), and every error:/warning: line held to 200 characters (tests/error_lines.py).
import error_lines  # noqa: E402  (tests/ is on sys.path: the tests import one another)
import proofs  # noqa: E402
from error_lines import pytest_runtest_makereport  # noqa: E402
from proofs import pytest_deselected, pytest_fixture_setup, pytest_runtest_call, pytest_runtest_setup  # noqa: E402

HOOKS = (pytest_runtest_makereport, pytest_deselected, pytest_fixture_setup, pytest_runtest_call, pytest_runtest_setup)
proofs.install()
error_lines.install()
