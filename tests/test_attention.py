"""The attention implementations agree: reference (plain GQA), blocked (CPU, custom backward), and
`jax.nn.dot_product_attention` as an outside reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh.errors import ConfigError
from models.attention import cudnn_supported, deterministic_gpu_ops, reference_attention, select_attention
from models.chunked_attention import chunked_causal_attention
from models.cpu_attention import blocked_causal_attention


def qkv(b=2, t=64, h=4, kv=2, d=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, h, d))
    k = jax.random.normal(ks[1], (b, t, kv, d))
    v = jax.random.normal(ks[2], (b, t, kv, d))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    return q, k, v, pos, jax.random.normal(ks[3], (b, t, h, d))


def test_reference_equals_jax_dot_product_attention():
    q, k, v, pos, _ = qkv()
    ours = reference_attention(q, k, v, pos, pos)
    theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def assert_equals_reference(fn, t: int, permuted: bool = False):
    """fn's output and its gradients with respect to q, k and v equal the reference attention's."""
    q, k, v, pos, d_out = qkv(t=t)
    if permuted:
        pos = jnp.broadcast_to(jax.random.permutation(jax.random.key(3), t), pos.shape)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, pos, pos) * d_out)

    ref_out, ref_grads = jax.value_and_grad(functools.partial(loss, reference_attention), argnums=(0, 1, 2))(q, k, v)
    out, grads = jax.value_and_grad(functools.partial(loss, fn), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-5 * float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("t,block", [(64, 16), (48, 16), (64, 64), (20, 64)])
def test_blocked_forward_and_grads_equal_reference(t, block):
    assert_equals_reference(functools.partial(blocked_causal_attention, block=block), t)


@pytest.mark.parametrize("t,chunk,order", [(64, 16, "causal"), (48, 32, "causal"), (20, 512, "causal"),
                                           (64, 16, "permuted")])
def test_chunked_forward_and_grads_equal_reference(t, chunk, order):
    """Any token order works (the mask comes from positions), and the chunk is the largest divisor of T."""
    assert_equals_reference(functools.partial(chunked_causal_attention, chunk=chunk), t, order == "permuted")


def test_chunked_keeps_no_scores_for_the_backward():
    """What the backward keeps (XLA's temporaries of a forward+backward) grows with T, not T^2."""
    def temp(fn, t):
        q, k, v, pos, d_out = qkv(b=1, t=t, h=4, kv=4, d=16)
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, pos, pos) * d_out), argnums=(0, 1, 2)))
        return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    chunked = functools.partial(chunked_causal_attention, chunk=64)
    assert temp(chunked, 2048) / temp(chunked, 1024) < 2.2  # linear in T: one chunk's [64, T] scores at a time
    assert temp(reference_attention, 2048) / temp(reference_attention, 1024) > 3.5  # the [T, T] scores
    scores = 4 * 2048 * 2048 * 4  # one layer's fp32 scores at T = 2048, 4 heads
    assert temp(chunked, 2048) < scores / 4


def test_auto_picks_blocked_on_cpu_and_rejects_unknown():
    assert select_attention("auto") is blocked_causal_attention
    with pytest.raises(ValueError, match="unknown attention implementation"):
        select_attention("flash")


def test_gpu_path_names_cudnn_where_it_applies_and_chunked_elsewhere(monkeypatch):
    """`implementation=None` in `jax.nn.dot_product_attention` is XLA's unfused form (scores in memory), so the
    GPU path asks for 'cudnn' by name where cuDNN takes the queries (16-bit, head dim a multiple of 8 up to
    cuDNN's limit), and runs the chunked attention elsewhere: never the unfused form."""
    import models.attention as attention_module

    asked, real = [], jax.nn.dot_product_attention
    chunked = []

    def spy(*args, implementation=None, **kwargs):
        asked.append(implementation)
        return real(*args, implementation="xla", **kwargs)  # no cuDNN on this machine

    def chunked_spy(*args):
        chunked.append(args[0].shape)
        return chunked_causal_attention(*args)

    with pytest.raises(ConfigError, match="train.attention=cudnn needs a GPU, and this run's backend is cpu"):
        select_attention("cudnn")
    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    monkeypatch.setattr(attention_module, "chunked_causal_attention", chunked_spy)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    fn = select_attention("cudnn")
    q, k, v, pos, _ = qkv(d=8)
    np.testing.assert_allclose(fn(q, k, v, pos, pos), reference_attention(q, k, v, pos, pos), atol=1e-5)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = fn(*bf16, pos, pos)
    # Both in bf16: one rounding step of a bf16 output below 2 is 7.8e-3, where a different summation order may
    # land (measured: 0.0 on XLA:CPU; a lost causal mask gives 2.3, against the fp32 reference 9.9e-3).
    np.testing.assert_allclose(out.astype(jnp.float32), reference_attention(*bf16, pos, pos).astype(jnp.float32),
                               atol=8e-3)
    assert asked == ["cudnn"] and chunked == [q.shape]  # fp32 queries went chunked
    assert attention_module.head_dim_limit() == 128  # JAX's check on a host without a GPU backend
    assert not cudnn_supported(jnp.zeros((1, 1, 1, 160), jnp.bfloat16))  # head dim over 128 here
    assert not cudnn_supported(jnp.zeros((1, 1, 1, 60), jnp.bfloat16))   # not a multiple of 8

    class Hopper:
        compute_capability = "9.0"

    monkeypatch.setattr(jax, "devices", lambda backend=None: [Hopper()])
    assert attention_module.head_dim_limit() == 256 and cudnn_supported(jnp.zeros((1, 1, 1, 256), jnp.bfloat16))
    Hopper.compute_capability = "8.0"
    assert attention_module.head_dim_limit() == 128


