"""Run pipeline layouts with more micro-batches than stages, in a process of their own sized as
`pjax.train` sizes it (8 forced CPU devices, `mesh.distributed.pipeline_cpu_threads`).

`tests/test_pipeline_stress.py` runs this under a timeout: a layout whose collectives starve
XLA:CPU's thread pool aborts or hangs instead of finishing. Prints one JSON line per layout.
"""
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

from mesh import MeshConfig  # noqa: E402
from mesh.distributed import pipeline_cpu_threads  # noqa: E402

pipeline_cpu_threads(MeshConfig(pp=2), 8)

import jax  # noqa: E402

from test_pipeline_parallel import assert_grads_close, run  # noqa: E402

LAYOUTS = {
    "dp2_pp2_tp2_zb_h1_m8": dict(m=8, pp=2, dp=2, tp=2, schedule="zb_h1"),
    "pp2_cp2_tp2_interleaved_m4": dict(m=4, pp=2, cp=2, tp=2, schedule="interleaved"),
    "pp2_tp2_sp_zb_v_m8": dict(m=8, pp=2, tp=2, schedule="zb_v", sequence_parallel=True),
    "pp4_tp2_1f1b_m8": dict(m=8, pp=4, tp=2, schedule="1f1b"),
}

if __name__ == "__main__":
    assert jax.device_count() == 8
    for name in sys.argv[1:] or LAYOUTS:
        layout = LAYOUTS[name]
        loss, grads, _ = run(**layout)
        ref_loss, ref_grads, _ = run(layout["m"])
        assert abs(loss - ref_loss) <= 1e-5, (name, loss, ref_loss)
        assert_grads_close(grads, ref_grads)
        print(json.dumps({"layout": name, "loss": loss, "threads": os.environ["PJRT_NPROC"]}), flush=True)
