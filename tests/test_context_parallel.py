"""Ring attention over `cp` equals full causal attention; zigzag balances the work; the custom
backward keeps memory flat in cp; cp trains like one device (with dp and tp, and with sequence
parallelism). The other context.strategy choices (all_gather, ulysses) do the same."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import proofs
from mesh import MeshConfig, make_mesh
from mesh.errors import ConfigError
from mesh.mesh import PP
from models.attention import reference_attention, select_attention
from models.config import LlamaConfig
from pjax.data.batches import DataIterator
from pjax.config import ContextConfig, TrainConfig
from pjax.parallel.context.ring import ring_attention
from pjax.parallel.context.strategy import context_attention
from pjax.parallel.context.zigzag import zigzag_chunks, zigzag_layout, zigzag_schedule
from pjax.step import build_trainer

B, T, H, KV, D = 2, 32, 4, 2, 8  # GQA: 2 query heads per kv head

CFG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)
# 4 micro-batches of 2 rows: one row per device at dp=2, two at dp=1.
TC = TrainConfig(seq_len=32, batch_size=8, grad_accum=4, dtype="float32", steps=3, warmup_steps=1, lr=3e-3)
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, 32 * 8 * 3 + 1)
COLLECTIVES = r"(all-to-all|all-gather|all-reduce|collective-permute|reduce-scatter)(?:-start)?\("


def qkv(t: int = T, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, t, KV, D)).astype(np.float32) for _ in range(2))
    return q, k, v, np.broadcast_to(np.arange(t, dtype=np.int32), (B, t))


def value_and_grads(attention):
    """Forward output and d/d(q, k, v) of a non-trivial scalar of it."""
    def f(q, k, v, pos):
        out = attention(q, k, v, pos, pos)
        return jnp.sum(out * jnp.sin(out)), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


def cp_mesh(cp: int, dp: int = 1, tp: int = 1):
    return make_mesh(MeshConfig(dp=dp, cp=cp, tp=tp), jax.devices()[: dp * cp * tp])


def assert_close(x, ref, rtol=1e-5):
    err = np.max(np.abs(np.asarray(x) - np.asarray(ref))) / np.max(np.abs(ref))
    assert err <= rtol, f"relative error {err:.2e} > {rtol}"


# Contiguous (masked, not skipped: kept for comparison) at cp=4, its first step and the loop after it.
@pytest.mark.parametrize("cp,layout", [(2, "zigzag"), (4, "zigzag"), (8, "zigzag"), (4, "contiguous")])
def test_ring_attention_and_its_gradients_equal_full_causal_attention(cp, layout):
    q, k, v, pos = qkv()
    (_, ref_out), ref_grads = value_and_grads(reference_attention)(q, k, v, pos)
    # The ring sees the tokens in its layout; positions travel with them, so the mask follows.
    perm = zigzag_layout(cp)(np.arange(T)) if layout == "zigzag" else np.arange(T)
    mesh = cp_mesh(cp)
    with jax.set_mesh(mesh):
        (_, out), grads = value_and_grads(ring_attention(layout))(q[:, perm], k[:, perm], v[:, perm], pos[:, perm])
    assert_close(out, ref_out[:, perm])
    for g, ref in zip(grads, ref_grads):
        assert_close(g, np.asarray(ref)[:, perm])


# all_gather at cp=2 trains in dp2_cp2_tp2_strategyall_gather below.
STRATEGY_LAYOUTS = [("all_gather", 4, 2), ("ulysses", 2, 1), ("ulysses", 4, 1), ("ulysses", 2, 2)]


@pytest.mark.parametrize("strategy,cp,tp", STRATEGY_LAYOUTS, ids=[f"{s}_cp{c}_tp{t}" for s, c, t in STRATEGY_LAYOUTS])
def test_other_strategies_and_their_gradients_equal_full_causal_attention(strategy, cp, tp):
    """Heads split over tp as the model splits them. Ulysses at cp=4 (2 kv-heads) and at cp=2
    with tp=2 (1 kv-head per device) repeats kv-heads up to cp; its local attention is the
    CPU's blocked kernel, which assumes tokens in order: the reorder after the all-to-all."""
    q, k, v, pos = qkv()
    (_, ref_out), ref_grads = value_and_grads(reference_attention)(q, k, v, pos)
    perm = zigzag_layout(cp)(np.arange(T))
    mesh = cp_mesh(cp, tp=tp)
    attention = context_attention(strategy, select_attention("blocked"))
    with jax.set_mesh(mesh):
        (_, out), grads = value_and_grads(attention)(q[:, perm], k[:, perm], v[:, perm], pos[:, perm])
    assert_close(out, ref_out[:, perm])
    for g, ref in zip(grads, ref_grads):
        assert_close(g, np.asarray(ref)[:, perm])


