"""Streaming DiLoCo (`train.diloco_fragments`, `train.diloco_overlap`, `train.diloco_mix`;
pjax/parallel/streaming.py): with one fragment and no overlap it is DiLoCo bit for bit; fragments land in turn,
each moving only its own slices, tau steps after they were sent, mixed into the groups' copies; in PowerSGD each
fragment is the rank-r mean from its own warm-start Q; a resume with a fragment in flight continues bit for bit;
an outer step sends 1/P of DiLoCo's bytes (the compiled HLO)."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.config_io import load_config
from pjax.observe import hlo
from models import llama
from pjax.parallel import feedback, powersgd, streaming
from pjax.train import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import random_batch, trainer_for  # noqa: E402
from closeness import assert_close_but_a_few  # noqa: E402
from run_helpers import preempted_after  # noqa: E402

SMALL = ["train.batch_size=8", "train.seq_len=32", "train.grad_accum=2", "train.dtype=float32",
         "train.warmup_steps=0", "mesh.tp=1"]
host = functools.partial(jax.tree.map, lambda x: np.asarray(x, np.float64))


def _trainer(overrides: list[str]):
    return trainer_for("debug", [*SMALL, *overrides])


def _steps(trainer, step, state, count: int) -> list:
    """The host copies of `state` and of the state after each of `count` steps (the step donates its input)."""
    states = [jax.tree.map(np.asarray, state)]
    with jax.set_mesh(trainer.mesh):
        for seed in range(count):
            state = step(state, random_batch(trainer, seed))[0]
            states.append(jax.tree.map(np.asarray, state))
    return states


def test_one_fragment_without_overlap_is_diloco_bit_for_bit():
    """dp2 x pp2 (a 1F1B pipeline in each group), the outer average in int8 with error feedback, 4 steps."""
    _, trainer = _trainer(["mesh.dp=2", "mesh.pp=2", "train.grad_compression=int8", "train.local_steps=2"])
    diloco = trainer.diloco
    stream = streaming.StreamingDiLoCo(diloco.strategy, diloco.inner, diloco.outer, diloco.tc)
    jit = functools.partial(jax.jit, in_shardings=(trainer.state_sharding, trainer.batch_sharding),
                            out_shardings=(trainer.state_sharding, None))
    a = _steps(trainer, jit(diloco.step), trainer.init(jax.random.key(0)), 4)
    b = _steps(trainer, jit(stream.step), trainer.init(jax.random.key(0)), 4)
    assert not np.array_equal(jax.tree.leaves(a[-1].params)[0], jax.tree.leaves(a[0].params)[0])
    for x, y in zip(a, b):
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            np.testing.assert_array_equal(u, v)


@pytest.fixture(scope="module")
def turns():
    """dp2 x cp2 (ring attention in each group), H=4 in 2 fragments (one sent every 2 steps), tau=1, alpha=0.5:
    the state before and after each of 5 steps, and the groups after step 3's inner step alone."""
    cfg, trainer = _trainer(["mesh.dp=2", "mesh.cp=2", "train.local_steps=4", "train.diloco_fragments=2",
                             "train.diloco_overlap=1", "train.diloco_mix=0.5"])
    states = _steps(trainer, trainer.step, trainer.init(jax.random.key(0)), 5)
    with jax.set_mesh(trainer.mesh):
        inner_only = jax.jit(trainer.diloco.inner_round)(states[2], random_batch(trainer, 2))[0]
    return cfg, states, jax.tree.map(np.asarray, inner_only)


def _part(tree, f: int, axis: int = 0):
    return jax.tree.map(lambda x: np.asarray(streaming.fragment(x, f, 2, axis), np.float64), tree)


def _equal(a, b, rtol=0.0, atol=0.0) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


