"""The precision policy: presets against fp32 on the shipped text, the fp32 and bf16 presets the very
programs `train.dtype` alone compiles, per-module overrides where the dots show them, bf16 moments at
half their bytes in the compiled step, and one line for each invalid combination."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mesh import MeshConfig, make_mesh
from mesh.errors import ConfigError
from models.config import LlamaConfig
from models.precision import PRESETS, Precision, PrecisionConfig
from pjax.config import TrainConfig
from pjax.config_io import load_config
from pjax.optim import stored_in
from pjax.step import build_trainer
from pjax.train import train
from test_step import _dots

CFG = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)
TC = TrainConfig(seq_len=16, batch_size=4, grad_accum=2, steps=10, warmup_steps=2)
STEPS = 50
# Loss after STEPS steps on the shipped text, relative to fp32's (measured: benchmarks/README.md, "Precision presets";
# here bf16 3.9e-5, bf16-lean 8.2e-5, fp8 against bf16 2.7e-4), where 10 steps fewer learning is 1.6% (measured).
# preset: (reference preset, relative tolerance of the loss after STEPS steps)
TOLERANCE = {"bf16": ("fp32", 0.002), "bf16-lean": ("fp32", 0.002), "fp8": ("bf16", 0.005)}


def preset_config(preset: str, tmp: str):
    return load_config("debug", [
        "mesh.dp=1", "mesh.tp=1", f"train.steps={STEPS}", "train.seq_len=64", "train.batch_size=8", "train.dtype=auto",
        "log.every=10", "log.eval_every=0", f"log.dir={tmp}/{preset}", f"data.cache_dir={tmp}/cache",
        f"precision.preset={preset}"])


@functools.cache
def preset_run(preset: str, tmp: str) -> tuple[dict, ...]:
    """The records of STEPS steps of the debug model on the shipped text under `preset`, on one device."""
    return tuple(train(preset_config(preset, tmp), progress=False, devices=jax.devices()[:1]))


def final_loss(preset: str, tmp: str) -> float:
    return preset_run(preset, tmp)[-1]["loss"]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("precision"))


@pytest.mark.parametrize("preset", sorted(TOLERANCE))
def test_preset_learns_the_text_like_its_reference(preset, tmp):
    reference, tolerance = TOLERANCE[preset]
    ref, loss = final_loss(reference, tmp), final_loss(preset, tmp)
    assert ref < 7.0, ref  # it learned: ln(4096) = 8.3 at the start
    assert abs(loss - ref) <= tolerance * ref, (preset, loss, reference, ref)


def lowered(tc: TrainConfig, precision: PrecisionConfig = PrecisionConfig(), mesh=None) -> str:
    trainer = build_trainer(mesh or make_mesh(MeshConfig(), jax.devices()[:1]), CFG, tc, precision=precision)
    with jax.set_mesh(trainer.mesh):
        return trainer.step.jitted.lower(trainer.abstract_state(), trainer.abstract_batch()).as_text()


@pytest.mark.parametrize("dtype,preset", [("float32", "fp32"), ("bfloat16", "bf16")])
def test_preset_is_the_program_train_dtype_compiles(dtype, preset):
    tc = TrainConfig(**{**TC.__dict__, "dtype": dtype})
    auto = TrainConfig(**{**TC.__dict__, "dtype": "auto"})
    assert lowered(tc) == lowered(auto, PrecisionConfig(preset=preset))


def dot_dtypes(precision: Precision) -> dict[tuple, set]:
    """Operand dtypes of the 2-D dots of one loss gradient, by the right operand's shape (CFG's weights:
    wk, wv [32, 16]; w_gate, w_up [32, 64]; w_down [64, 32]); 24 tokens, a size no weight has."""
    from models import llama
    from pjax.spec import StepSpec

    params = jax.eval_shape(lambda: llama.init_params(CFG, jax.random.key(0)))  # a jaxpr needs only shapes
    micro = {k: jnp.zeros((3, 8), jnp.int32) for k in ("inputs", "labels", "positions")}
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: StepSpec(CFG, precision).loss_sum(p, micro)[0]))(params).jaxpr
    found: dict[tuple, set] = {}
    for eqn in _dots(jaxpr):
        if all(v.aval.ndim == 2 for v in eqn.invars):
            found.setdefault(tuple(eqn.invars[1].aval.shape), set()).update(v.aval.dtype for v in eqn.invars)
    return found


def test_a_module_kind_set_apart_from_its_preset_computes_in_its_own_dtype():
    policy = PrecisionConfig(preset="bf16", mlp="float32").resolve()
    assert policy.attention == jnp.bfloat16 and policy.mlp == jnp.float32 and policy.norms == jnp.float32
    dots = dot_dtypes(policy)
    assert dots[(32, 64)] == dots[(64, 32)] == {jnp.dtype(jnp.float32)}, dots
    assert dots[(32, 16)] == {jnp.dtype(jnp.bfloat16)}, dots


def test_bf16_moments_halve_their_bytes_in_the_compiled_step(tmp):
    """The argument bytes of the step `train` compiled for the preset runs above: on CPU their metrics
    report the compiled step's `memory_analysis().argument_size_in_bytes` as the memory in use."""
    from models import llama

    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    args = {}
    for preset in ("bf16", "bf16-lean"):
        cfg = preset_config(preset, tmp)
        trainer = build_trainer(mesh, cfg.model, cfg.train, precision=cfg.precision)
        mu = [a for a in jax.tree.leaves(trainer.abstract_state().opt_state) if a.ndim > 0]
        assert {a.dtype for a in mu} == {jnp.dtype(PRESETS[preset]["optimizer_state"])}
        record = preset_run(preset, tmp)[-1]
        assert record["memory_source"] == "compiled", record
        args[preset] = record["memory_in_use_bytes"]
    shapes = jax.eval_shape(lambda: llama.init_params(cfg.model, jax.random.key(0)))
    params = sum(a.size for a in jax.tree.leaves(shapes))
    assert args["bf16"] - args["bf16-lean"] == 2 * 2 * params  # two moments, 4 -> 2 bytes each


