"""fp8 matmuls (models/fp8.py): scales that follow the current amax, e4m3 operands and e5m2 cotangents,
no NaN on a huge activation, and the fp8 step on sharded layouts (pp x cp x tp with sequence parallelism, ZeRO,
experts over ep) equal to one device's."""
import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
import numpy as np
import optax
import pytest

import proofs
from mesh import MeshConfig, make_mesh
from mesh.errors import ConfigError
from models import fp8
from models import llama
from models.config import LlamaConfig
from models.precision import PrecisionConfig
from models.projection import PLAIN, plain_projection
from pjax.config import PipelineConfig, TrainConfig
from pjax.config_io import load_config
from pjax.parallel.context.zigzag import zigzag_layout
from pjax.parallel.pipeline.layout import to_pipeline_layout
from pjax.spec import StepSpec, accumulate
from pjax.step import add_positions, build_trainer

CFG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)
TC = TrainConfig(seq_len=16, batch_size=8, grad_accum=2, steps=10, warmup_steps=2)
FP8 = PrecisionConfig(preset="fp8")
GRAD_NORM_RTOL = 1e-4  # test_fp8_scales_are_per_tensor_on_every_layout says why


def test_the_scale_is_the_least_power_of_two_that_fits_the_current_amax():
    x = jnp.array([[0.5, -3.0], [1.25, 2.0]], jnp.float32)
    q, scale = fp8.quantize(x, fp8.E4M3)
    assert q.dtype == fp8.E4M3 and float(scale) == 2.0 ** -7  # 3 / 448 = 2^-7.2, rounded up to a power of two
    # The largest magnitude lands in e4m3's top binade: 3 / 2^-7 = 384, exact, and dequantizing gives x back.
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 384
    np.testing.assert_array_equal(fp8.dequantize(q, scale, jnp.float32), x)
    _, s5 = fp8.quantize(x, fp8.E5M2)
    assert float(s5) == 2.0 ** -14  # 3 / 57344 = 2^-14.2
    assert float(fp8.scale_of(jnp.zeros(3), fp8.E4M3)) == 1.0
    for amax in (448.0, 449.0, 2.0 ** -100):  # a power of two exactly at the maximum, just past it, tiny
        scale = float(fp8.scale_of(jnp.zeros(1), fp8.E4M3, jnp.float32(amax)))
        assert math.log2(scale).is_integer() and 224 < amax / scale <= 448, (amax, scale)


def test_round_trip_error_is_e4m3s_and_e5m2s():
    x = jax.random.normal(jax.random.key(0), (4096,))
    for fmt, bits in ((fp8.E4M3, 3), (fp8.E5M2, 2)):
        y = fp8.round_trip(x, fmt)
        normal = jnp.abs(x) > jnp.max(jnp.abs(x)) * 2.0 ** -6  # away from the subnormals
        rel = jnp.max(jnp.where(normal, jnp.abs(y - x) / jnp.abs(x), 0))
        assert 2.0 ** -(bits + 3) < rel <= 2.0 ** -(bits + 1), (fmt, rel)  # rounding to `bits` mantissa bits


def test_each_of_a_projections_three_gemms_reads_fp8_operands():
    """Y = X W in e4m3 x e4m3; dX = dY W^T and dW = X^T dY with dY in e5m2 and X, W as the forward stored them;
    the hand-written backwards' products are the same GEMMs."""
    ks = jax.random.split(jax.random.key(1), 3)
    x, w, g = jax.random.normal(ks[0], (16, 8)), jax.random.normal(ks[1], (8, 24)), jax.random.normal(ks[2], (16, 24))
    xr, wr, gr = fp8.round_trip(x, fp8.E4M3), fp8.round_trip(w, fp8.E4M3), fp8.round_trip(g, fp8.E5M2)
    y, pullback = jax.vjp(fp8.matmul, x, w)
    dx, dw = pullback(g)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
    close(y, xr @ wr), close(dx, gr @ wr.T), close(dw, xr.T @ gr)
    close(fp8.multiply(*fp8.prepare(x, w), x.dtype), y), close(fp8.input_grad(g, w), dx), close(fp8.weight_grad(x.T, g), dw)
    assert fp8.gemm(True) is fp8.GEMM and fp8.gemm(False) is PLAIN
    text = jax.jit(lambda x, w, g: jax.vjp(fp8.matmul, x, w)[1](g)).lower(x, w, g).as_text()
    assert text.count("f8E5M2") and "dot_general" in text and "f8E4M3FN" in text