def _near_inner_round(a, b, lr: float) -> None:
    """`b` comes from the inner round compiled alone, another program than the step's (tests/closeness.py): its
    sums' order may differ by a last bit, and an entry whose gradient nearly cancels may move by up to a step's lr
    where AdamW divides it by its root mean square."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert_close_but_a_few(x, y, rtol=1e-6, atol=1e-7, bound=lr, share=1e-5)


@pytest.mark.proves("ring+streaming")
def test_fragments_land_in_turn_tau_steps_after_their_send_and_move_only_their_slices(turns):
    cfg, s, inner_only = turns
    lr, mu = cfg.train.outer_lr, cfg.train.outer_momentum
    for n in (1, 2):  # nothing lands before step 3
        _equal(s[n].params, s[0].params)
    _equal(s[2].local["inflight"], _part(s[2].local["params"], 0, 1))  # step 2 sent fragment 0
    # Step 3: fragment 0 lands (first outer step: lr (1 + mu) (global - mean of the sent copies)); 1 waits.
    mean = jax.tree.map(lambda x: x.mean(axis=0), host(s[2].local["inflight"]))
    want = jax.tree.map(lambda p, m: p - lr * (1 + mu) * (p - m), _part(s[0].params, 0), mean)
    _equal(_part(s[3].params, 0), want, rtol=1e-5, atol=1e-7)
    _equal(_part(s[3].params, 1), _part(s[0].params, 1))
    # Every group keeps half of its own fragment 0 (alpha = 0.5), and all of its fragment 1.
    landed = _part(s[3].params, 0)
    mixed = jax.tree.map(lambda own, g: 0.5 * own + 0.5 * g[None], _part(inner_only["params"], 0, 1), landed)
    _near_inner_round(_part(s[3].local["params"], 0, 1), mixed, cfg.train.lr)
    _near_inner_round(_part(s[3].local["params"], 1, 1), _part(inner_only["params"], 1, 1), cfg.train.lr)
    # Step 4 sends fragment 1 and step 5 lands it; fragment 0 waits for its next turn.
    _equal(s[4].local["inflight"], _part(s[4].local["params"], 1, 1))
    _equal(_part(s[5].params, 0), _part(s[3].params, 0))
    assert not np.allclose(_part(s[5].params, 1)["embed"]["embedding"], _part(s[3].params, 1)["embed"]["embedding"])


# DiLoCo's outer bounds (test_diloco); here measured int8 3.6e-3, bf16 2.6e-3 (2^-9 a value); nothing carried is 1.
@pytest.mark.parametrize("payload, bound", [("int8", 0.02), ("bf16", 0.005)])
@pytest.mark.proves("int8_reduce+streaming", "bf16_reduce+streaming")
def test_a_compressed_fragment_lands_within_its_payload_and_its_residuals_keep_the_rest(payload, bound):
    """dp2, H=2 in 2 fragments (one sent and landed each step, no overlap), outer SGD at lr 1 without momentum:
    step 1 moves fragment 0 of the global parameters by the carried mean of (global - copy), the exact mean within
    the payload's rounding (`bound`, relative); fragment 1 waits; the replicas' residuals hold what fragment 0's
    payload did not carry, exactly, and nothing of fragment 1."""
    _, trainer = _trainer(["mesh.dp=2", "train.local_steps=2", "train.diloco_fragments=2", "train.outer_lr=1.0",
                           "train.outer_momentum=0", f"train.grad_compression={payload}"])
    s0, s1 = _steps(trainer, trainer.step, trainer.init(jax.random.key(0)), 1)
    with jax.set_mesh(trainer.mesh):
        inner_only = jax.tree.map(np.asarray, jax.jit(trainer.diloco.inner_round)(s0, random_batch(trainer, 0))[0])
    exact = jax.tree.map(lambda p, c: p - c.mean(axis=0), _part(s0.params, 0), _part(inner_only["params"], 0, 1))
    carried = jax.tree.map(lambda a, b: a - b, _part(s0.params, 0), _part(s1.params, 0))
    _equal(_part(s1.params, 1), _part(s0.params, 1))
    errors = s1.residual["error"]
    _equal(jax.tree.map(lambda d, e: 2 * d + e.sum(axis=0), carried, _part(errors, 0, 1)),
           jax.tree.map(lambda x: 2 * x, exact), rtol=1e-5, atol=1e-8)
    _equal(_part(errors, 1, 1), jax.tree.map(np.zeros_like, _part(errors, 1, 1)))
    norm = lambda tree: np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree)))  # noqa: E731
    assert 0 < norm(jax.tree.map(lambda a, b: a - b, carried, exact)) < bound * norm(exact)


def _powersgd_mean(matrices: np.ndarray, q: np.ndarray, names: tuple) -> tuple[np.ndarray, ...]:
    """PowerSGD's rank-r mean over the replicas of `matrices` ([replicas, *shape]) from the warm-start `q`, its
    next Q and each replica's new residual, in float64: one power iteration (pjax/parallel/powersgd.py)."""
    batch, first = powersgd.split(names)
    shape = matrices.shape[1:]
    m = matrices.reshape(len(matrices), *shape[:batch], int(np.prod(shape[batch:first])), -1)
    p = np.linalg.qr((m @ q).sum(axis=0))[0]
    mine = np.swapaxes(m, -1, -2) @ p  # each replica's M_i^T P
    q_next = mine.sum(axis=0)
    errors = m - p @ np.swapaxes(mine, -1, -2)
    return (p @ np.swapaxes(q_next, -1, -2)).reshape(shape) / len(matrices), q_next, errors.reshape(matrices.shape)


