"""Zero-bubble pipeline tables (ZB-H1, ZB-V): B and W items, their order, bubble and buffers; the
taps, slots and checks the executor runs them with. The compiled zero-bubble pipelines against one
device and 1F1B's memory are in test_pipeline_parallel.py, beside the runs they share."""
import itertools

import numpy as np
import pytest

from pjax.parallel.pipeline import schedules as ps
from pjax.parallel.pipeline.buffers import buffer_plan
from pjax.parallel.pipeline.zero_bubble import zb_h1, zb_v

SHAPES = [(p, m) for p, m in itertools.product(range(1, 9), range(1, 17))]


def ticks_of(sched):
    tick = {}
    for t, s in zip(*np.nonzero(sched.op)):
        key = (int(sched.op[t, s]), int(sched.mb[t, s]), sched.stage(int(s), int(sched.chunk[t, s])))
        assert key not in tick, f"{sched.name} p={sched.p} m={sched.m}: {key} runs twice"
        tick[key] = int(t)
    return tick


@pytest.mark.parametrize("p,m", SHAPES)
def test_zb_h1_runs_every_f_b_and_w_once_in_dependency_order(p, m):
    sched = zb_h1(p, m)
    tick = ticks_of(sched)
    assert len(tick) == 3 * m * p, sched.render()
    for (op, i, j), t in tick.items():
        if op == ps.FORWARD and j > 0:
            assert tick[(ps.FORWARD, i, j - 1)] < t
        if op == ps.BACKWARD:
            assert tick[(ps.FORWARD, i, j)] < t
            if j < p - 1:
                assert tick[(ps.BACKWARD, i, j + 1)] < t
        if op == ps.WEIGHT:
            assert tick[(ps.BACKWARD, i, j)] < t


@pytest.mark.parametrize("p,m", SHAPES)
def test_zb_h1_bubble_and_in_flight_limits_are_the_papers(p, m):
    sched = zb_h1(p, m)
    # Qi et al.: ZB-H1's bubble is (p - 1)(F + B - W), 1F1B's (p - 1)(F + B + W); here F = B = W = 1
    # tick. With fewer micro-batches than stages the first micro-batch's way there and back is longer.
    ticks = 3 * m + p - 1 if m >= p else 2 * (m + p) - 1
    assert sched.ticks == ticks, sched.render()
    assert sched.bubble_fraction() == pytest.approx(1 - 3 * m / ticks, abs=1e-12)
    assert sched.span(1.0, 2.0) == ticks  # every tick costs one F, B or W on every device
    if m >= p:
        assert sched.bubble_fraction() == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    if p > 1:  # in one SPMD program 1F1B's mixed ticks cost a whole backward; ZB-H1's cost one item
        assert sched.span(1.0, 2.0) < ps.one_f_one_b(p, m).span(1.0, 2.0)
    # Between F and B a device holds what 1F1B holds: p - s micro-batches on device s.
    for s in range(p):
        ops = sched.op[:, s]
        in_flight = np.cumsum(ops == ps.FORWARD) - np.cumsum(ops == ps.BACKWARD)
        assert in_flight.max() <= min(p - s, m)
        held = np.cumsum(ops == ps.BACKWARD) - np.cumsum(ops == ps.WEIGHT)
        assert held.max() <= min(s + 1, m)  # W's held back: s, plus the B just run
    # A slot holds a micro-batch from its arrival to its W (residuals, then what B leaves W):
    # still no more slots than 1F1B's, the paper's "same memory as 1F1B".
    assert buffer_plan(sched).slots == buffer_plan(ps.one_f_one_b(p, m)).slots


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 5), (4, 4), (4, 16), (8, 9)])
def test_a_slot_holds_its_micro_batch_from_arrival_to_w(p, m):
    """Replay: an arrival takes a free slot, which its F, B and W all name, and W frees it."""
    sched = zb_h1(p, m)
    plan = buffer_plan(sched)
    held = {}  # (device, slot) -> micro-batch
    for t in range(sched.ticks):
        for s in range(p):
            op, i = int(sched.op[t, s]), int(sched.mb[t, s])
            key = (s, int(plan.slot[t, s]))
            if op == ps.FORWARD and s == 0:  # the first stage's input comes from the embedding
                assert key not in held, f"tick {t}: device 0 overwrites slot {key[1]}"
                held[key] = i
            if op != ps.IDLE:
                assert held.get(key) == i, f"tick {t} device {s}: slot {key[1]} holds {held.get(key)}, not {i}"
            if op == ps.WEIGHT:
                del held[key]
        for s in range(1, p):  # arrivals land at the end of the tick, after its reads
            if plan.recv_x[t, s, 0] != plan.slots:
                key = (s, int(plan.recv_x[t, s, 0]))
                assert key not in held, f"tick {t}: an arrival on device {s} overwrites slot {key[1]}"
                held[key] = int(sched.mb[t, s - 1])
    assert not held