def test_a_huge_activation_stays_finite():
    """1e6 overflows e4m3 (its max is 448, and e4m3fn has no infinity: the cast gives NaN); scaled, it does not."""
    x = 1e6 * jax.random.normal(jax.random.key(3), (32, 16))
    w = jax.random.normal(jax.random.key(4), (16, 8))
    assert bool(jnp.isnan(x.astype(fp8.E4M3).astype(jnp.float32)).any())
    out, grads = jax.value_and_grad(lambda a, b: jnp.sum(fp8.matmul(a, b) ** 2), argnums=(0, 1))(x, w)
    assert bool(jnp.isfinite(out)) and all(bool(jnp.isfinite(g).all()) for g in grads)
    # e4m3 keeps 3 mantissa bits: measured 4.5% of max|x w| at 1e6, as at unit scale (4.4%); unscaled it is NaN
    np.testing.assert_allclose(fp8.matmul(x, w), x @ w, rtol=0.1, atol=0.1 * float(jnp.max(jnp.abs(x @ w))))


@pytest.mark.parametrize("routing", ["dropless", "capacity", "dense"])
def test_each_expert_gemm_reads_fp8(routing):
    """Three GEMMs per expert MLP (gate, up, down): each output's cotangent rounds through e5m2 once."""
    from models.moe import Gemms, MoeConfig, moe_mlp

    ks = jax.random.split(jax.random.key(5), 5)
    p = {"router": jax.random.normal(ks[0], (16, 4)), "w_gate": jax.random.normal(ks[1], (4, 16, 24)),
         "w_up": jax.random.normal(ks[2], (4, 16, 24)), "w_down": jax.random.normal(ks[3], (4, 24, 16))}
    x = jax.random.normal(ks[4], (32, 16))

    def e5m2_casts(gemms):
        loss = lambda x, p: jnp.sum(moe_mlp(x, p, top_k=2, config=MoeConfig(routing), gemms=gemms)[0] ** 2)
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, p).as_text()
        return text.count("f8E5M2")

    assert e5m2_casts(Gemms()) == 0
    assert e5m2_casts(Gemms(fp8.einsum, fp8.ragged_dot)) >= 3


def test_fp8_experts_over_ep_equal_one_devices():
    """Experts split over ep (capacity routing, all_to_all) with fp8 GEMMs: one device's layer. Each device's
    experts and tokens take their own amax; here their power-of-two scales equal the whole tensor's (measured:
    no difference at all), and a scale one power of two off moves entries by e4m3 steps (up to 2^-4 of them)."""
    from models.moe import Gemms, MoeConfig, moe_mlp

    ks = jax.random.split(jax.random.key(6), 5)
    p = {"router": jax.random.normal(ks[0], (16, 4)), "w_gate": jax.random.normal(ks[1], (4, 16, 24)),
         "w_up": jax.random.normal(ks[2], (4, 16, 24)), "w_down": jax.random.normal(ks[3], (4, 24, 16))}
    x = jax.random.normal(ks[4], (32, 16))
    gemms = Gemms(fp8.einsum, fp8.ragged_dot)
    layer = jax.jit(lambda x, p: moe_mlp(x, p, top_k=2, config=MoeConfig("capacity", 4.0), gemms=gemms)[0])
    one = layer(x, p)
    with jax.set_mesh(make_mesh(MeshConfig(dp=2, ep=2), jax.devices()[:2])):
        split = layer(x, p)
        assert "all_to_all" in layer.lower(x, p).as_text()  # the experts did go over ep
    scale = float(jnp.max(jnp.abs(one)))
    assert float(jnp.max(jnp.abs(split - one))) <= 1e-6 * scale  # float32's summation order only
    plain = jax.jit(lambda x, p: moe_mlp(x, p, top_k=2, config=MoeConfig("capacity", 4.0))[0])(x, p)
    assert float(jnp.max(jnp.abs(one - plain))) > 1e-2 * scale  # fp8 did round (measured 4.8% of the largest)


