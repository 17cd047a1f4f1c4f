"""Collective counting from compiled HLO: ops inside scans count trip-count times."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mesh import MeshConfig, make_mesh
from pjax.observe.hlo import collective_stats, shape_bytes


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
    # What the caller knows and the HLO does not (how often an op really runs) scales both.
    scaled = collective_stats(hlo, scale=lambda kind, line: 0.5 if kind == "collective-permute" else 1)
    assert scaled["collective-permute"] == {"count": 2.5, "bytes": 2.5 * 16 * 4}
    assert scaled["all-reduce"] == stats["all-reduce"]


def test_device_groups_read_all_three_spellings_of_replica_groups():
    from pjax.observe.hlo import device_groups

    assert device_groups("replica_groups={{0,4},{1,5}}, x", 8) == [[0, 4], [1, 5]]
    assert device_groups("source_target_pairs={{0,2},{2,0}}", 8) == [[0, 2], [2, 0]]
    # [groups, size]<=[dims]T(perm): arange(8).reshape(2, 4).T rows
    assert device_groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert device_groups("replica_groups=[2,4]<=[8], x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # mesh form: devices laid out on the named mesh, groups vary over the axes in braces
    line = "replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}, use_global_device_ids=true"
    assert device_groups(line, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert device_groups("replica_groups=mesh['a'=2,'b'=4] {'b'}, x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert device_groups("replica_groups={}, x", 4) == [[0, 1, 2, 3]]


def test_collectives_by_axis_names_the_axes_and_counts_ring_link_bytes():
    from pjax.observe.hlo import collectives_by_axis

    mesh = make_mesh(MeshConfig(dp=2, tp=4))

    def body(x):
        x = jax.lax.psum(x, "tp")  # [16] f32 over 4 devices: 2 * 3/4 * 64 link bytes
        x = jax.lax.ppermute(x, "dp", [(0, 1), (1, 0)])
        return jax.lax.psum(x, ("dp", "tp"))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P(), check_vma=False))
    hlo = f.lower(jax.ShapeDtypeStruct((128,), jnp.float32)).compile().as_text()
    by_axis = collectives_by_axis(hlo, dict(mesh.shape), devices_per_host=4)
    assert by_axis["tp"]["count"] == 1 and by_axis["tp"]["bytes"] == 64
    assert by_axis["tp"]["link_bytes"] == 2 * 3 / 4 * 64 and not by_axis["tp"]["inter_host"]
    assert by_axis["dp"] == {"count": 1, "bytes": 64, "link_bytes": 64.0, "inter_host": True,
                             "inter_link_bytes": 64.0, "kinds": {"collective-permute": 1}, "group": 2}
    assert by_axis["tp"]["inter_link_bytes"] == 0
    assert by_axis["dp+tp"]["link_bytes"] == 2 * 7 / 8 * 64 and by_axis["dp+tp"]["inter_host"]
    assert by_axis["tp"]["group"] == 4 and by_axis["dp+tp"]["group"] == 8


# The shape of XLA:GPU's scheduled HLO (cut down from a dp2 x tp4 step compiled for 8 mocked
# GPUs): asynchronous collectives are `async-start` ops calling a computation that holds the op.
_GPU_SCHEDULED = """HloModule jit_train_step, is_scheduled=true

%async_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %all-reduce.1 = f32[8]{0} all-reduce(%param_0), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
}

%async_computation.1 (param_0.1: f32[8]) -> f32[8] {
  %param_0.1 = f32[8]{0} parameter(0)
  ROOT %all-reduce.2 = f32[8]{0} all-reduce(%param_0.1), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
}

