"""Dropless expert parallelism by ragged all-to-all (models/ragged_dispatch.py): the CPU stand-in is the
collective JAX documents, the exchange plan is the receive rule written as a loop, and a capped receive
buffer drops exactly the assignments that rule cuts, nothing else moving. (Uncapped, the ragged layer equals
one device: tests/test_moe.py's expert-parallel cases run it, in the layer and in the training step.)"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mesh import MeshConfig, make_mesh
from models import moe, ragged_dispatch as rd
from test_moe import N, layer  # the same small layer

E, K = 8, 2  # experts, top-k (N tokens over all devices, and the layer: test_moe's)


def stand_in(n: int, max_send: int):
    """The stand-in over n devices, each device's arguments stacked on a leading axis."""
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])

    def one(operand, output, *ints):
        return rd.dense_stand_in(operand[0], output[0], *(a[0] for a in ints), "x", max_send)[None]

    return jax.jit(jax.shard_map(one, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def documented(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """`jax.lax.ragged_all_to_all`'s docstring pseudocode, one slice per device, devices stacked."""
    n = operand.shape[0]
    result = np.array(output)
    for src in range(n):
        for dst in range(n):
            size = send_sizes[src][dst]
            assert size == recv_sizes[dst][src]  # the operation's precondition
            at = output_offsets[src][dst]
            result[dst][at:at + size] = operand[src][input_offsets[src][dst]:input_offsets[src][dst] + size]
    return result


def test_the_stand_in_gives_the_documented_example():
    """The example in `ragged_all_to_all`'s docstring, axis of size 2."""
    args = [np.array(a, dtype=np.float32 if i < 2 else np.int32) for i, a in enumerate((
        [[1, 2, 2], [3, 4, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]], [[0, 1], [0, 1]], [[1, 2], [1, 1]],
        [[0, 0], [1, 2]], [[1, 1], [2, 1]]))]
    got = stand_in(2, 3)(*(a[..., None] if i < 2 else a for i, a in enumerate(args)))[..., 0]
    np.testing.assert_array_equal(np.asarray(got), [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_the_stand_in_equals_the_documented_semantics_on_random_slices():
    """Four devices, random sizes, gaps and offsets: every written row is the sent one, every other row is
    `output`'s own."""
    rng = np.random.default_rng(0)
    n, rows, out_rows = 4, 12, 20
    sizes = rng.integers(0, 4, (n, n))  # sizes[src, dst]
    input_offsets = np.stack([rng.integers(0, rows - sizes[s].max() + 1, n) for s in range(n)])
    gaps = rng.integers(0, 2, (n, n))  # receivers leave gaps between senders' slices
    starts = np.cumsum(sizes + gaps, axis=0) - (sizes + gaps)  # [src, dst]: where src lands on dst
    operand = rng.normal(size=(n, rows, 3)).astype(np.float32)
    output = rng.normal(size=(n, out_rows, 3)).astype(np.float32)
    ints = [a.astype(np.int32) for a in (input_offsets, sizes, starts, sizes.T)]
    want = documented(operand, output, *ints)
    got = np.asarray(stand_in(n, int(sizes.max()))(operand, output, *ints))
    np.testing.assert_array_equal(got, want)


def plan_by_loop(counts: np.ndarray, me: int, capacity: int) -> dict[str, np.ndarray]:
    """The receive rule as a loop: receiver j takes sender 0's run, then sender 1's, ... until it holds
    `capacity` rows; a run it cannot take whole loses its tail (its last experts' rows)."""
    n, e = counts.shape
    local = e // n
    taken = np.zeros((n, n), int)
    runs = np.zeros((n, local), int)  # what me keeps from each sender, per local expert
    for j in range(n):
        room = capacity
        for i in range(n):
            want = counts[i, j * local:(j + 1) * local]
            take = min(room, want.sum())
            taken[i, j], room = take, room - take
            if j == me:
                left = take
                for l in range(local):
                    runs[i, l], left = min(left, want[l]), left - min(left, want[l])
    send = counts[me].reshape(n, local).sum(-1)
    return {"send_offsets": np.cumsum(send) - send, "send_sizes": taken[me],
            "remote_offsets": np.array([taken[:me, j].sum() for j in range(n)]),
            "recv_offsets": np.cumsum(taken[:, me]) - taken[:, me], "recv_sizes": taken[:, me], "runs": runs}


@pytest.mark.parametrize("n,capacity", [(2, 64), (4, 12), (4, 5), (8, 3)], ids=["n2_all", "n4_cap12", "n4_cap5", "n8_cap3"])
def test_the_exchange_plan_is_the_receive_rule(n, capacity):
    counts = np.random.default_rng(n + capacity).integers(0, 4, (n, E))
    plan = jax.jit(rd.exchange_plan, static_argnums=2)
    for me in range(n):
        got = plan(jnp.asarray(counts, jnp.int32), jnp.int32(me), capacity)._asdict()
        for key, want in plan_by_loop(counts, me, capacity).items():
            np.testing.assert_array_equal(np.asarray(got[key]), want, err_msg=f"{key} on device {me}")


def test_the_receive_bound_never_drops_and_its_cap_is_a_share():
    assert rd.receive_rows(16, 2, 4, None) == 4 * 16 * 2  # every device's every assignment
    assert rd.receive_rows(16, 2, 4, 1.25) == 40
    assert rd.receive_rows(16, 2, 4, 100.0) == 128  # never past the bound


def test_fine_grained_experts_over_8_devices_equal_the_dense_reference():
    """64 experts, top-8, 8 per device: each device's runs hold several local experts, some of them empty. The
    output and every gradient equal one device's dense reference, without the top-k renormalisation too."""
    x, p = layer(64)

    def grads(routing, dp, normalize):
        def f(x, p):
            y, stats = moe.moe_mlp(x, p, top_k=8, config=moe.MoeConfig(routing), normalize=normalize)
            return jnp.sum(y * jnp.sin(y)), (y, stats.dropped)
        with jax.set_mesh(make_mesh(MeshConfig(dp=dp, ep=dp), jax.devices()[:dp])):
            (_, (y, dropped)), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, p)
        return jax.tree.map(np.asarray, (y, g)), float(dropped)

    for normalize in (True, False):
        want, _ = grads("dense", 1, normalize)
        got, dropped = grads("dropless", 8, normalize)
        assert dropped == 0
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.abs(w).max())


@functools.cache
def capped_layer(dp: int, factor: float):
    x, p = layer(E)
    run = jax.jit(lambda x, p: moe.moe_mlp(x, p, top_k=K, config=moe.MoeConfig(receive_factor=factor)))
    with jax.set_mesh(make_mesh(MeshConfig(dp=dp, ep=dp), jax.devices()[:dp])):
        y, stats = run(x, p)
    return np.asarray(y), float(stats.dropped)


def kept_by_rule(dp: int, factor: float) -> np.ndarray:
    """[N, K] which assignments the receive rule keeps: each device's tokens are a block of N/dp; a device's
    assignments go sorted by expert (ties in token, then choice, order)."""
    x, p = layer(E)
    _, experts, _ = moe.route(jnp.asarray(x), jnp.asarray(p["router"]), moe.Router(K))
    experts = np.asarray(experts).reshape(dp, N // dp * K)
    counts = np.stack([np.bincount(e, minlength=E) for e in experts])
    capacity = rd.receive_rows(N // dp, K, dp, factor)
    kept = np.zeros_like(experts, bool)
    for me in range(dp):
        plan = plan_by_loop(counts, me, capacity)
        order = np.argsort(experts[me], kind="stable")
        owner = experts[me][order] // (E // dp)
        place = np.arange(order.size) - plan["send_offsets"][owner]
        kept[me][order] = place < plan["send_sizes"][owner]
    return kept.reshape(N, K)


@pytest.mark.parametrize("dp,factor", [(4, 1.0), (4, 0.5), (8, 1.0)], ids=["dp4_share1", "dp4_share0.5", "dp8_share1"])
def test_a_capped_receive_buffer_drops_exactly_what_the_rule_cuts(dp, factor):
    """The output is the dense reference's over the kept assignments (the cut ones pass through the residual),
    and `dropped` counts them."""
    kept = kept_by_rule(dp, factor)
    y, dropped = capped_layer(dp, factor)
    x, p = layer(E)
    weights, experts, _ = moe.route(jnp.asarray(x), jnp.asarray(p["router"]), moe.Router(K))
    want = np.asarray(jax.jit(moe.dense_experts)(jnp.asarray(x), weights * kept, experts,
                                                  {k: jnp.asarray(v) for k, v in p.items() if k != "router"}))
    assert dropped == (~kept).sum() > 0
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_run_says_once_when_its_capped_receive_buffer_drops():
    """`RunReport`'s check: one warning line the first time a dropless step drops, none for capacity routing
    (which drops by design) or while nothing is dropped."""
    import types

    from pjax.observe.report import RunReport

    def said(routing, fractions):
        lines = []
        report = types.SimpleNamespace(cfg=types.SimpleNamespace(moe=moe.MoeConfig(routing, receive_factor=1.0)),
                                       drops_said=False, bar=types.SimpleNamespace(warn=lines.append))
        for step, fraction in enumerate(fractions, 1):
            RunReport._warn_on_dropless_drops(report, step, {"dropped_fraction": np.float32(fraction)})
        return lines

    lines = said("dropless", [0.0, 0.03, 0.05])
    assert len(lines) == 1 and lines[0].startswith("warning: step 2: moe.receive_factor=1.0 dropped 3.00%")
    assert said("capacity", [0.1, 0.2]) == [] and said("dropless", [0.0, 0.0]) == []
