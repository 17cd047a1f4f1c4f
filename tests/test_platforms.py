"""Which platforms an entry point starts JAX on (pjax/platforms.py): the user's JAX_PLATFORMS as set, else the CPU
where JAX's CUDA plugin is installed and no NVIDIA driver is, so that no plugin traceback precedes pjax's output."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pjax import platforms

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("driver,plugin,expected", [(False, True, "cpu"), (True, True, None), (False, False, None)])
def test_cpu_only_where_the_cuda_plugin_finds_no_driver(monkeypatch, driver, plugin, expected):
    monkeypatch.setattr(platforms, "nvidia_driver", lambda: driver)
    monkeypatch.setattr(platforms, "cuda_plugin_installed", lambda: plugin)
    environ = {"PATH": "/bin"}
    assert platforms.start_platforms(environ) == expected
    assert environ.get("JAX_PLATFORMS") == expected


@pytest.mark.parametrize("chosen", ["cuda", "cpu", "tpu,cpu"])
def test_a_jax_platforms_the_user_sets_is_kept(monkeypatch, chosen):
    monkeypatch.setattr(platforms, "nvidia_driver", lambda: False)
    monkeypatch.setattr(platforms, "cuda_plugin_installed", lambda: True)
    environ = {"JAX_PLATFORMS": chosen}
    assert platforms.start_platforms(environ) is None and environ == {"JAX_PLATFORMS": chosen}


def test_calibrate_starts_without_a_plugin_traceback(tmp_path):
    """As a user runs `python -m pjax.plan.calibrate`: no JAX_PLATFORMS, and JAX's CUDA plugin (the test extra's
    gpu-plan) with no GPU. Its one cheap section, bandwidth, on the CPU, in a few seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", "pjax.plan.calibrate", "--only", "bandwidth",
                           "--out", str(tmp_path / "calibration.json")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Unable to load" not in proc.stderr, proc.stderr[-2000:]
    assert json.loads((tmp_path / "calibration.json").read_text())["bandwidth"]