def test_ring_attention_differentiates_inside_a_pipeline_stage():
    """Nested in a shard_map that is manual over pp (as a pipeline stage is), with tp inside."""
    mesh = make_mesh(MeshConfig(dp=1, pp=2, cp=2, tp=2))
    q, k, v, pos = qkv()
    perm = zigzag_layout(2)(np.arange(T))
    ring = ring_attention()
    stage = jax.shard_map(lambda q, k, v, p: ring(q[0], k[0], v[0], p, p)[None], mesh=mesh,
                          in_specs=(P(PP), P(PP), P(PP), P()), out_specs=P(PP), axis_names={PP})
    stacked = [np.stack([x[:, perm], 2 * x[:, perm]]) for x in (q, k, v)]  # a different input per stage
    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(stage(*a, pos[:, perm]))), argnums=(0, 1, 2)))(*stacked)
    for s in range(2):
        ref = jax.grad(lambda *a: jnp.sum(jnp.sin(reference_attention(*a, pos, pos))), argnums=(0, 1, 2))(
            *((s + 1) * x for x in (q, k, v)))
        for g, r in zip(grads, ref):
            assert_close(np.asarray(g)[s], np.asarray(r)[:, perm])


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_computes_equal_work_per_device_and_contiguous_does_not(cp):
    """Count, per device, the (query chunk, key chunk) pairs of the 2cp-chunk grid that are not
    entirely above the causal diagonal: the work a ring that skips masked blocks must do."""
    def visible(chunks):
        return {(a, b) for a in chunks for b in range(2 * cp) if a >= b}

    zigzag = [visible(zigzag_chunks(cp, i)) for i in range(cp)]
    contiguous = [visible((2 * i, 2 * i + 1)) for i in range(cp)]
    assert [len(w) for w in zigzag] == [2 * cp + 1] * cp
    assert [len(w) for w in contiguous] == [4 * i + 3 for i in range(cp)]  # the last device: ~2x the mean
    # The ring's own schedule computes exactly the visible pairs: none masked away, none missed,
    # 3 pairs at step 0 (the own block) and 2 at every later step.
    schedule = zigzag_schedule(cp)
    for i, steps in enumerate(schedule):
        computed = [pair for step in steps for pair in step]
        assert len(computed) == len(set(computed)) and set(computed) == zigzag[i]
        assert [len(step) for step in steps] == [3] + [2] * (cp - 1)


def test_data_pipeline_gives_each_device_an_early_and_a_late_chunk():
    cp, seq_len = 4, 16
    mesh = cp_mesh(cp)
    tokens = np.arange(seq_len * 8 + 1) % 256
    it = DataIterator(tokens, seq_len, 2, 1, seed=0, mesh=mesh, sequence_layout=zigzag_layout(cp))
    batch = next(it)
    c = seq_len // (2 * cp)
    for shard in batch["positions"].addressable_shards:
        i = shard.index[2].start // (seq_len // cp)
        early, late = zigzag_chunks(cp, i)
        expected = np.concatenate([np.arange(early * c, early * c + c), np.arange(late * c, late * c + c)])
        np.testing.assert_array_equal(np.asarray(shard.data)[0, 0], expected)
    # Inputs and labels are permuted with their positions (labels stay "the next token").
    np.testing.assert_array_equal(np.asarray(batch["labels"]), np.asarray(batch["inputs"]) + 1)