ENTRY %main (p: f32[8], q: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %q = f32[8]{0} parameter(1)
  %all-reduce-start = ((f32[8]{0}), f32[8]{0}) async-start(%p), calls=%async_computation
  %all-reduce-start.1 = ((f32[8]{0}), f32[8]{0}) async-start(%q), calls=%async_computation.1
  %all-reduce-done.1 = f32[8]{0} async-done(%all-reduce-start.1)
  %fusion.3 = f32[8]{0} fusion(%q), kind=kLoop, calls=%fused
  %all-reduce-done = f32[8]{0} async-done(%all-reduce-start)
  %all-reduce.3 = f32[8]{0} all-reduce(%fusion.3), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %add.1 = f32[8]{0} add(%all-reduce-done, %all-reduce.3)
}
"""


def test_async_overlap_counts_collectives_with_work_scheduled_inside_them():
    from pjax.observe.hlo import async_overlap

    # Three sites: one asynchronous with a fusion between its start and done, one asynchronous
    # with nothing between (`.1`, whose name extends the first one's), one synchronous.
    assert async_overlap(_GPU_SCHEDULED) == {"all-reduce": {"sites": 3, "overlapped": 1}}
    # Each async-start's computation is counted once, where it is called.
    assert collective_stats(_GPU_SCHEDULED)["all-reduce"] == {"count": 3, "bytes": 3 * 8 * 4}


# jax 0.10.2's XLA:GPU writes its async collectives as their own start ops, whose result holds the operands
# beside the outputs (cut down from debug's dp4 x tp2 ZeRO-1 step compiled for 8 compile-only H100s).
_GPU_STARTS = """HloModule jit_train_step, is_scheduled=true

ENTRY %main (p: f32[32,4], q: bf16[4,8], r: f32[8]) -> f32[8] {
  %p = f32[32,4]{1,0} parameter(0)
  %q = bf16[4,8]{1,0} parameter(1)
  %r = f32[8]{0} parameter(2)
  %reduce-scatter-start = ((f32[32,4]{1,0}, f32[8]{0}), (f32[8,4]{1,0}, f32[2]{0})) reduce-scatter-start(%p, %r), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %reduce-scatter-done = (f32[8,4]{1,0}, f32[2]{0}) reduce-scatter-done(%reduce-scatter-start)
  %all-gather-start = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%q), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}
  %all-gather-done = bf16[16,8]{1,0} all-gather-done(%all-gather-start)
  %all-reduce-start = f32[8]{0} all-reduce-start(%r), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %all-reduce-done = f32[8]{0} all-reduce-done(%all-reduce-start)
}
"""


def test_start_ops_count_their_outputs_not_their_operands():
    stats = collective_stats(_GPU_STARTS)
    assert stats["reduce-scatter"] == {"count": 1, "bytes": (8 * 4 + 2) * 4}
    assert stats["all-gather"] == {"count": 1, "bytes": 16 * 8 * 2}
    assert stats["all-reduce"] == {"count": 1, "bytes": 8 * 4}


def test_matmul_flops_count_every_dot_as_often_as_its_loop_runs_and_a_gradient_s_two_more():
    from pjax.observe.hlo_flops import dot_flops

    m, k, n = 32, 48, 16

    def f(x, w):
        def step(c, _):
            return jnp.tanh(c @ w), None
        return jnp.sum(jax.lax.scan(step, x, None, length=5)[0])

    x, w = jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((k, k), jnp.float32)
    forward = jax.jit(f).lower(x, w).compile().as_text()
    assert dot_flops(forward) == 5 * 2 * m * k * k
    both = jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, w).compile().as_text()
    assert dot_flops(both) == 3 * 5 * 2 * m * k * k  # forward, d(input), d(weight) per step
    gemm = ('%w = f32[48,16]{1,0} parameter(1)\n  %x = f32[32,48]{1,0} parameter(0)\n  %g = (f32[32,16]{1,0}, '
            's8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":'
            '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}')
    assert dot_flops(f"HloModule m\n\nENTRY %main (x: f32[32,48], w: f32[48,16]) -> f32[32,16] {{\n  {gemm}\n}}\n"
                     ) == 2 * m * k * n  # XLA:GPU's cuBLAS calls count too


def test_matmul_shapes_fold_a_batch_into_rows_and_cudnn_attention_is_flagged():
    from pjax.observe.hlo_flops import StepMatmuls, dot_flops, dot_products

    def f(q, k, w):
        return jnp.einsum("bqd,bkd->bqk", q, k), q.reshape(-1, 16) @ w

    shapes = (jax.ShapeDtypeStruct((4, 8, 16), jnp.float32), jax.ShapeDtypeStruct((4, 12, 16), jnp.float32),
              jax.ShapeDtypeStruct((16, 24), jnp.float32))
    hlo = jax.jit(f).lower(*shapes).compile().as_text()
    assert dot_products(hlo) == {(4 * 8, 16, 12): 1, (32, 16, 24): 1}
    matmuls = StepMatmuls.from_hlo(hlo)
    assert matmuls.flops == dot_flops(hlo) == 2 * 16 * (32 * 12 + 32 * 24) and not matmuls.fused_attention
    assert StepMatmuls.from_json(matmuls.as_json()) == matmuls
    fmha = hlo.replace("ENTRY", '%a = f32[1] custom-call(), custom_call_target="__cudnn$fmhaSoftmax"\nENTRY', 1)
    assert StepMatmuls.from_hlo(fmha).fused_attention


# A loop as XLA:GPU's collective pipeliner leaves it (cut down from debug's dp4 x tp2 ZeRO-1 SP step, 4 micro-batches,
# compiled for 8 compile-only H100s): one iteration peeled, the condition `i < 3` fused, no `known_trip_count`; the
# induction variable starts at a copied constant 0 and steps by one inside a fusion. `bound` is what `i` is compared
# with: a constant, or a loop-carried value that no reading can resolve.
def _rotated_loop(bound: str) -> str:
    return """HloModule jit_train_step, is_scheduled=true