def test_zb_h1_renders_with_w_cells_and_orders_with_w_items_are_checked():
    text = zb_h1(2, 4).render()
    assert text.splitlines()[0] == "zb_h1: p=2 m=4 v=1, 13 ticks, bubble 0.077"
    assert text.splitlines()[1] == "device 0 | F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3"
    assert text.splitlines()[2] == "device 1 | .  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"
    f, b, w = ps.FORWARD, ps.BACKWARD, ps.WEIGHT
    orders = [[(f, 0, 0), (b, 0, 0), (w, 0, 0)]] * 2
    assert ps.from_orders("mine", 2, 1, 1, orders).ticks == 5
    with pytest.raises(ValueError, match=r"missing \[\(3, 0, 0\)\]"):
        ps.from_orders("mine", 2, 1, 1, [orders[0], [(f, 0, 0), (b, 0, 0)]])
    with pytest.raises(RuntimeError, match="deadlocks"):
        ps.from_orders("mine", 2, 1, 1, [[(f, 0, 0), (w, 0, 0), (b, 0, 0)]] * 2)


def test_a_tapped_projection_leaves_its_weight_gradients_to_the_tap():
    import jax
    import jax.numpy as jnp

    from models.deferred_grads import tapped_projection
    from models.projection import plain_projection

    kx, k1, k2, kg = jax.random.split(jax.random.key(0), 4)
    x, ws = jax.random.normal(kx, (6, 4)), [jax.random.normal(k1, (4, 3)), jax.random.normal(k2, (4, 5))]
    tap = (jnp.zeros_like(x), (jnp.zeros((6, 3)), jnp.zeros((6, 5))))
    gs = (jax.random.normal(kg, (6, 3)), jax.random.normal(kg, (6, 5)) * 2)
    dx, dws = jax.vjp(plain_projection, x, ws)[1](gs)
    tdx, tdws, (tx, tgs) = jax.vjp(tapped_projection, x, ws, tap)[1](gs)
    np.testing.assert_allclose(tdx, dx, rtol=1e-6)
    assert all(not np.any(d) for d in tdws)  # B: no weight gradient
    np.testing.assert_array_equal(tx, x)
    for g, tg, dw in zip(gs, tgs, dws):  # W: x^T g from what the tap carried
        np.testing.assert_array_equal(tg, g)
        np.testing.assert_allclose(tx.T @ tg, dw, rtol=1e-5)


def test_sequence_parallel_taps_give_b_the_input_gradient_and_w_the_weight_gradients():
    """Under SP (tp = 2) the tapped column- and row-parallel projections give B's input gradient
    and no weight gradient, and W's dW from their taps equals the sequence-parallel backward's
    (values only: where the gathers run is not visible in them)."""
    import jax
    import jax.numpy as jnp

    from mesh import MeshConfig, make_mesh
    from models import sequence_parallel as seqpar
    from models.deferred_grads import site_weight_grads, tapped_column, tapped_row

    k = jax.random.split(jax.random.key(1), 6)
    x, ws = jax.random.normal(k[0], (8, 4)), [jax.random.normal(k[1], (4, 6)), jax.random.normal(k[2], (4, 2))]
    gs = (jax.random.normal(k[3], (8, 6)), jax.random.normal(k[3], (8, 2)) * 2)
    h, w_row, g_row = jax.random.normal(k[4], (8, 6)), jax.random.normal(k[5], (6, 4)), jax.random.normal(k[0], (8, 4))
    zeros = lambda *shapes: tuple(jnp.zeros(s) for s in shapes)

    def both(x, ws, gs, h, w_row, g_row):
        dx, dws = jax.vjp(lambda x, ws: seqpar.column(x, ws), x, ws)[1](gs)
        tdx, tdws, (tx, tgs) = jax.vjp(tapped_column, x, ws, (jnp.zeros_like(x), zeros((8, 6), (8, 2))))[1](gs)
        dh, dw_row = jax.vjp(seqpar.row, h, w_row)[1](g_row)
        tdh, tdw_row, (th, tg_row) = jax.vjp(tapped_row, h, w_row, (jnp.zeros_like(h), zeros((8, 4))))[1](g_row)
        return ((dx, tdx), (dh, tdh), (dws, site_weight_grads("qkv", tx, tgs, True)),
                (dw_row, site_weight_grads("o", th, tg_row, True)[0]), (tdws, tdw_row))

    with jax.set_mesh(make_mesh(MeshConfig(tp=2), jax.devices()[:2])):
        column_dx, row_dx, column_dw, row_dw, zero = jax.jit(both)(x, ws, gs, h, w_row, g_row)
    for d, td in [column_dx, row_dx, *zip(*column_dw), row_dw]:  # B's input gradients, then W's dW
        np.testing.assert_allclose(td, d, rtol=1e-5, atol=1e-6)
    assert all(not np.any(d) for d in jax.tree.leaves(zero))  # B computes no weight gradient