def test_seq_len_not_divisible_by_2cp_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train.seq_len=24 is not divisible by 2\*mesh.cp = 16"):
        build_trainer(cp_mesh(8), CFG, dataclasses.replace(TC, seq_len=24))
    with pytest.raises(ConfigError, match="train.seq_len=12"):
        zigzag_layout(4)(np.arange(12))


def test_ulysses_heads_that_do_not_split_over_cp_are_a_config_error():
    ulysses = ContextConfig(strategy="ulysses")
    with pytest.raises(ConfigError, match=r"num_attention_heads/mesh.tp = 2 is not divisible by mesh.cp=4; use"):
        build_trainer(cp_mesh(4, tp=2), CFG, TC, context=ulysses)
    odd = dataclasses.replace(CFG, num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ConfigError, match=r"num_key_value_heads/mesh.tp = 3 to divide or be divisible by mesh.cp=2"):
        build_trainer(cp_mesh(2), odd, TC, context=ulysses)


# -- training ---------------------------------------------------------------------------------

@functools.cache
def initial_state():
    """One device's initial state, on the host: every layout starts from it (init is not what these tests test)."""
    return jax.tree.map(np.asarray, build_trainer(cp_mesh(1), CFG, TC).init(jax.random.key(0)))


@proofs.cache
def train_run(dp: int = 1, cp: int = 1, tp: int = 1, steps: int = 3, strategy: str = "ring", sp: bool = False
              ) -> tuple[tuple[float, ...], frozenset, str]:
    """Losses of `steps` training steps on the zigzag data pipeline, the step's collectives and its HLO."""
    mesh = cp_mesh(cp, dp, tp)
    trainer = build_trainer(mesh, CFG, dataclasses.replace(TC, sequence_parallel=sp),
                            context=ContextConfig(strategy=strategy))
    data = DataIterator(TOKENS, TC.seq_len, TC.batch_size, TC.grad_accum, TC.seed, mesh,
                        sequence_layout=zigzag_layout(cp))
    state, batch, losses = jax.device_put(initial_state(), trainer.state_sharding), next(data), []
    step = trainer.compile_step(state, batch)
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        batch = next(data)
    return tuple(losses), frozenset(re.findall(COLLECTIVES, step.as_text())), step.as_text()


# Every strategy with dp and tp (the steps the collectives tests below read; ring alone at cp=2 was
# a case of its own), and cp=4 under sequence parallelism: tp splits the residual stream's tokens
# too, the same for every strategy (ring and ulysses with sp were cases of their own).
TRAIN_LAYOUTS = [dict(dp=2, cp=2, tp=2), dict(dp=2, cp=2, tp=2, strategy="all_gather"),
                 dict(dp=2, cp=2, tp=2, strategy="ulysses"), dict(cp=4, tp=2, strategy="all_gather", sp=True)]


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS, ids=["_".join(f"{k}{v}" for k, v in layout.items())
                                                       for layout in TRAIN_LAYOUTS])
def test_context_parallel_training_losses_equal_one_device(layout):
    ref, losses = train_run()[0], train_run(**layout)[0]
    assert max(abs(a - b) for a, b in zip(ref, losses)) <= 1e-5, (ref, losses)


def test_dp_cp_tp_step_communicates_only_by_the_ring_and_all_reduces():
    """No all-gather: heads stay split over tp inside the ring and K/V are never gathered. (With
    one row per device per micro-batch; with more, XLA adds all-to-alls to reshuffle the
    flattened [batch*seq] activations around attention -- see benchmarks/context_parallel.py.)"""
    collectives = train_run(dp=2, cp=2, tp=2)[1]
    assert collectives == {"all-reduce", "collective-permute"}, collectives


@pytest.mark.parametrize("strategy,kinds", [("all_gather", {"all-gather", "reduce-scatter"}),
                                            ("ulysses", {"all-to-all"})])
