"""DiLoCo under ZeRO (pjax/parallel/group_zero.py): dp4 x tp2 in 2 groups of 2 replicas, H=2, three steps (an inner
step, a synchronisation, an inner step from the new global parameters). ZeRO-1 and ZeRO-3 take the steps DiLoCo
without ZeRO takes, clipping by the group's whole norm, while each device keeps half its group's inner state (and
under ZeRO-3 half its parameters); so does streaming DiLoCo (H=4 in 2 fragments, tau=1, alpha=0.5: a fragment sent
at step 2 lands, mixed, at step 3), and ZeRO-3 with a 1F1B pipeline in each group (dp4 x pp2: the executor
reduce-scatters each replica's gradient in its group, the hook ZeRO-1 shares); in groups of one replica ZeRO-3
keeps the groups whole and shards the global parameters alone; a resume with a fragment in flight continues bit for
bit, and one onto other ZeRO restarts the groups from the global parameters."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.config_io import load_config
from pjax.parallel import group_zero
from pjax.train import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import random_batch, trainer_for  # noqa: E402
from closeness import assert_close_but_a_few  # noqa: E402
from run_helpers import preempted_after  # noqa: E402

LR = 1e-3
# grad_clip below the gradients' norm (checked), weight decay large enough that a norm scale decayed would show.
RUN = ["train.batch_size=8", "train.seq_len=32", "train.grad_accum=2", "train.dtype=float32", "mesh.dp=4",
       "mesh.tp=2", "train.local_steps=2", "train.warmup_steps=0", "train.grad_clip=0.5",
       "train.weight_decay=0.5", f"train.lr={LR}"]
STREAM = ["train.local_steps=4", "train.diloco_fragments=2", "train.diloco_overlap=1", "train.diloco_mix=0.5"]
# pp: a 1F1B pipeline in each group; qwen: Qwen's q/k norm scales and q/k/v biases, weights with no 'embed' axis
VARIANTS = {"streaming": STREAM, "pp": ["mesh.tp=1", "mesh.pp=2"], "qwen": ["model.qk_norm=true", "model.qkv_bias=true"]}


def _run(zero: int, groups: int | None, variant: str | None = None) -> dict:
    """Three steps from the same start: losses, grad norms, and per step the global parameters and the groups'
    whole copies (host copies: the step donates its state), and the last state's arrays."""
    cfg, trainer = trainer_for("debug", [*RUN, f"train.zero={zero}", f"train.diloco_groups={groups or 'null'}",
                                         *VARIANTS.get(variant, [])])
    state, out = trainer.init(jax.random.key(0)), {"loss": [], "grad_norm": [], "params": [], "copies": []}
    for seed in range(3):
        state, metrics = trainer.step(state, random_batch(trainer, seed))
        copies = state.local["params"]
        if zero >= 3 and groups:
            with jax.set_mesh(trainer.mesh):
                copies = jax.jit(functools.partial(group_zero.gather, cfg=cfg.model, size=2))(copies)
        out["loss"].append(float(metrics["loss"]))
        out["grad_norm"].append(float(metrics["grad_norm"]))
        out["params"].append(jax.tree.map(np.asarray, state.params))
        out["copies"].append(jax.tree.map(np.asarray, copies))
    return {**out, "state": state}


@pytest.fixture(scope="module")
def runs() -> dict[tuple[int, int | None], dict]:
    """Keyed (train.zero, train.diloco_groups[, a VARIANTS key]): 2 groups of 2 replicas, or (None) 4 groups of
    one."""
    keys = ((0, 2), (1, 2), (3, 2), (0, None), (3, None), (0, 2, "streaming"), (1, 2, "streaming"),
            (3, 2, "streaming"), (0, 2, "pp"), (3, 2, "pp"), (0, 2, "qwen"), (1, 2, "qwen"), (3, 2, "qwen"))
    return {key: _run(*key) for key in keys}


def _close(a, b) -> None:
    # Two programs that order their sums otherwise (tests/closeness.py): a few entries, whose gradient nearly
    # cancels, move as AdamW divides it by its root mean square, by less than a step's lr. Under XLA:CPU's loop
    # emitters (benchmarks/log/suite.md) at most 6e-6 of a step's entries moved, by up to 1e-4; at lr 1e-2 the
    # third step's gradients moved with them, everywhere.
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    assert_close_but_a_few(flat(a), flat(b), rtol=2e-6, atol=5e-6, bound=LR, share=1e-5)


def _same_steps(plain: dict, sharded: dict) -> None:
    assert min(plain["grad_norm"]) > 0.5  # every step clipped: the group's norm decides each update
    np.testing.assert_allclose(sharded["loss"], plain["loss"], rtol=1e-6)
    np.testing.assert_allclose(sharded["grad_norm"], plain["grad_norm"], rtol=1e-6)
    for step in range(3):
        _close(sharded["params"][step], plain["params"][step])
        _close(sharded["copies"][step], plain["copies"][step])
    first, last = plain["params"][0], plain["params"][2]
    assert not np.allclose(first["embed"]["embedding"], last["embed"]["embedding"])  # the outer step moved them


