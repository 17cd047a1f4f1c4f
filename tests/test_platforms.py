"""Which platforms an entry point starts JAX on (pjax/platforms.py): the user's JAX_PLATFORMS as set, else the CPU
where JAX's CUDA plugin is installed and no NVIDIA driver is, so that no plugin traceback precedes pjax's output
(said in one line), and one error line where GPUs should be and their driver cannot load."""
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
    assert platforms.start_platforms(environ, dev=str(REPO / "no-dev")) == expected
    assert environ.get("JAX_PLATFORMS") == expected


@pytest.mark.parametrize("chosen", ["cuda", "cpu", "tpu,cpu"])
def test_a_jax_platforms_the_user_sets_is_kept(monkeypatch, chosen):
    monkeypatch.setattr(platforms, "nvidia_driver", lambda: False)
    monkeypatch.setattr(platforms, "cuda_plugin_installed", lambda: True)
    environ = {"JAX_PLATFORMS": chosen}
    assert platforms.start_platforms(environ) is None and environ == {"JAX_PLATFORMS": chosen}


def test_what_says_gpus_should_be_here(tmp_path):
    """A visible-devices list (CUDA's, the NVIDIA container runtime's), SLURM's GPUs, or NVIDIA's device files; the
    values that hide every GPU on purpose say nothing."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").touch()  # the control file alone: no GPU
    assert platforms.gpus_expected({}, str(dev)) is None
    for env, said in [({"CUDA_VISIBLE_DEVICES": "0,1"}, "CUDA_VISIBLE_DEVICES=0,1"),
                      ({"NVIDIA_VISIBLE_DEVICES": "all"}, "NVIDIA_VISIBLE_DEVICES=all"),
                      ({"SLURM_JOB_GPUS": "0,1,2,3"}, "SLURM_JOB_GPUS=0,1,2,3"),
                      ({"SLURM_GPUS_ON_NODE": "8"}, "SLURM_GPUS_ON_NODE=8")]:
        assert platforms.gpus_expected(env, str(dev)) == said
    for env in ({"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"}, {"NVIDIA_VISIBLE_DEVICES": "void"},
                {"SLURM_GPUS_ON_NODE": "0"}):
        assert platforms.gpus_expected(env, str(dev)) is None, env
    (dev / "nvidia0").touch()
    assert platforms.gpus_expected({}, str(dev)) == f"{dev}/nvidia0 exists"


def test_gpus_expected_and_no_driver_is_one_error_line_unless_the_cpu_is_asked_for(monkeypatch, tmp_path):
    monkeypatch.setattr(platforms, "cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(platforms, "driver_error", lambda: "libcuda.so.1: cannot open shared object file")
    environ = {"CUDA_VISIBLE_DEVICES": "0"}
    assert platforms.start_platforms(environ, str(tmp_path)) is None and "JAX_PLATFORMS" not in environ
    said = platforms.missing_gpu(environ, str(tmp_path))
    assert said == ("this host should have GPUs (CUDA_VISIBLE_DEVICES=0) but libcuda.so.1 does not load (cannot "
                    "open shared object file): fix the driver or GPU access, or set JAX_PLATFORMS=cpu.")
    assert platforms.missing_gpu({**environ, "JAX_PLATFORMS": "cpu"}, str(tmp_path)) is None
    assert platforms.missing_gpu({}, str(tmp_path)) is None  # no sign of GPUs: the CPU, said in a note
    monkeypatch.setattr(platforms, "driver_error", lambda: None)
    assert platforms.missing_gpu(environ, str(tmp_path)) is None


def test_train_on_a_gpu_node_without_its_driver_stops_in_one_line():
    """`python -m pjax.train` as a GPU job starts it where the driver is missing (the CUDA plugin installed, no
    JAX_PLATFORMS): one line before JAX starts, not a run on the CPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", "pjax.train", "train.steps=1"], cwd=REPO,
                          env={**env, "CUDA_VISIBLE_DEVICES": "0"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: this host should have GPUs (CUDA_VISIBLE_DEVICES=0) but libcuda.so.1 does "
                                  "not load (cannot open shared object file"), proc.stderr
    assert len(proc.stderr.rstrip("\n")) <= 200, proc.stderr  # tests/error_lines.py does not see a child's lines


def test_a_run_on_the_cpu_pjax_chose_says_so_in_its_start_up_line(monkeypatch):
    monkeypatch.setattr(platforms, "nvidia_driver", lambda: False)
    monkeypatch.setattr(platforms, "cuda_plugin_installed", lambda: True)
    environ: dict = {}
    assert platforms.start_platforms(environ, dev=str(REPO / "no-dev")) == "cpu"
    assert "this host has no NVIDIA driver: the CPU" in platforms.fallback_note(environ)
    assert platforms.fallback_note({"JAX_PLATFORMS": "cpu"}) == ""  # the user's choice: nothing to say


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
