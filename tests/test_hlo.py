"""Collective counting from compiled HLO: ops inside scans count trip-count times."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mesh import MeshConfig, make_mesh
from pjax.hlo import collective_stats, shape_bytes


def test_shape_bytes_of_arrays_and_tuples():
    assert shape_bytes("f32[64,64]{1,0}") == 64 * 64 * 4
    assert shape_bytes("(bf16[8]{0}, s32[2,3]{1,0})") == 16 + 24
    assert shape_bytes("f32[]") == 4


def test_collectives_inside_a_scan_count_once_per_iteration():
    mesh = make_mesh(MeshConfig(dp=8))

    def body(x):
        def step(c, _):
            c = jax.lax.psum(c, "dp") * 0.5  # one all-reduce of [16] f32 per iteration
            return jax.lax.ppermute(c, "dp", [(i, (i + 1) % 8) for i in range(8)]), None
        x, _ = jax.lax.scan(step, x, None, length=5)
        return jax.lax.all_gather(x, "dp", tiled=True)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P(), check_vma=False))
    hlo = f.lower(jax.ShapeDtypeStruct((128,), jnp.float32)).compile().as_text()
    stats = collective_stats(hlo)
    assert stats["all-reduce"] == {"count": 5, "bytes": 5 * 16 * 4}
    assert stats["collective-permute"] == {"count": 5, "bytes": 5 * 16 * 4}
    assert stats["all-gather"] == {"count": 1, "bytes": 128 * 4}