def replay_slots(sched):
    """Replay the buffer plan by lanes: an arrival (or stage 0's embedding) takes a free slot, which its F, B
    and W all name, and its W frees it."""
    plan, held = buffer_plan(sched), {}  # (device, slot) -> (micro-batch, stage)
    for t in range(sched.ticks):
        for s in range(sched.p):
            op, i = int(sched.op[t, s]), int(sched.mb[t, s])
            j = sched.stage(s, int(sched.chunk[t, s]))
            key = (s, int(plan.slot[t, s]))
            if op == ps.FORWARD and j == 0:
                assert key not in held, f"{sched.name} tick {t}: device 0 overwrites slot {key[1]}"
                held[key] = (i, 0)
            if op != ps.IDLE:
                assert held.get(key) == (i, j), f"{sched.name} tick {t} device {s}: slot {key[1]} holds {held.get(key)}"
            if op == ps.WEIGHT:
                del held[key]
        for s in range(sched.p):  # arrivals land at the end of the tick, after its reads
            for lane in range(plan.lanes):
                sender = int(plan.from_x[t, s, lane])
                if sender >= 0:
                    key = (s, int(plan.recv_x[t, s, lane]))
                    assert key not in held, f"{sched.name} tick {t}: an arrival on device {s} overwrites slot {key[1]}"
                    j = sched.stage(sender, int(sched.chunk[t, sender])) + 1
                    held[key] = (int(sched.mb[t, sender]), j)
    assert not held


@pytest.mark.parametrize("p,m", SHAPES)
def test_lockstep_zero_bubble_tables_run_f_and_b_in_lockstep_and_full_w_ticks(p, m):
    """cp > 1: no tick mixes kinds (forwards and B's hold the context strategy's collectives); ZB-H1's
    are lockstep 1F1B's forward and B ticks and m full W ticks, in its memory; the V's span no more in
    half stages, within 3p half-stage slots (lockstep 1F1B: 4p - 2)."""
    from pjax.parallel.pipeline.zero_bubble_lockstep import zb_h1_lockstep, zb_v_lockstep

    one_f_one_b = ps.one_f_one_b_lockstep(p, m)
    h1, v = zb_h1_lockstep(p, m), zb_v_lockstep(p, m)
    for sched, stages in ((h1, p), (v, 2 * p)):
        tick = ticks_of(sched)
        assert len(tick) == 3 * m * stages, sched.render()
        for (op, i, j), t in tick.items():
            deps = {ps.FORWARD: [(ps.FORWARD, i, j - 1)] if j > 0 else [],
                    ps.BACKWARD: [(ps.FORWARD, i, j)] + ([(ps.BACKWARD, i, j + 1)] if j < stages - 1 else []),
                    ps.WEIGHT: [(ps.BACKWARD, i, j)]}[op]
            assert all(tick[d] < t for d in deps), (sched.name, op, i, j)
        kinds = ps.tick_ops(sched)  # raises on a mixed tick
        assert np.all((sched.op == ps.IDLE) | (sched.op == kinds[:, None]))
        replay_slots(sched)
    w_ticks = ps.tick_ops(h1) == ps.WEIGHT
    assert w_ticks.sum() == m and np.all(h1.op[w_ticks] == ps.WEIGHT)
    assert h1.ticks == one_f_one_b.ticks + m  # (m + p - 1)(F + B) + m W against (m + p - 1)(F + B + W)
    assert buffer_plan(h1).slots == buffer_plan(one_f_one_b).slots
    assert v.span(1.0, 2.0) / 2 <= h1.span(1.0, 2.0) and buffer_plan(v).slots <= 3 * p