@pytest.mark.proves("powersgd+streaming")
def test_a_powersgd_fragment_is_the_rank_r_mean_from_its_own_warm_start_q():
    """dp2, H=2 in 2 fragments (one landed each step), rank 2, outer SGD at lr 1 without momentum. Steps 1, 2
    and 3 land fragments 0, 1 and 0 again: each moves its slices of the global parameters by PowerSGD's rank-2
    mean of (global - copy + residual), computed here in float64 from that fragment's own Q (a layer's, or the
    embedding's and head's per-fragment one; step 3's warm-started by step 1), keeps the rest in the replicas'
    residuals, and leaves the other fragment's parameters, residuals and Qs as they were."""
    cfg, trainer = _trainer(["mesh.dp=2", "train.local_steps=2", "train.diloco_fragments=2", "train.outer_lr=1.0",
                             "train.outer_momentum=0", "train.grad_compression=powersgd", "train.powersgd_rank=2"])
    names = llama.param_logical_axes(cfg.model)
    states = _steps(trainer, trainer.step, trainer.init(jax.random.key(0)), 3)
    inner_round = jax.jit(trainer.diloco.inner_round)
    for n, f in ((1, 0), (2, 1), (3, 0)):
        before, after = states[n - 1], states[n]
        with jax.set_mesh(trainer.mesh):
            copies = host(inner_round(before, random_batch(trainer, n - 1))[0]["params"])
        outer_grad = jax.tree.map(lambda p, c, e: p[None] - c + e, _part(before.params, f), _part(copies, f, 1),
                                  _part(before.residual["error"], f, 1))
        q_of = lambda q, path: (np.asarray(q, np.float64)[0, 0, f] if path[0].key != "layers"  # noqa: E731
                                else _part(q, f, 2)[0, 0])
        for path, grad in jax.tree_util.tree_leaves_with_path(outer_grad):
            leaf = lambda tree: functools.reduce(lambda t, k: t[k.key], path, tree)  # noqa: E731
            carried = _part(leaf(before.params), f) - _part(leaf(after.params), f)
            if not feedback.has_q(leaf(names)):  # a vector: the exact mean
                want = grad.mean(axis=0)  # carried: two norm scales near 1 apart (measured 6.0e-5)
                np.testing.assert_allclose(carried, want, atol=1e-4 * np.abs(want).max(), err_msg=f"{n}, {path}")
                continue
            # Within fp32's rounding of the parameters (carried is a difference of two of them) and of the products:
            # measured 6.4e-6 (mean), 4.7e-6 (residual), 4.6e-6 (Q) of the largest; another fragment's Q gives O(1).
            want, q_next, errors = _powersgd_mean(grad, q_of(leaf(before.residual["q"]), path), leaf(names))
            np.testing.assert_allclose(carried, want, atol=1e-4 * np.abs(want).max(), err_msg=f"{n}, {path}")
            np.testing.assert_allclose(_part(leaf(after.residual["error"]), f, 1), errors,
                                       atol=1e-4 * np.abs(errors).max())
            got_q = q_of(leaf(after.residual["q"]), path)  # up to each column's sign, which QR's convention picks
            np.testing.assert_allclose(np.abs(got_q), np.abs(q_next), atol=1e-4 * np.abs(q_next).max())
            other = lambda s: (np.asarray(leaf(s.residual["q"]))[0, 0, 1 - f] if path[0].key != "layers"  # noqa
                               else _part(leaf(s.residual["q"]), 1 - f, 2)[0, 0])
            np.testing.assert_array_equal(other(after), other(before))
        _equal(_part(after.params, 1 - f), _part(before.params, 1 - f))
        _equal(_part(after.residual["error"], 1 - f, 1), _part(before.residual["error"], 1 - f, 1))


