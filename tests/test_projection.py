"""The XLA:CPU projection (weight gradients from a materialised x^T) equals plain matmuls."""
import jax
import jax.numpy as jnp
import numpy as np

from models.projection import plain_projection, select_projection, transposed_projection


def test_transposed_projection_has_the_plain_values_and_gradients():
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (24, 16))
    ws = [jax.random.normal(k, (16, f)) for k, f in zip(ks[1:4], (16, 8, 40))]
    cots = [jax.random.normal(ks[4], (24, w.shape[1])) for w in ws]

    def loss(fn, x, ws):
        return sum(jnp.sum(o * c) for o, c in zip(fn(x, ws), cots))

    ref_val, (ref_dx, ref_dws) = jax.value_and_grad(lambda x, ws: loss(plain_projection, x, ws), argnums=(0, 1))(x, ws)
    val, (dx, dws) = jax.value_and_grad(lambda x, ws: loss(transposed_projection, x, ws), argnums=(0, 1))(x, ws)
    np.testing.assert_allclose(val, ref_val, rtol=1e-6)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-5)
    assert isinstance(dws, list) and len(dws) == 3
    for g, r in zip(dws, ref_dws):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    # 16-bit compute keeps its dtypes through the custom backward.
    bf = jax.grad(lambda x, ws: loss(transposed_projection, x, ws).astype(jnp.float32), argnums=(0, 1))(
        x.astype(jnp.bfloat16), [w.astype(jnp.bfloat16) for w in ws])
    assert bf[0].dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in bf[1])


def test_cpu_without_remat_takes_the_transposed_form_and_remat_the_plain_one():
    assert jax.default_backend() == "cpu"
    assert select_projection("none") is transposed_projection
    for remat in ("full", "dots", "dots_no_batch", "offload", "names"):
        assert select_projection(remat) is plain_projection  # dot policies must still see dots