def test_other_strategies_communicate_by_their_own_collectives(strategy, kinds):
    """All-gather: K/V gathered over cp, their gradients reduce-scattered home. Ulysses: q, k, v and
    the output all-to-all. No ring permutes, and tp keeps its heads split: nothing over tp but
    its all-reduces (left to XLA, the kv-heads would be all-gathered over tp before each of
    these collectives over cp)."""
    from pjax.observe.hlo import collectives_by_axis

    rows = collectives_by_axis(train_run(dp=2, cp=2, tp=2, strategy=strategy)[2], dict(dp=2, pp=1, cp=2, tp=2))
    assert set(rows["cp"]["kinds"]) == kinds, rows["cp"]
    assert set(rows["tp"]["kinds"]) == {"all-reduce"}, rows["tp"]
    assert set(rows) == {"dp+cp", "cp", "tp"}, rows


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_dp_cp_gradients_are_reduced_once_per_step_not_per_micro_batch(strategy):
    """dp and cp are manual for the step (every strategy runs its collectives directly inside):
    the gradient is all-reduced over (dp, cp) once, with the loss, not once per micro-batch."""
    from pjax.observe.hlo import collectives_by_axis

    mesh = cp_mesh(2, dp=2, tp=2)
    rows = collectives_by_axis(train_run(dp=2, cp=2, tp=2, strategy=strategy)[2], dict(mesh.shape))
    assert rows["dp+cp"]["count"] <= 2, rows["dp+cp"]  # TC.grad_accum = 4 micro-batches
    assert 4 * CFG.num_params / 2 <= rows["dp+cp"]["bytes"] <= 4 * CFG.num_params / 2 + 1024, rows["dp+cp"]
    assert set(rows) == {"dp+cp", "cp", "tp"}, rows


# -- memory -----------------------------------------------------------------------------------

def temp_bytes(fn, *args) -> int:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def grads_temp_bytes(cp: int, per_device_seq: int = 32) -> int:
    """Temporary memory of the compiled loss-and-gradients program at a fixed per-device sequence length."""
    trainer = build_trainer(cp_mesh(cp), CFG, dataclasses.replace(TC, seq_len=per_device_seq * cp, grad_accum=1))
    with jax.set_mesh(trainer.mesh):
        return temp_bytes(trainer.grads.jitted, trainer.abstract_state().params, trainer.abstract_batch())


def attention_grad_temp_bytes(cp: int, custom_backward: bool, per_device_seq: int = 64) -> int:
    mesh = cp_mesh(cp)
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in qkv(per_device_seq * cp)]
    attention = ring_attention(custom_backward=custom_backward)
    grad = jax.jit(jax.grad(lambda q, k, v, p: jnp.sum(attention(q, k, v, p, p)), argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
        return temp_bytes(grad, *args)


def test_custom_backward_memory_does_not_grow_with_cp():
    """Per-device temporary bytes of the compiled program at a fixed per-device sequence length
    (XLA:CPU), cp = 4 / 8:
      the model's loss and gradients, this file's model, 8 rows x 32 tokens per device:  4,161,120 / 4,161,120
      ring attention fwd+bwd (B=2, 64 tokens per device, H=4, KV=2, D=8):
        custom backward                      479,576 /   479,576
        autodiff through the ring          1,116,872 / 1,854,152
    From cp = 4 on the ring is a loop (at cp = 2 it is two straight-line steps, scheduled otherwise)
    and memory is flat. Autodiff keeps every received K/V block and every step's softmax statistics
    for the backward, so its memory grows with cp: what the custom backward avoids."""
    model = [grads_temp_bytes(cp) for cp in (4, 8)]
    assert model[0] == model[1], model
    custom = [attention_grad_temp_bytes(cp, True) for cp in (4, 8)]
    autodiff = [attention_grad_temp_bytes(cp, False) for cp in (4, 8)]
    assert custom[0] == custom[1], custom
    assert autodiff[0] < autodiff[1] and autodiff[1] > 2 * custom[1], autodiff