def test_a_resume_with_a_fragment_in_flight_continues_bit_for_bit(tmp_path, capfd):
    """Saved at step 2, between fragment 0's send and its landing at step 3; the outer average in PowerSGD, whose
    per-fragment Qs and residuals travel with the checkpoint. Resumed as DiLoCo (one fragment, whose Qs are
    shaped otherwise), the groups and the feedback state restart, with a warning each."""
    def run(name: str, *extra: str) -> list[float]:
        overrides = [*SMALL, "mesh.dp=2", "train.steps=6", "log.every=1", "log.eval_every=0",
                     "train.local_steps=4", "train.diloco_fragments=2", "train.diloco_overlap=1",
                     "train.grad_compression=powersgd", f"log.dir={tmp_path}/{name}",
                     f"checkpoint.dir={tmp_path}/{name}/ckpt", "checkpoint.every=2", *extra]
        cfg = load_config("debug", overrides)
        return [r["loss"] for r in train(cfg, progress=False, devices=jax.devices()[:2])]

    straight = run("a")
    preempted_after(tmp_path / "a", tmp_path / "b", 2)
    assert run("b") == straight[2:]
    err = capfd.readouterr().err
    assert "starts from the global parameters" not in err and "starts at zero" not in err
    preempted_after(tmp_path / "a", tmp_path / "c", 2)
    assert len(run("c", "train.diloco_fragments=1", "train.diloco_overlap=0")) == 4
    err = capfd.readouterr().err
    assert "residual starts at zero" in err and "every DiLoCo group starts from the global parameters" in err


def test_an_outer_step_sends_one_fragment_of_dilocos_bytes():
    """dp2: the compiled step's all-reduces over dp are the scalars (loss, token count, norm) and, under the
    outer step's branch, the average: all the fp32 parameters for DiLoCo, half of them in 2 fragments (with an
    overlap as well: the arrival's branch holds the inner step too, so its scalars are counted twice)."""
    def all_reduce_bytes(extra: list[str]) -> tuple[int, int]:
        _, trainer = _trainer(["mesh.dp=2", *extra])
        stats = hlo.collective_stats(trainer.compile_step().as_text())
        model = sum(x.size * 4 for x in jax.tree.leaves(trainer.abstract_state().params))
        return stats["all-reduce"]["bytes"], model

    diloco, model = all_reduce_bytes(["train.local_steps=2"])
    halves, _ = all_reduce_bytes(["train.local_steps=2", "train.diloco_fragments=2"])
    overlap, _ = all_reduce_bytes(["train.local_steps=4", "train.diloco_fragments=2", "train.diloco_overlap=1"])
    scalars = diloco - model
    assert 0 < scalars < 64
    assert halves == model // 2 + scalars
    assert overlap == model // 2 + 2 * scalars


def test_a_fragment_is_the_model_s_every_p_th_layer_in_any_stored_order():
    """ZB-V stores layers [0, 3 | 1, 2] (pp 2, 2 chunks of one): fragment 0 is layers 0 and 2 wherever they are;
    round-robin [0, 2 | 1, 3] puts two of one fragment in a device's run of rows: refused (tests/test_errors.py)."""
    from pjax.parallel.pipeline.layout import layer_order

    assert streaming.layer_columns(8, 2) is None and streaming.layer_columns(8, 2, 2, 2) is None  # chunks of 2
    columns = streaming.layer_columns(4, 2, 2, 2, vshape=True)
    order = layer_order(4, 2, 2, vshape=True)
    stack = jnp.asarray(order, jnp.float32)  # stored row r holds model layer order[r]
    for f in range(2):
        got = streaming.fragment(stack, jnp.int32(f), 2, 0, columns)
        assert sorted(np.asarray(got).tolist()) == [f, f + 2]
        back = streaming.with_fragment(stack, got + 10, jnp.int32(f), 2, 0, columns)
        assert np.asarray(back).tolist() == [o + 10 if o % 2 == f else o for o in order]
    with pytest.raises(ValueError):
        streaming.layer_columns(4, 2, 2, 2)
