"""train.grad_compression in the step: the reduced gradient is the exact one within the payload's rounding, nothing
is lost (reduced sum + the replicas' residuals = the exact sum), error feedback keeps the accumulated update
bounded where plain rounding drifts, and a resume continues with the saved residual."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh.errors import ConfigError
from pjax.config_io import load_config
from pjax.train import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import random_batch, trainer_for  # noqa: E402
from run_helpers import preempted_after  # noqa: E402

SMALL = ["train.batch_size=8", "train.seq_len=32", "train.grad_accum=2", "train.dtype=float32"]
# (name, config, overrides): tp blocks, ZeRO-1's compressed reduce-scatter, cp as a data axis, MoE experts kept local.
LAYOUTS = {
    "dp2-tp2-bf16": ("debug", ["mesh.dp=2", "mesh.tp=2", "train.grad_compression=bf16"]),
    "dp2-cp2-zero1-int8": ("debug", ["mesh.dp=2", "mesh.cp=2", "train.zero=1", "train.grad_compression=int8"]),
    "mixtral-dp2-int8": ("mixtral-tiny", ["mesh.dp=2", "mesh.tp=1", "train.grad_compression=int8"]),
    "dp2-tp2-zero1-powersgd": ("debug", ["mesh.dp=2", "mesh.tp=2", "train.zero=1", "train.grad_compression=powersgd",
                                         "train.powersgd_rank=2"]),
    # Each (dp, cp) device compresses its partial sum: the other context strategies, and SP's blocks, alike.
    "dp2-cp2-tp2-ulysses-sp-powersgd": ("debug", ["mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "context.strategy=ulysses",
                                                  "train.sequence_parallel=true", "train.grad_compression=powersgd",
                                                  "train.powersgd_rank=2"]),
    # all-gather's layouts with fp8 GEMMs: each payload over fp8 gradients.
    "dp2-cp2-all_gather-fp8-bf16": ("debug", ["mesh.dp=2", "mesh.cp=2", "context.strategy=all_gather",
                                              "precision.fp8=true", "train.grad_compression=bf16"]),
    "dp2-cp2-all_gather-fp8-int8": ("debug", ["mesh.dp=2", "mesh.cp=2", "context.strategy=all_gather",
                                              "precision.fp8=true", "train.grad_compression=int8"]),
    "dp2-cp2-all_gather-fp8-powersgd": ("debug", ["mesh.dp=2", "mesh.cp=2", "context.strategy=all_gather",
                                                  "precision.fp8=true", "train.grad_compression=powersgd",
                                                  "train.powersgd_rank=2"]),
    "dp2-cp2-ulysses-bf16": ("debug", ["mesh.dp=2", "mesh.cp=2", "context.strategy=ulysses",
                                       "train.grad_compression=bf16"]),
    "dp2-cp2-ulysses-int8": ("debug", ["mesh.dp=2", "mesh.cp=2", "context.strategy=ulysses",
                                       "train.grad_compression=int8"]),
    "dp2-cp2-ring-powersgd": ("debug", ["mesh.dp=2", "mesh.cp=2", "context.strategy=ring",
                                        "train.grad_compression=powersgd", "train.powersgd_rank=2"]),
    # The experts' gradients in the other payloads.
    "mixtral-dp2-bf16": ("mixtral-tiny", ["mesh.dp=2", "mesh.tp=1", "train.grad_compression=bf16"]),
    "mixtral-dp2-powersgd": ("mixtral-tiny", ["mesh.dp=2", "mesh.tp=1", "train.grad_compression=powersgd",
                                              "train.powersgd_rank=2"]),
}
# ||compressed - exact|| / ||exact|| on the first step (measured 0.0023 bf16, 0.012-0.017 int8): bf16 rounds each
# value twice (2^-9 relative each); int8 to 1/254 of its block's largest value, coarse for a block's small values.
# PowerSGD is held to its float64 rank-r reference instead (`powersgd_reference`).
REL_ERROR = {"bf16": 0.005, "int8": 0.03}
# ||compressed - reference|| / ||reference||, PowerSGD against float64: measured 2.6e-7 to 3.5e-7 (float32 sums
# and QR). The rank-2 sum is 0.89-0.90 of the exact gradient's norm away from it, so no projection but the
# reference's own comes near this bound.
POWERSGD_RTOL = 1e-5


def powersgd_reference(trainer, exact, rank: int) -> list[np.ndarray]:
    """The exact gradient's rank-`rank` PowerSGD sum in float64, leaf by leaf: per tp block, P = orth(M Q0) from
    the run's first Q (`feedback.zero_state`'s), then P P^T M; vectors and experts exactly (they are not
    compressed). M is the mean rather than the sum over replicas: a projection scales with it."""
    from mesh.rules import logical_to_spec
    from models import llama
    from pjax.parallel import feedback, powersgd

    names = jax.tree.leaves(llama.param_logical_axes(trainer.cfg), is_leaf=lambda n: isinstance(n, tuple))
    tp = trainer.mesh.shape["tp"]
    out = []
    for i, (nm, e) in enumerate(zip(names, jax.tree.leaves(exact))):
        e = np.asarray(e, np.float64)
        if not feedback.has_q(nm):
            out.append(e)
            continue
        spec = logical_to_spec(nm)
        axis = list(spec).index("tp") if "tp" in spec else None
        blocks = np.split(e, tp, axis=axis) if axis is not None else [e]
        q0 = np.asarray(powersgd.initial_q(jax.random.fold_in(jax.random.key(0x5EED), i),
                                           powersgd.q_shape(blocks[0].shape, nm, rank)), np.float64)
        batch, first = powersgd.split(nm)
        projected = []
        for block in blocks:
            m = block.reshape(*block.shape[:batch], math.prod(block.shape[batch:first]), -1)
            p = np.linalg.qr(m @ q0)[0]
            projected.append((p @ (np.swapaxes(p, -1, -2) @ m)).reshape(block.shape))
        out.append(np.concatenate(projected, axis=axis) if axis is not None else projected[0])
    return out


def _trainer(config: str, overrides: list[str]):
    return trainer_for(config, [*SMALL, *overrides])


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    cfg, trainer = _trainer(*LAYOUTS[request.param])
    state = trainer.init(jax.random.key(0))
    batch = random_batch(trainer)

    @jax.jit
    def compressed(params, batch, residual):
        return trainer.strategy.compressed_loss_and_grads(params, batch, residual)

    def step(residual):
        with jax.set_mesh(trainer.mesh):
            return compressed(state.params, batch, residual)

    loss, grads, _, residual = step(state.residual)
    exact_loss, exact = trainer.grads(state.params, batch)
    count = float(np.sum(np.asarray(batch["labels"]) >= 0))
    return dict(cfg=cfg, trainer=trainer, state=state, step=step, loss=loss, grads=grads, residual=residual,
                exact_loss=exact_loss, exact=exact, count=count)


def _norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))


@pytest.mark.proves("ring+int8_reduce", "zero1+int8_reduce", "zero1+powersgd", "moe+int8_reduce", "ulysses+powersgd",
                    "sp+powersgd", "all_gather+bf16_reduce", "all_gather+int8_reduce", "all_gather+powersgd",
                    "ulysses+bf16_reduce", "ulysses+int8_reduce", "ring+powersgd", "moe+bf16_reduce", "moe+powersgd",
                    "bf16_reduce+fp8", "int8_reduce+fp8", "powersgd+fp8")
def test_the_reduced_gradient_is_the_exact_one_within_the_payloads_rounding(layout):
    assert float(layout["loss"]) == pytest.approx(float(layout["exact_loss"]), rel=1e-6)  # the loss is not compressed
    diff = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), layout["grads"], layout["exact"])
    rel = _norm(diff) / _norm(layout["exact"])
    payload = layout["cfg"].train.grad_compression
    assert rel > 0  # it did compress
    if payload != "powersgd":
        assert rel < REL_ERROR[payload]
        return
    reference = powersgd_reference(layout["trainer"], layout["exact"], layout["cfg"].train.powersgd_rank)
    off = _norm([np.asarray(g, np.float64) - r for g, r in zip(jax.tree.leaves(layout["grads"]), reference)])
    assert off / _norm(reference) < POWERSGD_RTOL, off / _norm(reference)


def test_nothing_is_lost_the_residuals_hold_what_the_payload_did_not_carry(layout):
    """sum over replicas of the new residual + the reduced sum = the exact sum (residuals started at zero)."""
    count = layout["count"]
    for path, g, r, e in zip(jax.tree_util.tree_leaves_with_path(layout["grads"]), jax.tree.leaves(layout["grads"]),
                             jax.tree.leaves(layout["residual"]["error"]), jax.tree.leaves(layout["exact"])):
        kept = np.asarray(r, np.float64).sum(axis=0) if r.shape[1:] == g.shape else 0.0  # an expert: none kept
        carried = np.asarray(g, np.float64) * count + kept
        exact = np.asarray(e, np.float64) * count
        scale = np.abs(exact).max() + 1e-12
        assert np.abs(carried - exact).max() / scale < 1e-5, jax.tree_util.keystr(path[0])
    if layout["cfg"].model.num_local_experts > 1:  # experts stay local: reduced exactly, no residual kept
        experts = [r for r in jax.tree.leaves(layout["residual"]["error"]) if r.shape[1:] == (1,)]
        assert len(experts) == 3


@pytest.mark.parametrize("layout", ["dp2-tp2-bf16", "dp2-cp2-zero1-int8"], indirect=True)
def test_error_feedback_keeps_the_accumulated_update_bounded_where_rounding_drifts(layout):
    """The same gradient reduced 8 times: with feedback the total is 8 x exact up to one step's residual; with
    the residual dropped every step, the same rounding error is added 8 times."""
    step, zero = layout["step"], layout["state"].residual
    total_fb, total_plain, residual = None, None, zero
    add = lambda a, b: b if a is None else jax.tree.map(jnp.add, a, b)  # noqa: E731
    for _ in range(8):
        _, grads, _, residual = step(residual)
        total_fb = add(total_fb, grads)
        total_plain = add(total_plain, step(zero)[1])
    target = jax.tree.map(lambda e: 8 * np.asarray(e, np.float64), layout["exact"])
    err = lambda total: _norm(jax.tree.map(lambda t, x: np.asarray(t, np.float64) - x, total, target))  # noqa: E731
    one_step = _norm(jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), layout["grads"], layout["exact"]))
    # The payload's few bits sum exactly in fp32 (measured 6e-10); feedback holds one step's error, measured
    # 0.96-1.01x of it, where a dropped residual gives the 8x of total_plain.
    assert err(total_plain) == pytest.approx(8 * one_step, rel=1e-6)
    assert err(total_fb) < 2 * one_step


def test_powersgd_starts_exact_and_a_resume_continues_with_the_saved_state_bit_for_bit(tmp_path, capfd):
    """PowerSGD with train.powersgd_start=1 on dp2, saving at step 2: step 1 is the uncompressed run's, bit for
    bit; a run resumed from step 2 (its residuals and Q saved after one compressed step) repeats steps 3-4 bit for
    bit; resumed by other data replicas (dp4) it restarts the feedback state at zero, with a warning."""
    def run(name: str, *extra: str) -> list[float]:
        overrides = [*SMALL, "mesh.dp=2", "mesh.tp=1", "train.steps=4", "log.every=1", "log.eval_every=0",
                     f"log.dir={tmp_path}/{name}", f"checkpoint.dir={tmp_path}/{name}/ckpt", *extra]
        cfg = load_config("debug", overrides)
        return [r["loss"] for r in train(cfg, progress=False, devices=jax.devices()[:cfg.mesh.dp])]

    exact = run("exact", "checkpoint.dir=null")
    compressed = ["train.grad_compression=powersgd", "train.powersgd_start=1", "checkpoint.every=2"]
    straight = run("a", *compressed)
    assert straight[:2] == exact[:2] and straight[2] != exact[2]  # step 2's loss precedes its compressed update

    preempted_after(tmp_path / "a", tmp_path / "b", 2)
    assert run("b", *compressed) == straight[2:]  # fp32 on CPU: exactly equal, the residuals and Q included
    assert "starts at zero" not in capfd.readouterr().err
    preempted_after(tmp_path / "a", tmp_path / "c", 2)
    assert len(run("c", *compressed, "mesh.dp=4")) == 2
    assert "the error-feedback residual starts at zero" in capfd.readouterr().err


def test_compression_is_refused_where_it_has_no_reduction_to_compress():
    with pytest.raises(ConfigError, match="ZeRO-3 has no once-per-step reduction to compress"):
        _trainer("debug", ["mesh.dp=2", "mesh.pp=2", "train.zero=3", "train.grad_compression=bf16"])


@pytest.mark.proves("1f1b+powersgd", "1f1b+int8_reduce", "interleaved+int8_reduce", "interleaved+powersgd",
                    "zb_v+bf16_reduce", "zb_v+int8_reduce", "zb_v+powersgd", "interleaved+bf16_reduce")
@pytest.mark.parametrize("schedule,mode", [("1f1b", "powersgd"), ("1f1b", "int8"), ("interleaved", "int8"),
                                           ("interleaved", "powersgd"), ("interleaved", "bf16"), ("zb_v", "bf16"),
                                           ("zb_v", "int8"), ("zb_v", "powersgd")])
def test_a_pipelined_step_compresses_its_once_per_step_reduction(schedule, mode):
    """dp2 x pp2 with each schedule and payload (PowerSGD's state, residuals and Q, has the most pipelined specs;
    interleaved and ZB-V hold two chunks per device): the reduced gradient is the exact one within the payload's
    rounding (PowerSGD's: a projection of it), and nothing is lost."""
    virtual = 2 if schedule in ("interleaved", "zb_v") else 1
    cfg, trainer = _trainer("debug", ["mesh.dp=2", "mesh.pp=2", "model.num_hidden_layers=4", f"train.grad_compression={mode}",
                                      f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={virtual}"])
    state, batch = trainer.init(jax.random.key(0)), random_batch(trainer)
    with jax.set_mesh(trainer.mesh):
        loss, grads, _, residual = jax.jit(trainer.strategy.compressed_loss_and_grads)(state.params, batch,
                                                                                      state.residual)
    exact_loss, exact = trainer.grads(state.params, batch)
    assert float(loss) == pytest.approx(float(exact_loss), rel=1e-6)
    diff = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), grads, exact)
    rel = _norm(diff) / _norm(exact)
    if mode == "powersgd":  # a band, not a float64 reference: the stage-stacked matrices' Q are drawn per stack
        assert 0.85 < rel < 0.97, rel  # measured 0.924-0.930 (unpipelined: 0.89-0.90); uncompressed it is 0
    else:
        assert 0 < rel < REL_ERROR[mode]
    # The stage scales each micro-batch's loss by 1 / the batch's tokens before the reduction: so do the residuals.
    for g, r, e in zip(jax.tree.leaves(grads), jax.tree.leaves(residual["error"]), jax.tree.leaves(exact)):
        carried = np.asarray(g, np.float64) + np.asarray(r, np.float64).sum(axis=0)
        assert np.abs(carried - np.asarray(e, np.float64)).max() / np.abs(e).max() < 1e-5


def test_the_planner_counts_each_modes_bytes():
    """The planner's dp link bytes per step: the gradient's share in the payload (int8: 1 byte + a scale per
    256), ZeRO-1's parameter gather in fp32 (the HLO's figures are in benchmarks/README.md)."""
    from pjax.plan.estimate import analytic_comm
    from pjax.plan.layouts import Layout

    def link(mode: str, zero: int) -> float:
        cfg = load_config("picotron-cpu", [f"train.grad_compression={mode}", "train.grad_accum=2"])
        return analytic_comm(cfg, Layout(dp=8, zero=zero, grad_accum=2), 4, 8)["dp"]["link_bytes"]

    assert link("bf16", 0) == pytest.approx(link("none", 0) / 2)
    assert link("int8", 0) == pytest.approx(link("none", 0) * (1 + 4 / 256) / 4)
    assert link("int8", 1) == pytest.approx(link("none", 1) / 2 * (1 + (1 + 4 / 256) / 4))


def test_powersgd_at_full_rank_is_the_exact_sum():
    """Rank >= every matrix's smaller side: P spans the sum's columns, so the product is the exact sum."""
    cfg, trainer = _trainer("debug", ["mesh.dp=2", "mesh.tp=1", "train.grad_compression=powersgd",
                                      "train.powersgd_rank=4096"])
    state, batch = trainer.init(jax.random.key(0)), random_batch(trainer)
    with jax.set_mesh(trainer.mesh):
        full = jax.jit(trainer.strategy.compressed_loss_and_grads)(state.params, batch, state.residual)[1]
    for g, e in zip(jax.tree.leaves(full), jax.tree.leaves(trainer.grads(state.params, batch)[1])):
        # fp32 QR and projections: measured 1.5e-5 of a leaf's largest, each entry within atol alone; rank 2
        # instead leaves 0.72 of the norm (test_diloco's figure).
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-4, atol=2e-5 * np.abs(e).max())


