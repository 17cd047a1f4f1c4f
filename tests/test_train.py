"""End to end: `python -m pjax.train` on the shipped text; layouts change the layout, not the losses."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from mesh.errors import ConfigError
from pjax.config_io import load_config
from pjax.train import train

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, tmp_path: Path, platforms: str | None = "cpu") -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": platforms}
    if platforms is None:
        env.pop("JAX_PLATFORMS")
    env.pop("XLA_FLAGS", None)  # the trainer forces the CPU device count the mesh needs
    return subprocess.run([sys.executable, "-m", "pjax.train", "--no_progress", f"data.cache_dir={tmp_path}/cache",
                           f"log.dir={tmp_path}/run", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_cli_default_config_learns_the_text_and_writes_metrics(tmp_path):
    """As a user runs it: no JAX_PLATFORMS, and JAX's CUDA plugin (the test extra's gpu-plan) with no GPU."""
    proc = run_cli("train.steps=100", "log.every=10", "log.eval_every=100", tmp_path=tmp_path, platforms=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Unable to load" not in proc.stderr, proc.stderr[-2000:]
    assert "mesh dp=4 pp=1 cp=1 tp=2 over 8 cpu devices" in proc.stdout
    assert "layers/wq" in proc.stdout and "parameters:" in proc.stdout
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train_records] == list(range(10, 101, 10))
    for r in train_records:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "step_time_s", "data_wait_s",
                "skipped_steps"} <= r.keys()
        assert 0 <= r["data_wait_s"] < r["step_time_s"]
        assert r["mfu"] is None  # no configured CPU peak: no made-up MFU
        assert r["tokens_per_sec"] > 0 and r["step_time_s"] > 0 and r["skipped_steps"] == 0
        # XLA:CPU keeps no allocator statistics: the compiled step's own figures, per device.
        assert r["memory_source"] == "compiled" and 0 < r["memory_in_use_bytes"] < r["memory_peak_bytes"] < 2**30
    assert " mem " in proc.stdout and "M/" in proc.stdout  # the progress line shows memory too
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in evals] == [100]
    ln_vocab = math.log(4096)
    assert train_records[-1]["loss"] < ln_vocab - 1.5, train_records[-1]
    assert evals[0]["eval_loss"] < ln_vocab - 1.5, evals
    assert list((tmp_path / "run").glob("events.out.tfevents.*")), "no TensorBoard event file"


def test_memory_comes_from_the_allocator_where_the_backend_keeps_statistics():
    from pjax.observe.metrics import memory_per_device

    class Device:
        def __init__(self, stats):
            self._stats = stats

        def memory_stats(self):
            return self._stats

    gpus = [Device({"bytes_in_use": 5, "peak_bytes_in_use": 9}), Device({"bytes_in_use": 7, "peak_bytes_in_use": 8})]
    assert memory_per_device(gpus, (1, 2)) == {"memory_in_use_bytes": 7, "memory_peak_bytes": 9,
                                               "memory_source": "device"}  # the most loaded device
    assert memory_per_device([Device(None)], (1, 2)) == {"memory_in_use_bytes": 1, "memory_peak_bytes": 2,
                                                         "memory_source": "compiled"}


def test_cli_bad_config_is_one_line_error(tmp_path):
    proc = run_cli("mesh.tp=3", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "model.num_attention_heads=4 is not divisible by mesh.tp=3" in proc.stderr
    proc = run_cli("mesh.tp=3", "--config", "debug", "train.steps=3", tmp_path=tmp_path)  # options between overrides
    assert proc.returncode == 2 and "is not divisible by mesh.tp=3" in proc.stderr, proc.stderr
    proc = run_cli("train.stpes=3", tmp_path=tmp_path)
    assert proc.returncode == 2 and "did you mean 'train.steps'" in proc.stderr


def small_run(tmp_path, name, **mesh):
    overrides = [f"mesh.{k}={v}" for k, v in mesh.items()] + [
        "train.steps=4", "log.every=1", "log.eval_every=0", f"log.dir={tmp_path}/{name}", f"data.cache_dir={tmp_path}/cache"]
    cfg = load_config("debug", overrides)
    n = math.prod(mesh.values())
    return [r["loss"] for r in train(cfg, progress=False, devices=jax.devices()[:n])]


def test_dp2_tp2_losses_equal_one_device(tmp_path):
    one = small_run(tmp_path, "one", dp=1, tp=1)
    sharded = small_run(tmp_path, "sharded", dp=2, tp=2)
    assert len(one) == 4
    assert max(abs(a - b) for a, b in zip(one, sharded)) <= 1e-5, (one, sharded)


def test_profile_steps_trace_exactly_those_steps_and_leave_the_losses_unchanged(tmp_path, capsys):
    """log.profile_steps=[2, 2]: a jax.profiler trace of steps 2 and 3 under <log.dir>/profile, each
    step named for TensorBoard's step view, and losses equal to a run without it (CPU fp32)."""
    def run(name: str, *extra: str) -> list[float]:
        cfg = load_config("debug", ["mesh.dp=1", "mesh.tp=1", "train.steps=4", "train.batch_size=4",
                                    "train.seq_len=32", "log.every=1", "log.eval_every=0", f"log.dir={tmp_path}/{name}",
                                    f"data.cache_dir={tmp_path}/cache", *extra])
        return [r["loss"] for r in train(cfg, progress=False, devices=jax.devices()[:1])]

    plain = run("plain")
    assert not (tmp_path / "plain" / "profile").exists()  # off by default
    traced = run("traced", "log.profile_steps=[2,2]")
    assert traced == plain and len(plain) == 4
    [trace] = (tmp_path / "traced" / "profile" / "plugins" / "profile").glob("*/*.xplane.pb")
    assert (trace.parent / "perfetto_trace.json.gz").is_file()
    assert f"profile of steps 2 to 3: {trace.parent} (tensorboard --logdir" in capsys.readouterr().out
    data = jax.profiler.ProfileData.from_file(str(trace))
    lines = [line for plane in data.planes for line in plane.lines]
    steps = [dict(e.stats)["step_num"] for line in lines for e in line.events if e.name == "train"]
    assert sorted(steps) == [2, 3]
    assert any(line.name.startswith("tf_XLAEigen") and list(line.events) for line in lines)  # XLA:CPU's work