def test_stored_in_bf16_rounds_the_fp32_update_once_per_step():
    inner = optax.adam(1e-2)
    params = {"w": jnp.linspace(-1.0, 1.0, 8)}
    grads = {"w": jnp.linspace(0.5, -0.3, 8)}
    opt = stored_in(inner, jnp.bfloat16)
    state = opt.init(params)
    updates, new = opt.update(grads, state, params)
    ref_updates, ref = inner.update(grads, jax.tree.map(
        lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, state), params)
    np.testing.assert_array_equal(updates["w"], ref_updates["w"])
    assert new[0].mu["w"].dtype == jnp.bfloat16 and new[0].count.dtype == jnp.int32
    np.testing.assert_array_equal(new[0].nu["w"], ref[0].nu["w"].astype(jnp.bfloat16))


@pytest.mark.parametrize("keys,names", [
    (["precision.preset=fp16"], "precision.preset"),
    (["precision.mlp=float16"], "precision.mlp"),
    (["precision.preset=bf16", "train.dtype=float32"], "train.dtype=float32 and precision.preset=bf16 disagree"),
])
def test_invalid_precision_is_one_line(keys, names):
    with pytest.raises(ConfigError) as err:
        cfg = load_config("debug", keys)
        cfg.precision.resolve(cfg.train.dtype)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_fp32_moments_resume_as_bf16_with_a_note(tmp, capsys):
    """A checkpoint saved with fp32 moments continues under precision.optimizer_state=bfloat16: the
    restore rounds each moment to bf16, and the run says so in one line."""
    from pjax.checkpoint.checkpointer import Checkpointer

    # The preset runs' shapes and schedule: the fp32 run compiles the step the fp32 preset run compiled.
    common = ["mesh.dp=1", "mesh.tp=1", "train.seq_len=64", "train.batch_size=8", f"train.schedule_steps={STEPS}",
              "train.dtype=auto", "log.every=1", "log.eval_every=0",
              f"log.dir={tmp}/resume", f"data.cache_dir={tmp}/cache", f"checkpoint.dir={tmp}/resume/ckpt"]
    train(load_config("debug", common + ["train.steps=2"]), progress=False, devices=jax.devices()[:1])
    lean = load_config("debug", common + ["train.steps=3", "precision.optimizer_state=bfloat16"])
    assert train(lean, progress=False, devices=jax.devices()[:1])[-1]["step"] == 3
    assert "moments in float32 and this run in bfloat16" in capsys.readouterr().out
    saved = load_config("debug", common)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    fp32, bf16 = (build_trainer(mesh, c.model, c.train, precision=c.precision) for c in (saved, lean))
    with Checkpointer(f"{tmp}/resume/ckpt", read_only=True) as ckpt:
        want = ckpt.restore(fp32, saved, step=2).state.opt_state
        got = ckpt.restore(bf16, lean, step=2).state.opt_state
    floats = [(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)) if g.ndim > 0]
    assert floats and all(g.dtype == jnp.bfloat16 for g, _ in floats)
    for g, w in floats:
        np.testing.assert_array_equal(g, w.astype(jnp.bfloat16))


def test_the_planner_counts_moments_and_accumulator_in_their_dtypes():
    from pjax.plan.layouts import Layout, state_bytes

    layout = Layout(dp=2, pp=1, cp=1, tp=2, zero=1)
    full = state_bytes(load_config("debug", []), layout)
    lean = state_bytes(load_config("debug", ["precision.preset=bf16-lean", "precision.grad_accum=bfloat16"]), layout)
    assert lean["params"] == full["params"]
    assert 2 * lean["opt_state"] == full["opt_state"] and 2 * lean["grads"] == full["grads"]


def test_a_bf16_gradient_accumulator_sums_in_bf16_on_one_device():
    """precision.grad_accum=bfloat16 (in no preset): the micro-batch sum is bf16 (the gradients move), within
    bf16 rounding of fp32's."""
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    batch = {k: jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 2, 16)), jnp.int32)
             for k in ("inputs", "labels")}
    batch["positions"] = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 2, 16))
    grads, params = {}, None
    for accum in ("float32", "bfloat16"):
        trainer = build_trainer(mesh, CFG, TC, precision=PrecisionConfig(preset="bf16", grad_accum=accum))
        if params is None:  # any weights (both sums take the same): drawn here, no init to compile
            rng = np.random.default_rng(1)
            params = jax.tree.map(lambda a: (0.05 * rng.normal(size=a.shape)).astype(a.dtype),
                                  trainer.abstract_state().params)
        grads[accum] = trainer.grads(params, batch)[1]
    assert any(bool(jnp.any(g != r)) for g, r in zip(jax.tree.leaves(grads["bfloat16"]), jax.tree.leaves(grads["float32"])))
    for g, r in zip(jax.tree.leaves(grads["bfloat16"]), jax.tree.leaves(grads["float32"])):
        assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))) <= 2 ** -7 * float(jnp.max(jnp.abs(r)))