def _per_device(tree) -> int:
    """Elements of the floating-point leaves (not the step counts) on one device."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum(x.addressable_shards[0].data.size for x in leaves)


@pytest.mark.parametrize("variant", [pytest.param((), marks=pytest.mark.proves("zero1+diloco"), id="diloco"),
                                    pytest.param(("streaming",), marks=pytest.mark.proves("zero1+streaming"),
                                                 id="streaming")])
def test_zero1_under_diloco_takes_diloco_s_steps_with_half_the_inner_state_per_device(runs, variant):
    _same_steps(runs[(0, 2, *variant)], runs[(1, 2, *variant)])
    plain, sharded = runs[(0, 2, *variant)]["state"].local, runs[(1, 2, *variant)]["state"].local
    assert 2 * _per_device(sharded["opt_state"]) == _per_device(plain["opt_state"])
    assert _per_device(sharded["params"]) == _per_device(plain["params"])  # ZeRO-1 keeps whole copies


@pytest.mark.parametrize("variant", [pytest.param((), marks=pytest.mark.proves("zero3+diloco"), id="diloco"),
                                    pytest.param(("streaming",), marks=pytest.mark.proves("zero3+streaming"),
                                                 id="streaming"),
                                    pytest.param(("pp",), id="pp")])
def test_zero3_under_diloco_takes_diloco_s_steps_with_half_the_inner_state_and_copy_per_device(runs, variant):
    _same_steps(runs[(0, 2, *variant)], runs[(3, 2, *variant)])
    plain, sharded = runs[(0, 2, *variant)]["state"].local, runs[(3, 2, *variant)]["state"].local
    assert 2 * _per_device(sharded["opt_state"]) == _per_device(plain["opt_state"])
    assert 2 * _per_device(sharded["params"]) == _per_device(plain["params"])


@pytest.mark.parametrize("zero", [1, 3])
def test_weights_without_an_embed_axis_stay_whole_in_the_groups_and_take_diloco_s_steps(runs, zero):
    """Qwen's per-head norm scales and q/k/v biases have no 'embed' axis to split: each replica keeps them whole,
    their gradient is its group's whole sum, and the group's norm counts them once."""
    _same_steps(runs[(0, 2, "qwen")], runs[(zero, 2, "qwen")])
    def kept_whole(state):  # per device, the inner state's (and copy's) arrays of these weights
        return [x.addressable_shards[0].data.shape for path, x in jax.tree_util.tree_leaves_with_path(state.local)
                if any(getattr(k, "key", None) in ("bq", "q_norm") for k in path)]
    plain, sharded = kept_whole(runs[(0, 2, "qwen")]["state"]), kept_whole(runs[(zero, 2, "qwen")]["state"])
    assert len(sharded) >= 4 and sharded == plain


@pytest.mark.proves("zero3+diloco")
def test_zero3_in_groups_of_one_replica_keeps_them_whole_and_shards_the_global_parameters(runs):
    """Nothing to shard within a group of one: the groups as without ZeRO, the global parameters over dp4."""
    plain, sharded = runs[0, None], runs[3, None]
    _same_steps(plain, sharded)
    assert _per_device(sharded["state"].local) == _per_device(plain["state"].local)
    assert 4 * _per_device(sharded["state"].params) == _per_device(plain["state"].params)
    assert 4 * _per_device(sharded["state"].opt_state) == _per_device(plain["state"].opt_state)  # outer momentum
    tc = load_config("debug", [*RUN, "train.zero=3"]).train
    assert "set train.diloco_groups below the 4 replicas" in group_zero.whole_groups_note(tc, 4)
    assert group_zero.whole_groups_note(load_config("debug", [*RUN, "train.zero=3", "train.diloco_groups=2"]).train,
                                        4) is None


def test_a_resume_under_zero3_with_a_fragment_in_flight_continues_bit_for_bit_and_other_zero_restarts_the_groups(
        tmp_path, capfd):
    """Streaming DiLoCo saved at step 2, its first fragment in flight and the groups' chunks holding two inner
    steps the global parameters do not; resumed as it was, and under ZeRO-1 (whole copies, not chunks: the groups
    restart from the global parameters)."""
    def run(name: str, *extra: str) -> list[float]:
        overrides = [*RUN, *STREAM, "train.zero=3", "train.diloco_groups=2", "train.steps=5", "log.every=1",
                     "log.eval_every=0", f"log.dir={tmp_path}/{name}", f"checkpoint.dir={tmp_path}/{name}/ckpt",
                     "checkpoint.every=2", *extra]
        cfg = load_config("debug", overrides)
        return [r["loss"] for r in train(cfg, progress=False, devices=jax.devices()[:8])]

    straight = run("a")
    preempted_after(tmp_path / "a", tmp_path / "b", 2)
    assert run("b") == straight[2:]
    assert "starts from the global parameters" not in capfd.readouterr().err
    preempted_after(tmp_path / "a", tmp_path / "c", 2)
    assert len(run("c", "train.zero=1")) == 3
    assert "every DiLoCo group starts from the global parameters" in capfd.readouterr().err