def test_tokenizer_larger_than_vocab_is_a_config_error(tmp_path):
    cfg = load_config("debug", ["model.vocab_size=1024", "mesh.dp=1", "mesh.tp=1", f"data.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="has 4096 tokens but model.vocab_size=1024"):
        train(cfg, progress=False, devices=jax.devices()[:1])


def test_held_out_split_too_small_fails_before_training(tmp_path):
    """Found on a GPU run: the first evaluation raised this after 20 steps, before any checkpoint."""
    cfg = load_config("debug", ["mesh.dp=1", "mesh.tp=1", "train.seq_len=512", "train.batch_size=64",
                                "log.eval_every=10", f"log.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"])
    with pytest.raises(ConfigError, match="held-out split has .* less than one batch"):
        train(cfg, progress=False, devices=jax.devices()[:1])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_step_too_large_for_device_memory_fails_before_training(tmp_path, monkeypatch):
    """GPUs report a per-device limit (CPUs do not): a step that needs more is refused up front."""
    import pjax.observe.memory

    monkeypatch.setattr(pjax.observe.memory, "device_memory_limit", lambda device: 2**20)
    cfg = load_config("debug", ["mesh.dp=1", "mesh.tp=1", f"log.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"])
    with pytest.raises(ConfigError, match=r"needs \d+ MiB per device and a device has 1 MiB: raise train.grad_accum"):
        train(cfg, progress=False, devices=jax.devices()[:1])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_memory_error_on_gpu_names_jax_preallocation_fraction(monkeypatch):
    """Found on an H100: a step needing 59.5 GiB was refused on an 80 GB card, whose JAX limit is
    75% of it; the error says how to raise that share (nothing to say on CPU)."""
    from pjax.observe.memory import memory_fixes, preallocation_hint

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    assert preallocation_hint("cpu") == ""
    assert preallocation_hint("gpu") == "XLA_PYTHON_CLIENT_MEM_FRACTION (.75)"
    assert memory_fixes("gpu").endswith("raise train.zero or XLA_PYTHON_CLIENT_MEM_FRACTION (.75)")
    assert memory_fixes("cpu") == "raise train.grad_accum, set train.remat=full or raise train.zero"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    assert preallocation_hint("gpu") == "XLA_PYTHON_CLIENT_MEM_FRACTION (.5)"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")  # no preallocated pool: no such limit
    assert preallocation_hint("gpu") == ""


def test_out_of_memory_at_run_time_is_one_line(monkeypatch, capsys):
    import pjax.train

    def oom(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 30.02GiB\nmore")

    monkeypatch.setattr(pjax.train, "train", oom)
    monkeypatch.setattr(pjax.train, "force_cpu_devices", lambda *a: None)
    assert pjax.train.main(["mesh.dp=1", "mesh.tp=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ran out of memory (allocating 30.02GiB): raise" in err, err