@pytest.mark.parametrize("layout", ["dp2-tp2-zero1-powersgd"], indirect=True)
def test_powersgd_below_full_rank_sums_low_rank_matrices_and_vectors_exactly(layout):
    """At rank 2 each layer's reduced matrix (per tp block: wq's heads are split over tp) has rank 2 at most; the
    norm scales are summed exactly."""
    wq = np.asarray(layout["grads"]["layers"]["wq"])  # [layers, embed, heads, head_dim], heads over tp=2
    for block in np.split(wq, 2, axis=2):
        for layer in block.reshape(block.shape[0], block.shape[1], -1):
            s = np.linalg.svd(layer, compute_uv=False)
            assert s[2] < 1e-6 * s[0]  # fp32's noise: measured 1.6e-8 (the second is 0.74-0.90 of the first)
    np.testing.assert_allclose(np.asarray(layout["grads"]["layers"]["attn_norm"]),
                               np.asarray(layout["exact"]["layers"]["attn_norm"]), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("layout", ["dp2-tp2-zero1-powersgd"], indirect=True)
def test_powersgds_error_feedback_makes_the_average_update_approach_the_exact_one(layout):
    """The same gradient reduced 16 times at rank 2: with the residuals fed back, the mean reduced gradient moves
    towards the exact one (what a rank-2 image misses is sent later); with them dropped (Q still warm-started)
    it stalls at the rank-2 image's error (measured 0.48 against 0.79 of the exact gradient's norm)."""
    step, start = layout["step"], layout["state"].residual
    exact = jax.tree.map(lambda e: np.asarray(e, np.float64), layout["exact"])

    def mean_error(feedback: bool) -> list[float]:
        state, total, errors = start, None, []
        for k in range(1, 17):
            _, grads, _, state = step(state if feedback else {"error": start["error"], "q": state["q"]})
            total = grads if total is None else jax.tree.map(jnp.add, total, grads)
            if k in (4, 16):
                errors.append(_norm(jax.tree.map(lambda t, e: np.asarray(t, np.float64) / k - e, total, exact))
                              / _norm(exact))
        return errors

    (fb4, fb16), (plain4, plain16) = mean_error(True), mean_error(False)
    assert fb16 < fb4 < plain4 and fb16 < 0.7 * plain16
