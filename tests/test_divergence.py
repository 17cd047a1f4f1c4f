"""pjax/divergence.py: a learning rate that diverges on purpose stops the run with one line, or has
its non-finite steps skipped (parameters and moments untouched); either way no checkpoint holds a NaN."""
from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from pjax.checkpoint.checkpointer import Checkpointer
from pjax.config_io import load_config
from pjax.divergence import Diverged, DivergenceGuard
from pjax.train import train

# One device, small batches; lr 1e20 makes step 1's update blow the weights up to ~1e20, so from
# step 2 on every forward overflows: loss and gradient norm are inf or NaN.
DIVERGING = ["mesh.dp=1", "mesh.tp=1", "train.batch_size=8", "train.seq_len=64", "train.lr=1e20",
             "train.warmup_steps=0", "train.steps=6", "log.every=1", "log.eval_every=0", "checkpoint.every=1"]


def run(tmp: Path, cache: Path, *overrides: str):
    cfg = load_config("debug", [*DIVERGING, f"data.cache_dir={cache}", f"log.dir={tmp}/run",
                                f"checkpoint.dir={tmp}/ckpt", *overrides])
    return train(cfg, progress=False, devices=jax.devices()[:1])


def saved_states(directory: Path) -> dict[int, list[np.ndarray]]:
    """Every checkpoint step's parameters and optimizer state, as host arrays."""
    from pjax.config_io import load_config as load
    from pjax.step import build_trainer
    from mesh import MeshConfig, make_mesh

    states = {}
    with Checkpointer(str(directory), read_only=True) as ckpt:
        cfg = load(str(directory / "config.yaml"))
        trainer = build_trainer(make_mesh(MeshConfig(dp=1), jax.devices()[:1]), cfg.model, cfg.train)
        for step in ckpt._manager.all_steps():
            state = ckpt.restore(trainer, cfg, step).state
            states[step] = [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]
    return states


def records(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token_cache")


def test_stop_ends_the_run_naming_the_step_and_the_last_good_checkpoint(tmp_path, cache):
    with pytest.raises(Diverged) as error:
        run(tmp_path, cache)
    message = str(error.value)
    assert "\n" not in message and "step 2: loss " in message and "train.on_nonfinite=stop" in message
    assert f"resume from {tmp_path / 'ckpt'}/1 with a lower train.lr" in message
    states = saved_states(tmp_path / "ckpt")
    assert sorted(states) == [1]  # the non-finite step was never saved
    assert all(np.isfinite(x).all() for x in states[1])
    assert [r["step"] for r in records(tmp_path)] == [1]  # step 2 was not logged as a training step


def test_skip_leaves_the_state_unchanged_and_counts_until_max_skipped(tmp_path, cache):
    with pytest.raises(Diverged, match=r"3 non-finite steps in a row, train.max_skipped=3"):
        run(tmp_path, cache, "train.on_nonfinite=skip", "train.max_skipped=3")
    lines = records(tmp_path)
    skipped = [r for r in lines if r.get("skipped_step")]
    assert [r["step"] for r in skipped] == [2, 3] and [r["skipped_steps"] for r in skipped] == [1, 2]
    assert all(r["loss"] is None or not math.isfinite(r["loss"]) for r in skipped)  # written as null
    logged = [r for r in lines if "tokens_per_sec" in r]
    assert [r["skipped_steps"] for r in logged] == [0, 1, 2]
    # The lr does not move on while steps are skipped: the optimizer's step count stands still.
    assert logged[1]["lr"] == logged[2]["lr"]
    states = saved_states(tmp_path / "ckpt")
    assert sorted(states) == [1, 2, 3]
    for step in (2, 3):  # skipped: parameters and Adam moments exactly as after step 1
        for got, want in zip(states[step], states[1]):
            np.testing.assert_array_equal(got, want)


def test_guard_policies_without_a_device():
    guard = DivergenceGuard("skip", max_skipped=2, spike_sigma=0)
    record, warning = guard.observe(4, float("nan"), float("inf"), False, "ckpt/3")
    assert record["step"] == 4 and record["skipped_step"] is True and record["skipped_steps"] == 1
    assert warning.startswith("warning: step 4:") and "1 in a row of train.max_skipped=2" in warning
    assert guard.observe(5, 3.0, 1.0, True, "ckpt/3") == (None, None)  # a finite step ends the streak
    guard.observe(6, float("nan"), 1.0, False, "ckpt/3")
    with pytest.raises(Diverged, match=r"step 7: .*\(2 non-finite steps in a row.* ckpt/3"):
        guard.observe(7, float("nan"), 1.0, False, "ckpt/3")
    with pytest.raises(Diverged, match="no checkpoint was written"):
        DivergenceGuard("stop", 5, 0).observe(1, float("inf"), 1.0, False, None)


def test_loss_spikes_are_recorded_and_flat_or_falling_losses_are_not():
    guard = DivergenceGuard("stop", 5, spike_sigma=6.0)
    for step, loss in enumerate(np.linspace(6.0, 3.0, 30), 1):  # a falling loss: never a spike
        assert guard.observe(step, float(loss), 1.0, True, None) == (None, None)
    for step in range(31, 91):  # flat, with float noise
        assert guard.observe(step, 3.0 + 1e-7 * (step % 3), 1.0, True, None) == (None, None)
    record, warning = guard.observe(91, 4.5, 1.0, True, None)
    assert record["step"] == 91 and record["loss_spike"] > 6 and "loss spike" in warning
    assert DivergenceGuard("stop", 5, spike_sigma=0).observe(1, 1e9, 1.0, True, None) == (None, None)