def test_pipelines_xla_cpu_cannot_compile_are_one_line_not_an_abort():
    """XLA:CPU aborts the process compiling these pipelines (an HLO check failure); the named fixes run."""
    import jax

    from mesh import MeshConfig
    from mesh.errors import ConfigError
    from models.precision import PrecisionConfig
    from pjax.config import PipelineConfig
    from pjax.validate import validate_run
    from test_pipeline_parallel import CFG, MICRO, TC

    tc = TC.__class__(**{**TC.__dict__, "batch_size": 4 * MICRO, "grad_accum": 4, "sequence_parallel": True, "dtype": "auto"})
    run = (MeshConfig(pp=2, tp=2), CFG, tc, PipelineConfig(schedule="zb_h1"))
    assert jax.default_backend() == "cpu"
    with pytest.raises(ConfigError, match="crashes XLA:CPU; on CPU use precision.preset=fp32"):
        validate_run(*run, precision=PrecisionConfig(preset="bf16"))
    validate_run(*run, precision=PrecisionConfig(preset="fp32"))
    one_f_one_b = (run[0], CFG, TC.__class__(**{**tc.__dict__, "sequence_parallel": False}), PipelineConfig())
    with pytest.raises(ConfigError, match="precision.grad_accum=bfloat16 on more than one device crashes XLA:CPU"):
        validate_run(*one_f_one_b, precision=PrecisionConfig(preset="bf16-lean", grad_accum="bfloat16"))
    validate_run(*one_f_one_b, precision=PrecisionConfig(preset="bf16-lean"))


def test_a_slot_pool_keeps_either_kind_in_a_slot_as_large_as_the_larger():
    import jax
    import jax.numpy as jnp

    from pjax.parallel.pipeline.slots import SlotPool

    residuals = (jax.ShapeDtypeStruct((3, 4), jnp.float32), jax.ShapeDtypeStruct((0,), jnp.float32),
                 jax.ShapeDtypeStruct((5,), jnp.bfloat16))
    stash = (jax.ShapeDtypeStruct((2, 2), jnp.float32), jax.ShapeDtypeStruct((7,), jnp.float32))
    pool = SlotPool((residuals, stash))
    assert pool.flat and pool.widths() == {"float32": 12, "bfloat16": 5}  # max(12, 11) and 5
    bufs = pool.zeros(3)
    assert {k: a.shape for k, a in bufs.items()} == {"float32": (3, 12), "bfloat16": (3, 5)}
    r = [jnp.arange(12.0).reshape(3, 4), jnp.zeros((0,)), jnp.ones(5, jnp.bfloat16)]
    bufs = pool.write(bufs, jnp.int32(1), 0, r)
    bufs = pool.write(bufs, jnp.int32(2), 0, [-a for a in r])
    for got, want in zip(pool.read(bufs, jnp.int32(1), 0), r):
        np.testing.assert_array_equal(got, want)
    w = [jnp.full((2, 2), 9.0), jnp.arange(7.0)]
    bufs = pool.write(bufs, jnp.int32(1), 1, w)  # slot 1 now holds the other kind; slot 2 is untouched
    for got, want in zip(pool.read(bufs, jnp.int32(1), 1), w):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(pool.read(bufs, jnp.int32(2), 0), r):
        np.testing.assert_array_equal(got, -want)
    # A kind-1 leaf kept from kind 0 (a projection's input is a residual) is read where kind 0 left
    # it, and the others go around it: [0, 12) and [12, 18) are the residuals, the stash fits in 18.
    residuals += (jax.ShapeDtypeStruct((6,), jnp.float32),)
    kept = SlotPool((residuals, (jax.ShapeDtypeStruct((2, 3), jnp.float32),) + stash), kept=(3, None, None))
    assert kept.written(1) == [1, 2] and kept.written(0) == [0, 1, 2, 3]
    assert kept.offsets(1) == [("float32", 12, 6), ("float32", 0, 4), ("float32", 4, 7)]
    assert kept.widths() == {"float32": 18, "bfloat16": 5}
    bufs = kept.write(kept.zeros(2), jnp.int32(1), 0, r + [jnp.arange(6.0) + 100])
    bufs = kept.write(bufs, jnp.int32(1), 1, w)
    for got, want in zip(kept.read(bufs, jnp.int32(1), 1), [(jnp.arange(6.0) + 100).reshape(2, 3)] + w):
        np.testing.assert_array_equal(got, want)
    one = SlotPool((residuals, ()))  # one kind: a buffer per leaf
    assert not one.flat and [a.shape for a in one.zeros(2).values()] == [(2, 3, 4), (2, 0), (2, 5), (2, 6)]
    got = one.read(one.write(one.zeros(2), jnp.int32(1), 0, r + [jnp.zeros(6)]), jnp.int32(1), 0)
    np.testing.assert_array_equal(got[0], r[0])
    # tp > 1: a buffer per leaf of each kind, so each keeps its tp split; the kept leaf is read
    # from kind 0's buffer and has none of its own.
    apart = SlotPool(kept.kinds, kept.kept, separate=True)
    assert not apart.flat and {k: a.shape for k, a in apart.zeros(2).items()} == {
        "0:0": (2, 3, 4), "0:1": (2, 0), "0:2": (2, 5), "0:3": (2, 6), "1:1": (2, 2, 2), "1:2": (2, 7)}
    bufs = apart.write(apart.zeros(2), jnp.int32(1), 0, r + [jnp.arange(6.0) + 100])
    bufs = apart.write(apart.write(bufs, jnp.int32(0), 0, [-a for a in r] + [jnp.zeros(6)]), jnp.int32(1), 1, w)
    for got, want in zip(apart.read(bufs, jnp.int32(1), 1), [(jnp.arange(6.0) + 100).reshape(2, 3)] + w):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(apart.read(bufs, jnp.int32(0), 0), r):  # slot 0 untouched
        np.testing.assert_array_equal(got, -want)


