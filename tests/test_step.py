"""The sharded train step equals the 1-device step: DP, TP, ZeRO-1, ZeRO-3, accumulation, remat.

Losses and gradients are compared (not parameters after an AdamW step: near-zero gradients
flip sign across layouts and Adam amplifies that to ~lr). Compiled trainers are cached per
layout so each layout compiles once for the whole module; every layout starts from one
device's initial parameters, placed on its mesh (sharded init is checked equal to them once,
in `test_parameters_are_sharded_as_the_rules_say`).
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import proofs
from mesh import ConfigError, MeshConfig, make_mesh
from models.config import LlamaConfig
from pjax.config import TrainConfig
from pjax.observe.hlo import collective_stats
from pjax.step import add_positions, build_trainer

CFG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, initializer_range=0.05)
TC = TrainConfig(seq_len=16, batch_size=16, grad_accum=2, dtype="float32", steps=10, warmup_steps=2)


@proofs.cache
def trainer(dp: int, tp: int = 1, zero: int = 0, grad_accum: int = 2, batch_size: int = 16, remat: str = "none",
            loss_chunk: int = 0, cfg: LlamaConfig = CFG, dtype: str = "float32", attention: str = "auto"):
    mesh = make_mesh(MeshConfig(dp=dp, tp=tp), jax.devices()[: dp * tp])
    tc = dataclasses.replace(TC, zero=zero, grad_accum=grad_accum, batch_size=batch_size, remat=remat,
                             loss_chunk=loss_chunk, dtype=dtype, attention=attention)
    return build_trainer(mesh, cfg, tc)


@proofs.cache
def compiled_step(dp: int, tp: int = 1, zero: int = 0):
    """The train step of a layout, compiled once from shapes."""
    return trainer(dp, tp, zero).compile_step()


def make_batch(grad_accum: int, batch_size: int, seed: int = 0):
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (batch_size, TC.seq_len + 1)).astype(np.int32)
    tokens = tokens.reshape(grad_accum, batch_size // grad_accum, -1)
    return add_positions({"inputs": jnp.asarray(tokens[..., :-1]), "labels": jnp.asarray(tokens[..., 1:])})


@functools.cache
def initial_state():
    """One device's initial state (parameters and Adam moments), on the host: every layout's starting point."""
    return jax.tree.map(np.asarray, trainer(1).init(jax.random.key(0)))


def initial_params():
    return initial_state().params


@proofs.cache
def compiled_grads(dp: int, tp: int = 1, zero: int = 0, grad_accum: int = 2, batch_size: int = 16, remat: str = "none",
                   loss_chunk: int = 0, dtype: str = "float32", attention: str = "auto"):
    """The trainer of a layout and its loss-and-gradients program, compiled once from shapes."""
    tr = trainer(dp, tp, zero, grad_accum, batch_size, remat, loss_chunk, dtype=dtype, attention=attention)
    with jax.set_mesh(tr.mesh):
        return tr, tr.grads.jitted.lower(tr.abstract_state().params, tr.abstract_batch()).compile()


@proofs.cache
def loss_and_grads(dp: int, tp: int = 1, zero: int = 0, grad_accum: int = 2, batch_size: int = 16, remat: str = "none",
                   loss_chunk: int = 0, dtype: str = "float32", attention: str = "auto"):
    tr, program = compiled_grads(dp, tp, zero, grad_accum, batch_size, remat, loss_chunk, dtype, attention)
    params = jax.device_put(initial_params(), tr.state_sharding.params)
    with jax.set_mesh(tr.mesh):
        loss, grads = program(params, jax.device_put(make_batch(grad_accum, batch_size), tr.batch_sharding))
    return float(loss), jax.tree.map(np.asarray, grads)


def assert_grads_close(grads, ref, rtol=1e-5):
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        r = ref
        for key in path:
            r = r[key.key]
        scale = np.max(np.abs(r))
        assert scale > 0, f"reference gradient of {jax.tree_util.keystr(path)} is all zero"
        err = np.max(np.abs(g - r)) / scale
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e} > {rtol}"


# Each with dp (the batch split, its once-per-step reduction) and tp: dp2_tp4 covers dp alone, and
# dp4_tp2_zero3 ZeRO-3 alone.
LAYOUTS = {
    "dp2_tp4": dict(dp=2, tp=4),
    "dp2_tp2_zero1": dict(dp=2, tp=2, zero=1),
    "dp4_tp2_zero3": dict(dp=4, tp=2, zero=3),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_loss_and_grads_equal_one_device(layout):
    ref_loss, ref_grads = loss_and_grads(dp=1)
    loss, grads = loss_and_grads(**LAYOUTS[layout])
    assert abs(loss - ref_loss) <= 1e-6
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("layout", [dict(dp=2, tp=2, loss_chunk=16), dict(dp=4, tp=2, zero=3, loss_chunk=16)],
                         ids=["dp2_tp2_chunk16", "dp4_tp2_zero3_chunk16"])
def test_fused_chunked_loss_equals_the_whole_micro_batch(layout):
    """train.loss_chunk: the output layer + loss in blocks of tokens with gradients formed in the
    forward (128 tokens per micro-batch, 64 per device under dp2: 4 blocks each; under ZeRO-3 the
    tokens stay split over dp automatically, 32 per device: 2 blocks of 16 from every device)."""
    ref_loss, ref_grads = loss_and_grads(dp=1)
    loss, grads = loss_and_grads(**layout)
    assert abs(loss - ref_loss) <= 1e-6
    assert_grads_close(grads, ref_grads)


def test_fused_chunked_loss_never_holds_the_whole_logits_and_reduces_the_head_gradient_once():
    """ZeRO-3 (dp automatic): 64 rows x 16 tokens over dp=2 are 512 per device, whose logits are
    512 x 4096 x 4 B = 8 MiB; blocks of 64 hold 1 MiB (most of the whole-logits buffer saved), and the
    output layer's gradient is still all-reduced over dp once, not once per block."""
    big_vocab = dataclasses.replace(CFG, vocab_size=4096)
    compiled = [trainer(2, zero=3, grad_accum=1, batch_size=64, loss_chunk=chunk, cfg=big_vocab).compile_step()
                for chunk in (0, 64)]
    temp = [c.memory_analysis().temp_size_in_bytes for c in compiled]
    assert temp[1] < temp[0] - 0.75 * 8 * 2**20, temp  # measured 12.9 MiB saved: the logits and their gradient
    head = lambda kind, line: kind if kind == "all-reduce" and "f32[64,4096]" in line else None
    runs = [collective_stats(c.as_text(), head).get("all-reduce", {}).get("count") for c in compiled]  # loops' trips counted
    assert runs == [1, 1], runs


