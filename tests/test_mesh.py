"""The 4D mesh: axis order, ep inside dp, rp outside it (ZeRO's shard groups), dp=-1, logical rules, and every
validation error's sentence."""
import jax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from mesh import (AXES, ConfigError, MeshConfig, logical_to_spec, make_mesh, mesh_summary, param_rules, validate_batch,
                  validate_model)


def test_mesh_axes_are_rp_dp_ep_pp_cp_tp_with_tp_innermost():
    mesh = make_mesh(MeshConfig(dp=2, pp=1, cp=2, tp=2))
    assert mesh.axis_names == AXES == ("rp", "dp", "ep", "pp", "cp", "tp")
    assert dict(mesh.shape) == {"rp": 1, "dp": 2, "ep": 1, "pp": 1, "cp": 2, "tp": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    ids = [[d.id for d in row] for row in mesh.devices.reshape(-1, 2)]
    # tp innermost: devices that differ only in their tp coordinate are neighbours.
    assert ids[0] == [0, 1] and ids[1] == [2, 3]


def test_ep_splits_dp_innermost_so_data_order_is_unchanged():
    mesh = make_mesh(MeshConfig(dp=4, tp=2, ep=2))
    assert dict(mesh.shape) == {"rp": 1, "dp": 2, "ep": 2, "pp": 1, "cp": 1, "tp": 2}
    # device d's data-replica index is dp * ep + its ep coordinate, as it was before ep split dp
    ids = mesh.devices.reshape(4, 2)
    assert [[d.id for d in row] for row in ids] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert MeshConfig.of(mesh) == MeshConfig(dp=4, tp=2, ep=2)
    assert mesh_summary(mesh).startswith("mesh dp=4 (ep=2) pp=1 cp=1 tp=2")


def test_zero_shard_groups_split_dp_outermost_so_data_order_is_unchanged():
    """HSDP: dp 8 in ZeRO groups of 4 (2 copies), an expert group of 2 inside each."""
    mesh = make_mesh(MeshConfig(dp=8, ep=2), zero_shard=4)
    assert dict(mesh.shape) == {"rp": 2, "dp": 2, "ep": 2, "pp": 1, "cp": 1, "tp": 1}
    assert [d.id for d in mesh.devices.flat] == list(range(8))  # data index = (rp * dp + dp) * ep + ep
    assert MeshConfig.of(mesh) == MeshConfig(dp=8, ep=2)
    assert mesh_summary(mesh).startswith("mesh dp=8 (ep=2; ZeRO over 4, 2 copies) pp=1")


def test_ep_defaults_to_the_largest_split_the_experts_allow():
    assert MeshConfig(dp=8).with_experts(8).ep == 8  # today's: every dp device its own experts
    assert MeshConfig(dp=16, tp=8).with_experts(8).ep == 8  # Mixtral at 128 GPUs: copied over 2 replicas
    assert MeshConfig(dp=8).with_experts(0).ep == 0  # dense: one expert group of one device
    assert MeshConfig(dp=8, ep=2).with_experts(8).ep == 2  # a set ep is kept
    assert dict(make_mesh(MeshConfig(dp=8), num_experts=6).shape)["ep"] == 2


def test_dp_minus_one_fills_remaining_devices():
    mesh = make_mesh(MeshConfig(dp=-1, tp=2))
    assert mesh.shape["dp"] == 4
    assert MeshConfig(dp=-1, cp=2, tp=2).resolve(8).dp == 2


def test_subset_of_devices():
    mesh = make_mesh(MeshConfig(dp=1), jax.devices()[:1])
    assert mesh.devices.size == 1


def test_rules_map_logical_names_to_mesh_axes():
    assert logical_to_spec(("embed", "heads", "head_dim")) == P(None, "tp", None)
    assert logical_to_spec(("vocab", "embed")) == P("tp", None)
    assert logical_to_spec(("tokens", "embed")) == P(("rp", "dp", "ep", "cp"), None)
    assert logical_to_spec(("batch", "sequence")) == P(("rp", "dp", "ep"), "cp")
    assert logical_to_spec(("embed", "mlp"), param_rules(zero_sharded=True)) == P(("dp", "ep"), "tp")
    assert logical_to_spec(("experts", "embed", "mlp")) == P("ep", None, "tp")
    with pytest.raises(KeyError, match="no rule"):
        logical_to_spec(("nonsense",))


def test_error_mesh_product_differs_from_device_count():
    with pytest.raises(ConfigError, match=r"mesh dp\*pp\*cp\*tp = 2\*1\*1\*2 = 4 but 8 devices are available"):
        make_mesh(MeshConfig(dp=2, tp=2))


def test_error_mesh_product_does_not_divide_devices():
    with pytest.raises(ConfigError, match="does not divide the 8 available devices"):
        make_mesh(MeshConfig(dp=-1, tp=3))


def test_error_negative_axis_size():
    with pytest.raises(ConfigError, match="mesh.tp=-1 is invalid"):
        MeshConfig(tp=-1).resolve(8)


MODEL = dict(num_layers=4, num_heads=8, num_kv_heads=4, hidden_size=256, intermediate_size=688, vocab_size=4096)


def test_error_heads_not_divisible_by_tp():
    with pytest.raises(ConfigError, match="model.num_attention_heads=6 is not divisible by mesh.tp=4"):
        validate_model(MeshConfig(dp=2, tp=4), **{**MODEL, "num_heads": 6, "num_kv_heads": 2})


def test_error_kv_heads_not_divisible_by_tp():
    with pytest.raises(ConfigError, match="model.num_key_value_heads=2 is not divisible by mesh.tp=4"):
        validate_model(MeshConfig(dp=2, tp=4), **{**MODEL, "num_kv_heads": 2})


def test_error_layers_not_divisible_by_pp():
    with pytest.raises(ConfigError, match="model.num_hidden_layers=4 is not divisible by mesh.pp=3"):
        validate_model(MeshConfig(dp=1, pp=3), **MODEL)


def test_error_hidden_not_divisible_by_dp_under_zero():
    with pytest.raises(ConfigError, match="model.hidden_size=256 is not divisible by mesh.dp=3"):
        validate_model(MeshConfig(dp=3), **MODEL, zero=3)


def test_error_ep_that_does_not_divide_dp():
    with pytest.raises(ConfigError, match="mesh.ep=3 does not divide mesh.dp=4"):
        MeshConfig(dp=4, tp=2, ep=3).resolve(8)


@pytest.mark.parametrize("experts,ep,match", [
    (8, 3, "model.num_local_experts=8 is not divisible by mesh.ep=3"),
    (0, 2, "mesh.ep=2 splits a mixture of experts, but this model has none"),
])
def test_error_ep_that_does_not_split_the_experts(experts, ep, match):
    with pytest.raises(ConfigError, match=match):
        validate_model(MeshConfig(dp=6, ep=ep), **{**MODEL, "hidden_size": 240}, num_experts=experts)


def test_error_bad_zero_level():
    with pytest.raises(ConfigError, match="train.zero=2 is invalid"):
        validate_model(MeshConfig(dp=2), **MODEL, zero=2)


def test_error_sequence_not_divisible_by_two_cp():
    with pytest.raises(ConfigError, match=r"train.seq_len=100 is not divisible by 2\*mesh.cp = 8"):
        validate_batch(MeshConfig(dp=1, cp=4), batch_size=8, grad_accum=1, seq_len=100)


def test_error_batch_not_divisible_by_dp():
    with pytest.raises(ConfigError, match=r"train.batch_size=12 is not divisible by train.grad_accum\*mesh.dp = 1\*8"):
        validate_batch(MeshConfig(dp=8), batch_size=12, grad_accum=1, seq_len=64)


def test_error_batch_not_divisible_by_micro_batches_times_dp():
    with pytest.raises(ConfigError, match=r"train.grad_accum\*mesh.dp = 4\*2"):
        validate_batch(MeshConfig(dp=2), batch_size=12, grad_accum=4, seq_len=64)


def test_pipeline_cpu_threads_only_for_pipelines_and_never_over_the_user(monkeypatch):
    import os

    from mesh.distributed import THREAD_POOL_ENV, pipeline_cpu_threads

    for var in (THREAD_POOL_ENV, "NPROC"):
        monkeypatch.delenv(var, raising=False)
    assert pipeline_cpu_threads(MeshConfig(dp=2, tp=2), 4) is None and THREAD_POOL_ENV not in os.environ
    cores = len(os.sched_getaffinity(0))
    n = pipeline_cpu_threads(MeshConfig(pp=2), 2)
    assert n == max(cores + 1, 4) and os.environ[THREAD_POOL_ENV] == str(n)  # a thread more than the cores
    monkeypatch.delenv(THREAD_POOL_ENV)
    n = pipeline_cpu_threads(MeshConfig(dp=2, pp=2, tp=2), 8)
    assert n == max(cores + 1, 16) and os.environ[THREAD_POOL_ENV] == str(n)  # two threads per device
    monkeypatch.setenv(THREAD_POOL_ENV, "5")
    assert pipeline_cpu_threads(MeshConfig(pp=2), 2) is None and os.environ[THREAD_POOL_ENV] == "5"
    monkeypatch.delenv(THREAD_POOL_ENV)
    monkeypatch.setenv("NPROC", "3")
    assert pipeline_cpu_threads(MeshConfig(pp=4), 4) is None and THREAD_POOL_ENV not in os.environ


def _on_hosts(shape: dict[str, int], per_host: int):
    """A mesh-like view of consecutive devices on hosts of `per_host` (what `jax.make_mesh` lays out on a pod)."""
    import types

    import numpy as np

    n = int(np.prod(list(shape.values())))
    devices = np.array([types.SimpleNamespace(id=i, process_index=i // per_host, platform="gpu") for i in range(n)],
                       dtype=object).reshape(tuple(shape.values()))
    return types.SimpleNamespace(devices=devices, axis_names=tuple(shape), shape=dict(shape))


def test_the_axes_that_cross_hosts_are_the_outer_ones_and_a_tp_across_hosts_is_one_line():
    from mesh import hosts

    sizes = lambda **kw: {"rp": 1, "dp": 1, "ep": 1, "pp": 1, "cp": 1, "tp": 1, **kw}  # noqa: E731
    assert hosts.axes_across_hosts(_on_hosts(sizes(dp=4, tp=2), 4)) == ("dp",)
    assert hosts.across_hosts_line(_on_hosts(sizes(dp=4, tp=2), 4)) == "across hosts: dp"
    # 8 per host: tp 8 inside; pp 2 across with dp (the experts over ep 2, outside pp, across too)
    wide = _on_hosts(sizes(dp=4, ep=2, pp=2, tp=8), 8)
    assert hosts.axes_across_hosts(wide) == ("dp", "ep", "pp")
    assert hosts.across_hosts_line(wide) == "across hosts: dp, ep, pp"
    assert hosts.across_hosts_line(_on_hosts(sizes(rp=2, dp=4), 4)) == "across hosts: dp"  # HSDP: a group a host
    assert hosts.across_hosts_line(_on_hosts(sizes(dp=8), 8)) is None  # one host
    with pytest.raises(ConfigError, match="mesh.tp=8 spans hosts of 4 devices"):
        hosts.check_tp(_on_hosts(sizes(tp=8), 4), allowed=False)
    hosts.check_tp(_on_hosts(sizes(tp=8), 4), allowed=True)
    hosts.check_tp(_on_hosts(sizes(dp=2, tp=4), 4), allowed=False)