def test_with_tp_what_b_leaves_w_takes_over_residual_buffers_split_alike():
    """tp > 1: a cotangent B writes takes over the buffer of a residual of its shape, dtype and tp
    split that W does not read, each residual at most once; a split that is not known shares nothing."""
    import jax
    import jax.numpy as jnp

    from pjax.parallel.pipeline.slots import SlotPool

    S, f = jax.ShapeDtypeStruct, jnp.float32
    residuals = (S((4, 8), f), S((4, 8), f), S((4, 8), f), S((2,), f), S((4, 8), f))
    stash = (S((4, 8), f), S((4, 8), f), S((4, 8), f), S((2,), f), S((4, 8), f))
    whole, heads = (None, None), (None, "tp")
    splits = ((whole, heads, whole, None, heads), (None, heads, whole, (None,), heads))
    pool = SlotPool((residuals, stash), kept=(2, None, None, None, None), separate=True, splits=splits)
    # 0 is W's x (residual 2, kept); 1 and 4 split by heads: residual 1, then residual 4; 2 whole:
    # residual 0, not 2 (W reads it); 3's residual has no known split.
    assert pool.reused == {1: 1, 2: 0, 4: 4}
    assert sorted(pool.zeros(2)) == ["0:0", "0:1", "0:2", "0:3", "0:4", "1:3"]
    assert SlotPool((residuals, stash), kept=pool.kept, separate=True).reused == {}  # splits not known
    r = [jnp.arange(32.0).reshape(4, 8) + k for k in (0, 100, 200)] + [jnp.ones(2), -jnp.ones((4, 8))]
    w = [jnp.full((4, 8), k) for k in (1.0, 2.0)] + [jnp.arange(2.0), jnp.zeros((4, 8))]
    bufs = pool.write(pool.zeros(2), jnp.int32(0), 0, [-a for a in r])
    bufs = pool.write(pool.write(bufs, jnp.int32(1), 0, r), jnp.int32(1), 1, w)
    for got, want in zip(pool.read(bufs, jnp.int32(1), 1), [r[2]] + w):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(pool.read(bufs, jnp.int32(0), 0), r):  # slot 0's residuals untouched
        np.testing.assert_array_equal(got, -want)


def test_align_moves_the_probed_splits_onto_the_residuals_the_executor_stores():
    import jax
    import jax.numpy as jnp

    from pjax.parallel.pipeline.slot_splits import align

    S, f = jax.ShapeDtypeStruct, jnp.float32
    stored = [S((), f), S((3,), f), S((), f), S((4,), f)]
    assert align(stored, [S((3,), f), S((4,), f)], ["a", "b"]) == [None, "a", None, "b"]
    assert align(stored, [S((3,), f), S((5,), f)], ["a", "b"]) == [None] * 4  # not the same leaves