def make_batch(grad_accum: int = TC.grad_accum, seed: int = 0):
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (TC.batch_size, TC.seq_len + 1)).astype(np.int32)
    tokens = tokens.reshape(grad_accum, TC.batch_size // grad_accum, -1)
    return add_positions({"inputs": jnp.asarray(tokens[..., :-1]), "labels": jnp.asarray(tokens[..., 1:])})


@functools.cache
def initial_params(experts: int = 0):
    """One device's initial parameters, on the host: every layout starts from them."""
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    cfg = dataclasses.replace(CFG, num_local_experts=experts) if experts else CFG
    return jax.tree.map(np.asarray, build_trainer(mesh, cfg, TC, precision=FP8).init(jax.random.key(0)).params)


@proofs.cache
def loss_and_grad_norm(dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, zero: int = 0, sp: bool = False,
                       precision: PrecisionConfig = FP8, experts: int = 0,
                       schedule: str = "1f1b", grad_accum: int = TC.grad_accum
                       ) -> tuple[float, float, str, tuple[int, ...]]:
    """Loss and gradient norm of the batch (in `grad_accum` micro-batches) on a layout (a pipeline's `schedule`
    where pp > 1), its loss-and-gradients program as lowered, and the loops around each weight's cast to e4m3."""
    mesh = make_mesh(MeshConfig(dp=dp, pp=pp, cp=cp, tp=tp), jax.devices()[:dp * pp * cp * tp])
    tc = TrainConfig(**{**TC.__dict__, "zero": zero, "sequence_parallel": sp, "grad_accum": grad_accum})
    cfg = dataclasses.replace(CFG, num_local_experts=experts) if experts else CFG
    trainer = build_trainer(mesh, cfg, tc, PipelineConfig(schedule) if pp > 1 else None, precision=precision)
    params = initial_params(experts)
    if trainer.pipeline is not None:
        params = to_pipeline_layout(params, pp, trainer.pipeline.virtual_stages, trainer.pipeline.vshape)
    params = jax.device_put(params, trainer.state_sharding.params)
    batch = make_batch(grad_accum)
    if cp > 1:  # columns (and their positions) in the zigzag order ring attention expects
        cols = np.asarray(zigzag_layout(cp)(np.arange(TC.seq_len)))
        batch = jax.tree.map(lambda a: a[..., cols], batch)
    batch = jax.device_put(batch, trainer.batch_sharding)
    with jax.set_mesh(mesh):
        traced = trainer.grads.jitted.trace(params, batch)
        lowered = traced.lower()
        loss, grads = lowered.compile()(params, batch)
    norm = float(optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads)))
    return float(loss), norm, lowered.as_text(), tuple(_weight_casts_by_loop_depth(traced.jaxpr.jaxpr))


@pytest.mark.proves("1f1b+fp8", "ring+fp8", "sp+fp8")
def test_fp8_step_on_a_sharded_layout_equals_one_devices():
    """pp x cp x tp with sequence parallelism, fp8 GEMMs on float32: a pipeline stage's GEMMs, one scale over cp's
    token blocks (ring attention's zigzag columns) and over tp's under SP, so the loss equals one device's (measured
    8e-8 apart; the gradient norm 7e-8, GRAD_NORM_RTOL says why it gets more). Fed its columns in plain order,
    ring attention masks the wrong keys: 2e-3 off on the loss and 1.8e-2 on the gradient norm."""
    fp8_only = PrecisionConfig(fp8=True)
    ref_loss, ref_norm, _, _ = loss_and_grad_norm(precision=fp8_only)
    loss, norm, text, casts = loss_and_grad_norm(precision=fp8_only, pp=2, cp=2, tp=2, sp=True)
    assert "f8E4M3FN" in text and "f8E5M2" in text  # the sharded program does round through fp8
    assert casts == (0,) * 4, casts  # the pipeline's weights quantized once per step, outside its loops
    assert loss == pytest.approx(ref_loss, rel=1e-6) and norm == pytest.approx(ref_norm, rel=GRAD_NORM_RTOL), \
        (loss, norm)


@pytest.mark.proves("zero1+fp8", "zero3+fp8", "zb_h1+fp8", "moe+fp8")
@pytest.mark.parametrize("layout", [dict(dp=2, tp=2, sp=True, zero=1), dict(dp=2, pp=2, zero=3, schedule="zb_h1"),
                                    dict(dp=2, tp=2, experts=4)], ids=str)