def test_loss_chunk_that_does_not_divide_the_tokens_is_a_config_error():
    tr = trainer(1, loss_chunk=48)  # 128 tokens per micro-batch
    with pytest.raises(ConfigError, match=re.escape("train.loss_chunk=48 does not divide the 128 tokens")):
        tr.compile_step()


def _dots(jaxpr):
    """Every dot_general in a jaxpr, nested jaxprs (custom_vjp, pjit, scan) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if isinstance(inner, jax.extend.core.Jaxpr):
                yield from _dots(inner)


def test_bf16_output_layer_backward_multiplies_in_bf16():
    """With bf16 compute the output layer's backward matmuls take bf16 d(logits), not the fp32
    cotangent of the fp32 logits (which runs fp32 GEMMs on GPUs), and match fp32 autodiff."""
    from pjax.parallel.tensor_parallel import vocab_parallel_cross_entropy

    ks = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(ks[0], (32, 16)).astype(jnp.bfloat16)
    w = (0.3 * jax.random.normal(ks[1], (16, 64))).astype(jnp.bfloat16)
    y = jax.random.randint(ks[2], (32,), 0, 64)
    grad = jax.grad(lambda h, w: vocab_parallel_cross_entropy(h, w, y)[0], argnums=(0, 1))
    dots = list(_dots(jax.make_jaxpr(grad)(h, w).jaxpr))
    assert len(dots) == 3, dots  # logits forward, d(hidden), d(kernel)
    assert all(v.aval.dtype == jnp.bfloat16 for eqn in dots for v in eqn.invars), dots
    ref = jax.grad(lambda h, w: vocab_parallel_cross_entropy(h, w, y)[0], argnums=(0, 1))(
        h.astype(jnp.float32), w.astype(jnp.float32))
    for g, r in zip(grad(h, w), ref):
        assert g.dtype == jnp.bfloat16
        # bf16 operands and outputs round by 2^-9 each (measured 3.2e-3 of the largest)
        np.testing.assert_allclose(g.astype(jnp.float32), r, atol=2e-2 * float(jnp.max(jnp.abs(r))))


def test_output_layer_custom_backward_equals_autodiff_in_fp32():
    """On CPU the fp32 output layer also runs its own backward (kernel gradient from hidden^T)."""
    from pjax.parallel.tensor_parallel import output_logits

    ks = jax.random.split(jax.random.key(2), 3)
    h, w, c = jax.random.normal(ks[0], (32, 16)), jax.random.normal(ks[1], (16, 64)), jax.random.normal(ks[2], (32, 64))
    ours = jax.grad(lambda h, w: jnp.sum(output_logits(h, w) * c), argnums=(0, 1))(h, w)
    ref = jax.grad(lambda h, w: jnp.sum((h @ w) * c), argnums=(0, 1))(h, w)
    for g, r in zip(ours, ref):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_bf16_sharded_step_tracks_the_fp32_one():
    """bf16 compute on dp2 x tp2 (the GPU default dtype) stays within bf16 rounding of fp32 on one device."""
    ref_loss, ref_grads = loss_and_grads(dp=1)
    loss, grads = loss_and_grads(dp=2, tp=2, dtype="bfloat16")
    # bf16's rounding: measured 7.2e-5 (loss) and 1.1e-2 (grads); a dropped micro-batch gives 3.9e-3 and 0.5-1.0
    assert abs(loss - ref_loss) <= 1e-3 * abs(ref_loss)
    assert_grads_close(grads, ref_grads, rtol=5e-2)


def test_parameters_are_sharded_as_the_rules_say():
    state = trainer(dp=4, tp=2, zero=3).init(jax.random.key(0))
    # The same key gives the same weights on any mesh (the other tests start every layout from these).
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), initial_params())
    wq = state.params["layers"]["wq"]  # [layers, embed, heads, head_dim]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, ("dp", "ep"), "tp", None)
    mu = state.opt_state[1][0].mu["layers"]["wq"]
    assert mu.sharding.spec == wq.sharding.spec
    z1 = trainer(dp=2, tp=2, zero=1).state_sharding  # what its init and step produce (their out_shardings)
    assert z1.params["layers"]["w_down"].spec == jax.sharding.PartitionSpec(None, "tp", None)
    assert z1.opt_state[1][0].nu["layers"]["w_down"].spec == jax.sharding.PartitionSpec(None, "tp", ("dp", "ep"))
    # The shard a device holds is really 1/(dp*tp) of the tensor under ZeRO-3.
    assert wq.addressable_shards[0].data.size * 8 == wq.size


def test_gradient_accumulation_equals_one_big_batch():
    # Same 16 sequences: 2 micro-batches of 8 on one device vs one batch of 16 (on dp=2 x tp=2,
    # which the layouts above show changes nothing).
    loss_k, grads_k = loss_and_grads(dp=1, grad_accum=2)
    loss_1, grads_1 = loss_and_grads(dp=2, tp=2, grad_accum=1)
    assert abs(loss_k - loss_1) <= 1e-6
    assert_grads_close(grads_k, grads_1)


@pytest.mark.parametrize("remat", ["full", "names", "dots", "offload"])
def test_remat_policies_do_not_change_the_math(remat):
    """Under the layer scan on dp=2 x tp=2, against no remat there (which equals one device: the test
    above); train.remat=names with its default names, the q/k/v and o projections. (dots_no_batch
    takes the path full and dots take, plain projections under jax.checkpoint, with another of JAX's
    own policies.)"""
    ref_loss, ref_grads = loss_and_grads(dp=2, tp=2, grad_accum=1)
    loss, grads = loss_and_grads(dp=2, tp=2, grad_accum=1, remat=remat)
    assert abs(loss - ref_loss) <= 1e-6
    assert_grads_close(grads, ref_grads)


def test_remat_names_temporaries_lie_between_full_and_dots():
    """Under the layer scan on dp=2 x tp=2 the default names keep q/k/v and o per layer: 128 tokens x
    (3 x 32 for the device's half of the heads + o's 64 outputs) x 4 B = 80 KiB, 160 KiB over `full`'s
    layer inputs for the 2 layers; `dots` keeps gate/up/down and attention's score matmuls besides.
    Measured per device (the loss-and-gradients programs the test above runs): full 660,096, names
    824,032, dots 905,960 bytes; 32 KiB is under half of each gap."""
    temp = {remat: compiled_grads(2, tp=2, grad_accum=1, remat=remat)[1].memory_analysis().temp_size_in_bytes
            for remat in ("full", "names", "dots")}
    assert temp["full"] + 32 * 2**10 < temp["names"] < temp["dots"] - 32 * 2**10, temp


def test_train_step_reports_metrics_and_learns():
    tr, step = trainer(dp=2, tp=2, zero=1), compiled_step(dp=2, tp=2, zero=1)
    state = jax.device_put(initial_state(), tr.state_sharding)
    batch = jax.device_put(make_batch(2, 16), tr.batch_sharding)
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 4
    assert losses[0] == pytest.approx(loss_and_grads(dp=1)[0], abs=1e-6)
    assert float(metrics["grad_norm"]) > 0 and float(metrics["lr"]) > 0
    assert losses[-1] < losses[0], losses  # the same batch four times: it must be memorised a little


def test_tensor_parallel_step_gathers_neither_logits_nor_weights():
    """Megatron TP + DP needs only all-reduces: an all-gather would mean XLA materialises full
    logits (or full weights) on a device."""
    hlo = compiled_step(dp=2, tp=4).as_text()
    assert re.search(r"all-reduce(-start)?\(", hlo), "expected TP/DP all-reduces"
    gathers = [line.strip()[:160] for line in hlo.splitlines() if re.search(r"all-gather(-start)?\(", line)]
    assert not gathers, gathers


def test_tensor_parallel_reduces_each_input_gradient_once():
    """q, k, v share their input, and gate, up theirs: with tp the partial input gradients are
    summed in one dot and all-reduced once (Megatron's `f`), not once per projection. Per
    micro-batch and layer 2 activation all-reduces forward and 2 backward, plus the embedding's
    and the output layer's: 2 x (4 x 2 + 2) = 20 for this model's 2 layers and 2 micro-batches."""
    from pjax.observe.hlo import collective_stats

    act = f"f32[{TC.batch_size // 2 // 2 * TC.seq_len},{CFG.hidden_size}]"  # one micro-batch's rows on one dp replica

    def classify(kind, line):  # one activation alone; the separate q/k/v reductions were a tuple of three
        result = line.split("=", 1)[1].strip()
        return "activation" if kind == "all-reduce" and result.startswith(act + "{") else None

    stats = collective_stats(compiled_step(dp=2, tp=4).as_text(), classify)
    assert stats["activation"]["count"] == 2 * (4 * CFG.num_hidden_layers + 2), stats["activation"]


def test_data_parallel_gradients_are_reduced_once_per_step_not_per_micro_batch():
    """dp=2 x tp=4 with 2 micro-batches: over dp, one all-reduce of each device's gradient (its tp
    shard) per step (plus the loss and token count riding along), where XLA alone would reduce
    after every micro-batch."""
    from pjax.observe.hlo import collectives_by_axis

    rows = collectives_by_axis(compiled_step(dp=2, tp=4).as_text(), dict(dp=2, pp=1, cp=1, tp=4))
    grad_bytes = sum(4 * int(np.prod(p.sharding.shard_shape(p.shape)))
                     for p in jax.tree.leaves(trainer(dp=2, tp=4).abstract_state().params))
    assert grad_bytes < 4 * CFG.num_params / 2, grad_bytes  # most of it split over tp
    assert rows["dp"]["count"] <= 2, rows["dp"]
    assert grad_bytes <= rows["dp"]["bytes"] <= grad_bytes + 64, (rows["dp"], grad_bytes)


def test_chunked_attention_step_on_dp2_tp2_equals_one_device():
    """train.attention=chunked under the once-per-step dp reduction (a shard_map: its backward's
    scan carry must vary over dp) and tp, against the default attention on one device."""
    ref_loss, ref_grads = loss_and_grads(dp=1)
    loss, grads = loss_and_grads(dp=2, tp=2, attention="chunked")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_grads_close(grads, ref_grads)


def test_zero1_reduce_scatters_gradients_without_gathering_tp():
    """ZeRO-1 reduce-scatters each gradient over dp to its moment slice, in a shard_map nested
    manual over tp: left to XLA, every tp-split gradient was all-gathered over tp first."""
    from pjax.observe.hlo import collectives_by_axis

    rows = collectives_by_axis(compiled_step(dp=2, tp=2, zero=1).as_text(), dict(dp=2, pp=1, cp=1, tp=2))
    assert "reduce-scatter" in rows["dp"]["kinds"], rows["dp"]
    assert set(rows["tp"]["kinds"]) == {"all-reduce"}, rows["tp"]