def test_what_b_leaves_w_keeps_the_projection_inputs_where_the_residuals_hold_them():
    """Each projection's input in B's taps is a residual, passed through unchanged (scanned: row by
    row through the scan): the slot keeps it in place and B writes only the output cotangents."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from mesh import MeshConfig, make_mesh
    from models.llama import init_params
    from pjax.parallel.pipeline.stage import VjpLayout, make_stage
    from pjax.spec import StepSpec
    from test_pipeline_parallel import CFG, TC

    mesh = make_mesh(MeshConfig(), jax.devices()[:1])  # make_stage reads the mesh
    layers = jax.tree.map(lambda a: a[:2], init_params(CFG, jax.random.key(0))["layers"])
    n = 16
    with jax.set_mesh(mesh):
        for scan in (False, True):
            stage = make_stage(StepSpec.build(CFG, dataclasses.replace(TC, scan_layers=scan)), 1.0)
            w, taps = stage.per_layer(layers), stage.per_layer(stage.taps(layers, n))
            act, positions = (jnp.zeros((n, CFG.hidden_size)), ()), jnp.arange(n).reshape(2, 8)
            layout = VjpLayout.trace(lambda w, act, taps: stage.layers(w, act, positions, taps), w, act, taps)
            kept = layout.passed_through(lambda res: layout.unpack(w, res)(act)[2])
            tap_leaves = jax.tree.leaves(taps)
            assert len(kept) == len(tap_leaves)
            found = [(tap_leaves[i].shape, layout.stored[k].shape) for i, k in enumerate(kept) if k is not None]
            # Per site (qkv, o, gate_up, down), the input x: per layer unrolled; scanned, the scan's
            # stack of its slices of a stacked residual, one [layers, n, width] each.
            assert len(found) == (4 if scan else 2 * 4) and all(a == b for a, b in found)


@pytest.mark.parametrize("p,m", SHAPES)
def test_zb_v_runs_every_item_once_in_order_in_a_v_within_1f1bs_memory(p, m):
    from test_pipeline_parallel import replay_buffer_plan

    sched = zb_v(p, m)
    last = 2 * p - 1
    # The V: device s holds model stages s and 2p - 1 - s.
    assert [(sched.stage(s, 0), sched.stage(s, 1)) for s in range(p)] == [(s, last - s) for s in range(p)]
    assert all(sched.device_of(sched.stage(s, c)) == s for s in range(p) for c in (0, 1))
    tick = ticks_of(sched)
    assert len(tick) == 3 * m * 2 * p, sched.render()
    for (op, i, j), t in tick.items():
        deps = {ps.FORWARD: [(ps.FORWARD, i, j - 1)] if j > 0 else [],
                ps.BACKWARD: [(ps.FORWARD, i, j)] + ([(ps.BACKWARD, i, j + 1)] if j < last else []),
                ps.WEIGHT: [(ps.BACKWARD, i, j)]}[op]
        assert all(tick[d] < t for d in deps), (op, i, j)
    # A slot (arrival to W) holds half a stage: never more than 1F1B's p whole stages.
    plan = buffer_plan(sched)
    assert plan.slots <= 2 * buffer_plan(ps.one_f_one_b(p, m)).slots
    if p > 1 and m > 1:  # the last device receives from the one before it and from itself at once
        assert plan.lanes == 2
    replay_buffer_plan(sched)
    # Every device busy 6m ticks of half a stage; the last device waits p - 1 ticks for its first
    # input, so no table is shorter than 6m + p - 1; played out under the memory limit it takes
    # exactly that once there are as many micro-batches as devices, and with fewer, less than
    # ZB-H1's ticks of whole stages counted in half stages.
    if m >= p:
        assert sched.ticks == 6 * m + p - 1, sched.render()
        assert sched.bubble_fraction() == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
    else:
        assert 6 * m + p - 1 < sched.ticks < 2 * zb_h1(p, m).ticks


def test_zb_v_bubble_for_the_layouts_we_run():
    """The bound 6m + p - 1 for the (p, m) the benchmarks and a user at p = 8 run, which the
    property test's shapes do not reach."""
    for p, m in [(2, 32), (4, 64), (8, 32), (8, 64), (16, 16), (16, 48)]:
        assert zb_v(p, m).ticks == 6 * m + p - 1, (p, m)
    text = zb_v(2, 2).render()
    assert text.splitlines()[0] == "zb_v: p=2 m=2 v=2, 13 ticks, bubble 0.077"