def test_fp8_scales_are_per_tensor_on_every_layout(layout):
    """fp8 GEMMs on float32 (no bf16 rounding elsewhere): one scale per data replica's block of a tensor and one
    merged GEMM for weights that share an input, on every layout (ZeRO-3 in a zero-bubble pipeline, whose weight
    gradients run apart from the input gradients) and with experts over ep, so the loss equals one device's running
    each replica's rows as a micro-batch of its own (dp times the micro-batches; with experts over ep = dp, the
    group's rows as one, as its capacity routing takes them); XLA:CPU keeps every fp8 rounding
    (`xla_options.FP8_CPU_OPTIONS`). On this batch one device's 2 and 4 micro-batches give the same power-of-two
    scales (the same loss and gradient norm, bit for bit), so a scale's extent is proven by the amax test below,
    and this one proves the rest of the layout. The gradient norm gets GRAD_NORM_RTOL: a layout sums in another
    order (tp's heads, dp's rows), and a last-bit difference in a cotangent now and then moves its e5m2 rounding
    (2 mantissa bits), which later roundings amplify (measured 4.7e-6 dense, 4.5e-5 with experts on dp2 x tp2, 0
    on another CPU: it depends on the CPU's vector code)."""
    fp8_only = PrecisionConfig(fp8=True)
    experts = layout.get("experts", 0)  # over ep = dp = 2: an expert group's GEMMs and capacity take both rows
    ref_loss, ref_norm, _, _ = loss_and_grad_norm(precision=fp8_only, experts=experts,
                                                  grad_accum=TC.grad_accum * (1 if experts else layout["dp"]))
    loss, norm, text, casts = loss_and_grad_norm(precision=fp8_only, **layout)
    assert "f8E4M3FN" in text and "f8E5M2" in text
    assert casts == (0,) * (5 if experts else 4), casts  # once per step: q/k/v, o and the MLP's (each expert's)
    assert loss == pytest.approx(ref_loss, rel=1e-6) and norm == pytest.approx(ref_norm, rel=GRAD_NORM_RTOL), \
        (loss, norm)


def test_the_amax_spans_one_sequences_devices_and_not_the_batch_axes():
    """Tokens split over cp: one amax over a sequence's blocks; rows split over dp: each replica its own (a
    micro-batch of its own, so no exchange over dp)."""
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh(MeshConfig(dp=2, cp=2), jax.devices()[:4])
    x = jnp.arange(1.0, 9.0).reshape(2, 4)  # (dp, cp) block (r, c) holds x[r, 2c:2c+2]: amaxes 2, 4, 6, 8

    def body(block):
        return fp8.whole_amax(block).reshape(1, 1)

    jitted = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp", "cp"), out_specs=P("dp", "cp")))
    assert np.asarray(jitted(x)).tolist() == [[4.0, 4.0], [8.0, 8.0]]
    groups = re.findall(r"all_reduce.*?replica_groups = dense<(\[\[.*?\]\])>", jitted.lower(x).as_text(), re.S)
    assert groups == ["[[0, 1], [2, 3]]"], groups  # cp's pairs only


def test_a_dense_weights_amax_is_exchanged_over_its_tp_blocks_only():
    """A GEMM reads a dense weight whole but for tp's blocks, so `quantize_weight` takes its amax over tp and
    sends nothing over dp, where its blocks are copies (cast to varying there, as the data shard_map and DiLoCo's
    groups do)."""
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh(MeshConfig(dp=2, tp=2), jax.devices()[:4])
    w = jnp.arange(1.0, 9.0).reshape(2, 4)  # tp's blocks: columns [0, 2) (amax 6) and [2, 4) (amax 8)

    def body(block):
        copy = jax.lax.pcast(block, ("dp",), to="varying")  # as `mesh.rules.vary` casts the data region's weights
        return fp8.quantize_weight(copy)[1].reshape(1, 1)

    jitted = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "tp"), out_specs=P("dp", "tp")))
    # amax 8 over both blocks: 8 / 448 = 2^-5.8, so 2^-5 (the first block's own 6 would give 2^-6)
    np.testing.assert_array_equal(np.asarray(jitted(w)), [[2.0 ** -5] * 2] * 2)
    text = jitted.lower(w).as_text()
    groups = re.findall(r"all_reduce.*?replica_groups = dense<(\[\[.*?\]\])>", text, re.S)
    assert groups == ["[[0, 1], [2, 3]]"], groups  # the tp pairs of a dp2 x tp2 mesh, once