%fused_compare (param_0.4: s32[], param_1.1: s32[]) -> pred[] {
  %param_0.4 = s32[] parameter(0)
  %param_1.1 = s32[] parameter(1)
  %constant_3 = s32[] constant(3)
  ROOT %compare.3 = pred[] compare(%param_0.4, %BOUND), direction=LT
}

%cond (cond_param: (s32[], f32[8], s32[])) -> pred[] {
  %cond_param = (s32[], f32[8]{0}, s32[]) parameter(0)
  %gte.0 = s32[] get-tuple-element(%cond_param), index=0
  %gte.2 = s32[] get-tuple-element(%cond_param), index=2
  ROOT %loop_compare_fusion = pred[] fusion(%gte.0, %gte.2), kind=kLoop, calls=%fused_compare
}

%fused_add (param_0.9: s32[]) -> s32[] {
  %param_0.9 = s32[] parameter(0)
  %constant_1 = s32[] constant(1)
  ROOT %add.1 = s32[] add(%param_0.9, %constant_1)
}

%body (param.116: (s32[], f32[8], s32[])) -> (s32[], f32[8], s32[]) {
  %param.116 = (s32[], f32[8]{0}, s32[]) parameter(0)
  %i = s32[] get-tuple-element(%param.116), index=0
  %x = f32[8]{0} get-tuple-element(%param.116), index=1
  %n = s32[] get-tuple-element(%param.116), index=2
  %all-reduce-start = f32[8]{0} all-reduce-start(%x), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  %all-reduce-done = f32[8]{0} all-reduce-done(%all-reduce-start)
  %next = s32[] fusion(%i), kind=kLoop, calls=%fused_add
  ROOT %tuple.186 = (s32[], f32[8]{0}, s32[]) tuple(%next, %all-reduce-done, %n)
}

ENTRY %main (p: f32[8], q: s32[]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %q = s32[] parameter(1)
  %constant_0 = s32[] constant(0)
  %copy.713 = s32[] copy(%constant_0)
  %tuple.184 = (s32[], f32[8]{0}, s32[]) tuple(%copy.713, %p, %q)
  %while.416 = (s32[], f32[8]{0}, s32[]) while(%tuple.184), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"},"dynamic_variables":[]}
  ROOT %out = f32[8]{0} get-tuple-element(%while.416), index=1
}
""".replace("%BOUND", bound)


def test_a_loop_the_collective_pipeliner_rotated_counts_its_iterations_from_its_condition():
    from pjax.observe import hlo_loops
    from pjax.observe.hlo import walk

    rotated = _rotated_loop("%constant_3")
    assert "known_trip_count" not in rotated
    rest = next(line for line in rotated.splitlines() if " while(" in line).split(" while(", 1)[1]
    assert hlo_loops.trip_count(rotated, "main", rest) == 3
    assert walk(rotated, lambda *a: None)["body"] == 3
    assert collective_stats(rotated)["all-reduce"] == {"count": 3, "bytes": 3 * 8 * 4}
    # A bound carried by the loop cannot be read: the body counts once, as before.
    assert hlo_loops.trip_count(_rotated_loop("%param_1.1"), "main", rest) is None
    assert walk(_rotated_loop("%param_1.1"), lambda *a: None)["body"] == 1