def test_deterministic_gpu_ops_with_cudnn_is_a_config_error(monkeypatch):
    """XLA's deterministic mode crashed inside XLA on cuDNN's attention (jax 0.11.2, H100): a
    one-line error at start-up instead, naming the setting that works (reference attention)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for flags, on in [("", False), ("--xla_gpu_deterministic_ops", True), ("--foo=1 --xla_gpu_deterministic_ops=true", True),
                      ("--xla_gpu_deterministic_ops=false", False), ("--xla_gpu_deterministic_ops=true "
                                                                     "--xla_gpu_deterministic_ops=false", False),
                      ("--xla_gpu_deterministic_ops_other=true", False)]:
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert deterministic_gpu_ops() is on, flags
        if on:
            with pytest.raises(ConfigError, match="drop the flag, or set train.attention=reference"):
                select_attention("auto")
            assert select_attention("reference") is reference_attention
        else:
            assert select_attention("auto").__name__ == "_cudnn_attention"


@pytest.mark.parametrize("mesh_shape", [{"dp": 4}, {"dp": 2, "tp": 2}])
def test_an_attention_made_manual_over_every_axis_keeps_its_values_and_gradients(mesh_shape):
    """`keeping_residuals`, what cuDNN's call runs in, inside a region manual over dp (tp left automatic): a
    nested shard_map over the rest, its VJP residuals carried out per device. Checked on CPU with an attention
    whose backward keeps residuals of its own (jax.nn's, `implementation='xla'`), against the unwrapped one."""
    from jax.sharding import PartitionSpec as P

    from mesh import MeshConfig, make_mesh
    from models.attention import keeping_residuals

    mesh = make_mesh(MeshConfig(**mesh_shape), jax.devices()[:4])
    q, k, v, _, d_out = qkv(b=4, t=32, h=4, kv=2, d=8)
    attend = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")

    def loss(wrap, q, k, v):
        def body(q, k, v, d_out):  # manual over dp, as the data-parallel step is; tp automatic inside
            total = jnp.sum((keeping_residuals(attend) if wrap else attend)(q, k, v) * d_out)
            return jax.lax.psum(total, "dp")
        rows = P("dp")
        return jax.shard_map(body, in_specs=(rows,) * 4, out_specs=P(), axis_names={"dp"})(q, k, v, d_out)

    with jax.set_mesh(mesh):
        plain = jax.jit(jax.value_and_grad(functools.partial(loss, False), argnums=(0, 1, 2)))(q, k, v)
        wrapped_fn = jax.jit(jax.value_and_grad(functools.partial(loss, True), argnums=(0, 1, 2)))
        wrapped = wrapped_fn(q, k, v)
        jaxpr = str(jax.make_jaxpr(jax.grad(functools.partial(loss, True), argnums=(0, 1, 2)))(q, k, v))
    assert jaxpr.count("shard_map[") >= 3  # dp's, then the attention's forward and backward
    np.testing.assert_allclose(wrapped[0], plain[0], rtol=1e-5)
    for got, want in zip(wrapped[1], plain[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat", ["names", "dots_no_batch", "offload"])
def test_an_attention_keeping_its_residuals_hands_them_to_every_remat_policy_but_full(remat):
    """Outside any mesh: the same values and gradients as the unwrapped attention under the policy, and the saved
    residuals are the output and the kernel's own, each tagged once (`remat.ATTENTION`); `full` saves none."""
    from jax._src.ad_checkpoint import saved_residuals  # jax 0.10 exports only print_saved_residuals

    from models.attention import keeping_residuals
    from models.remat import ATTENTION, policy

    q, k, v, _, d_out = qkv(b=2, t=16, h=4, kv=2, d=8)
    attend = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")

    def loss(fn, q, k, v):  # RoPE-like work before, a projection after: what a layer does around it
        return jnp.sum(fn(jnp.sin(q), jnp.sin(k), jnp.sin(v)) @ jnp.ones((8, 3)) * d_out[..., :3])

    for kept in (remat, "full"):
        wrapped = jax.checkpoint(functools.partial(loss, keeping_residuals(attend)), policy=policy(kept))
        plain = jax.checkpoint(functools.partial(loss, attend), policy=policy(kept))
        got, want = jax.value_and_grad(wrapped, (0, 1, 2))(q, k, v), jax.value_and_grad(plain, (0, 1, 2))(q, k, v)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        for g, w in zip(got[1], want[1]):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        named = [shape for shape, where in saved_residuals(wrapped, q, k, v) if ATTENTION in where]
        if kept == "full":
            assert named == []
        else:  # the output [B, T, H, D] once, and the xla kernel's own residuals, none of them q, k or v
            assert [s.shape for s in named].count(q.shape) == 1 and len(named) > 1