def test_weights_that_share_an_input_take_one_scale():
    """q, k and v (gate and up) as one fp8 tensor: their products equal one GEMM of the merged weights'."""
    ks = jax.random.split(jax.random.key(2), 3)
    # wb 2^10 times wa: under one scale wa's values fall among e4m3's subnormals (a power-of-two scale only
    # shifts exponents, so a closer pair would quantize alike under either scale).
    x, wa = jax.random.normal(ks[0], (8, 16)), jax.random.normal(ks[1], (16, 4))
    wb = 1024 * jax.random.normal(ks[2], (16, 6))
    ya, yb = plain_projection(x, [wa, wb], fp8.GEMM)
    merged = fp8.matmul(x, jnp.concatenate([wa, wb], axis=1))
    np.testing.assert_array_equal(jnp.concatenate([ya, yb], axis=1), merged)
    assert not np.allclose(ya, fp8.matmul(x, wa), rtol=1e-6)  # wa alone takes a finer scale


def _weight_casts_by_loop_depth(jaxpr) -> list[int]:
    """Per cast of a weight to e4m3 (`fp8.WEIGHT_SCOPE`) in `jaxpr`, how many loops (scans, whiles) enclose it."""
    found = []
    for eqn in jaxpr.eqns:
        if (eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == fp8.E4M3
                and fp8.WEIGHT_SCOPE in str(eqn.source_info.name_stack)):
            found.append(0)
        loop = eqn.primitive.name in ("scan", "while")
        for sub in jax_core.jaxprs_in_params(eqn.params):
            found += [d + loop for d in _weight_casts_by_loop_depth(sub)]
    return found


@pytest.mark.parametrize("shared_expert", [False, True], ids=["dense", "shared_expert"])
def test_a_step_quantizes_each_weight_once_and_its_numbers_do_not_change(shared_expert, monkeypatch):
    """A step's GEMM weights are cast to e4m3 before the micro-batch loop, one cast per merged GEMM (q, k, v; o;
    gate, up; down; a shared expert's) and per expert weight, none inside a loop; the loss and every gradient equal,
    bit for bit, those of the step whose GEMMs quantize their weights themselves in every micro-batch and layer."""
    cfg = dataclasses.replace(CFG, num_local_experts=4, shared_expert_intermediate_size=32) if shared_expert else CFG
    spec = StepSpec.build(cfg, TC, precision=PrecisionConfig(preset="fp8").resolve())
    params = llama.init_params(cfg, jax.random.key(0))
    step = jax.jit(lambda p, b: accumulate(p, b, spec))
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    with jax.set_mesh(mesh):
        depths = _weight_casts_by_loop_depth(jax.make_jaxpr(step)(params, make_batch(2)).jaxpr)
        once = step(params, make_batch(2))
        monkeypatch.setattr(StepSpec, "quantize_weights", lambda self, layers: None)
        step = jax.jit(lambda p, b: accumulate(p, b, spec))
        per_gemm = step(params, make_batch(2))
        per_gemm_depths = _weight_casts_by_loop_depth(jax.make_jaxpr(step)(params, make_batch(2)).jaxpr)
    assert depths == [0] * (7 if shared_expert else 4), depths  # qkv, o, the MLP's two (+ the experts' three)
    assert per_gemm_depths and set(per_gemm_depths) == {2}, per_gemm_depths  # micro-batch loop x layer loop
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(per_gemm)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_fp8_on_a_gpu_without_fp8_gemms_is_one_line(monkeypatch):
    class A100:
        platform, device_kind, compute_capability = "gpu", "NVIDIA A100-SXM4-80GB", "8.0"

    monkeypatch.setattr(jax, "devices", lambda *a: [A100()])
    with pytest.raises(ConfigError, match="compute capability 8.9 or newer.*has 8.0; use precision.preset=bf16"):
        fp8.check()
    with pytest.raises(ConfigError, match="precision.fp8"):
        load_config("debug", ["precision.fp8=maybe"])
