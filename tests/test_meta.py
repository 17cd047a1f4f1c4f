"""Meta-learning (`meta.*`, pjax/parallel/meta.py): Reptile with one task and one inner step is SGD; MAML's
meta-gradient is the derivative of the adapted loss (a finite-difference check) and first-order MAML's is not;
the dp groups adapt to their tasks in parallel exactly as one device does them in turn, for every algorithm
on dp2 x tp2; each group's rows hold its task; a resume continues bit for bit."""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh.errors import ConfigError
from mesh.mesh import make_mesh
from pjax import assets
from pjax.config_io import load_config
from pjax.data.batches import read_windows
from pjax.data.tasks import TaskIterator, build_tasks
from pjax.data.text import load_tokenizer, load_tokens
from pjax.parallel import outer
from pjax.train import train
from pjax.validate import validate_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import random_batch, trainer_for  # noqa: E402
from closeness import assert_close_but_a_few  # noqa: E402
from run_helpers import preempted_after  # noqa: E402

SMALL = ["train.batch_size=8", "train.seq_len=32", "train.dtype=float32", "train.grad_clip=0"]


def _meta(algorithm: str, steps: int = 1, tasks: int = 2) -> list[str]:
    query = 0 if algorithm == "reptile" else 1
    return [f"meta.algorithm={algorithm}", f"meta.inner_steps={steps}", f"train.grad_accum={steps + query}",
            f"meta.tasks=[{','.join(f'task{i}.txt' for i in range(tasks))}]"]


def _trainer(overrides: list[str]):
    return trainer_for("debug", [*SMALL, *overrides])


def _on(trainer, fn, *args):
    with jax.set_mesh(trainer.mesh):
        return jax.jit(fn)(*args)


def test_reptile_with_one_task_and_one_inner_step_is_sgd():
    """Outer lr 1 without momentum: params - (params - adapted) = params - inner_lr * gradient (dp1 x tp2)."""
    _, trainer = _trainer(["mesh.dp=1", "mesh.tp=2", *_meta("reptile", tasks=1), "train.outer_lr=1.0",
                           "train.outer_momentum=0", "meta.inner_lr=0.5"])
    state, batch = trainer.init(jax.random.key(0)), random_batch(trainer)
    _, grads = trainer.grads(state.params, batch)
    want = jax.tree.map(lambda p, g: np.asarray(p) - 0.5 * np.asarray(g), state.params, grads)
    new, metrics = trainer.step(state, batch)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-7)
    assert float(metrics["adapted_loss"]) == float(metrics["loss"])  # one inner step: its loss is the first


def test_maml_meta_gradient_is_the_derivative_of_the_adapted_loss():
    """Central differences of L(theta) = query loss after two inner SGD steps at lr 0.5, along MAML's meta-gradient
    g and along g minus first-order MAML's: both match g; first-order MAML's misses them (at this inner lr the
    second-order term is most of the gradient)."""
    overrides = ["mesh.dp=1", "mesh.tp=1", "meta.inner_lr=0.5", "train.batch_size=6"]
    _, maml = _trainer([*overrides, *_meta("maml", steps=2)])
    _, fomaml = _trainer([*overrides, *_meta("fomaml", steps=2)])
    params, batch = maml.init(jax.random.key(0)).params, random_batch(maml)
    learner = maml.learner

    @jax.jit
    def adapted_loss(p, step, sign):  # one compile for every direction and sign
        adapted, _ = learner.adapt(jax.tree.map(lambda w, s: w + sign * s, p, step),
                                   jax.tree.map(lambda x: x[:2], batch))
        return learner.task_loss(adapted, jax.tree.map(lambda x: x[2], batch))

    flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])  # noqa: E731
    g = flat(_on(maml, lambda p, b: learner.per_task(p, b)[0], params, batch))
    g_first = flat(_on(fomaml, lambda p, b: fomaml.learner.per_task(p, b)[0], params, batch))
    leaves, treedef = jax.tree.flatten(params)
    eps = 1e-4  # float32: smaller is noise, larger is curvature (1e-3 is 2% off)
    for v in (g / np.linalg.norm(g), (g - g_first) / np.linalg.norm(g - g_first)):
        parts = np.split(v * eps, np.cumsum([x.size for x in leaves])[:-1])
        step = jax.tree.unflatten(treedef, [jnp.asarray(d.reshape(x.shape), x.dtype) for d, x in zip(parts, leaves)])
        with jax.set_mesh(maml.mesh):
            plus, minus = (float(adapted_loss(params, step, jnp.float32(sign))) for sign in (1.0, -1.0))
        numeric = (plus - minus) / (2 * eps)
        # a central difference in fp32 (measured 3.5e-4); FOMAML's gradient is 0.84-1.0 away (measured)
        assert numeric == pytest.approx(g @ v, rel=5e-3)
        assert abs(g_first @ v - numeric) > 0.5 * abs(numeric)


# Each group's layout within dp2; fp8: dp2 with fp8 GEMMs, whose scales a group's replicas share with no other group.
GROUP_LAYOUTS = {"tp": ["mesh.tp=2"], "pp": ["mesh.pp=2", "mesh.tp=1"], "cp": ["mesh.cp=2", "mesh.tp=1"],
                 "fp8": ["mesh.tp=1", "precision.fp8=true"]}


@pytest.mark.parametrize("algorithm, layout", [("reptile", "tp"), ("fomaml", "tp"), ("maml", "tp"), ("reptile", "pp"),
                                               ("fomaml", "pp"), ("maml", "cp"), ("reptile", "fp8"),
                                               ("fomaml", "fp8"), ("maml", "fp8")])
@pytest.mark.proves("1f1b+reptile", "1f1b+fomaml", "ring+maml", "reptile+fp8", "fomaml+fp8", "maml+fp8")
def test_groups_adapt_in_parallel_as_one_device_does_their_tasks_in_turn(algorithm, layout):
    """dp2 x tp2; dp2 x pp2 (each group a 1F1B pipeline, one micro-batch per inner step); dp2 x cp2 (each inner
    step's gradient summed over cp; maml differentiates through that); dp2 with fp8 GEMMs: the mean over the groups
    of what each returns equals one device's `per_task` on each group's rows, averaged."""
    meta = _meta(algorithm)
    fp8 = [o for o in GROUP_LAYOUTS[layout] if o.startswith("precision.")]
    _, parallel = _trainer(["mesh.dp=2", *GROUP_LAYOUTS[layout], *meta])
    _, single = _trainer(["mesh.dp=1", "mesh.tp=1", *fp8, *meta])
    params, batch = parallel.init(jax.random.key(0)).params, random_batch(parallel)
    got = _on(parallel, parallel.learner.over_tasks, params, batch)
    order = np.argsort(np.asarray(batch["positions"])[0, 0])  # cp's zigzag columns back in token order
    host = jax.tree.map(np.asarray, params), {k: np.asarray(v)[..., order] for k, v in batch.items()}
    rows = batch["inputs"].shape[1] // 2
    per_task = jax.jit(single.learner.per_task)  # one compile for both groups' rows
    with jax.set_mesh(single.mesh):
        each = [per_task(host[0], jax.tree.map(lambda x: x[:, g * rows:(g + 1) * rows], host[1])) for g in range(2)]
    want = jax.tree.map(lambda a, b: (np.asarray(a, np.float64) + np.asarray(b, np.float64)) / 2, *each)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # two programs' fp32 sums: measured 8.6e-7 of a leaf's largest, 4.8e-7 at most absolute; one group's
        # rows alone would be off by the groups' difference, O(1) of a leaf (reasoned)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=2e-6)


# Each algorithm's layout for the compressed mean: Reptile over dp2 x pp2 (a 1F1B pipeline per group; the mean of
# global - adapted, the outer SGD at lr 1 without momentum), the MAMLs over dp2 x tp2 (the meta-gradients' mean).
COMPRESSED = {"reptile": ["mesh.tp=1", "mesh.pp=2", "train.outer_lr=1.0", "train.outer_momentum=0"],
              "fomaml": ["mesh.tp=2"], "maml": ["mesh.tp=2"]}
# (payload, its overrides, ||carried - exact|| / ||exact|| must be below), as DiLoCo's outer average's bounds.
# Measured: int8 0.015-0.019, bf16 0.0023; PowerSGD (Reptile's band) 0.917.
META_PAYLOADS = {"int8": ([], 0.02), "bf16": ([], 0.005), "powersgd": (["train.powersgd_rank=2"], 0.97)}


@pytest.fixture(scope="module")
def stacked_targets():
    """algorithm -> (its trainer, state, batch under int8, and each group's row of the target the groups meet
    with: the adapted parameters (Reptile) or the meta-gradient), computed once."""
    cache = {}

    def get(algorithm: str):
        if algorithm not in cache:
            _, trainer = _trainer(["mesh.dp=2", *COMPRESSED[algorithm], *_meta(algorithm),
                                   "train.grad_compression=int8"])
            state, batch = trainer.init(jax.random.key(0)), random_batch(trainer)
            stacked = _on(trainer, functools.partial(trainer.learner.over_tasks, stacked=True), state.params,
                          batch)[0]
            cache[algorithm] = trainer, state, batch, stacked
        return cache[algorithm]
    return get


@pytest.mark.parametrize("payload", list(META_PAYLOADS))
@pytest.mark.parametrize("algorithm", list(COMPRESSED))
@pytest.mark.proves("reptile+bf16_reduce", "reptile+int8_reduce", "reptile+powersgd", "fomaml+bf16_reduce",
                    "fomaml+int8_reduce", "fomaml+powersgd", "maml+bf16_reduce", "maml+int8_reduce", "maml+powersgd")
def test_a_compressed_meta_mean_is_the_exact_one_within_its_payload_and_keeps_what_it_lost(stacked_targets,
                                                                                          algorithm, payload):
    """The groups' one mean in `train.grad_compression`'s payload (`outer.compressed_mean`): within the payload's
    rounding of the exact mean, the replicas' residuals holding the rest exactly; (int8) the meta step moves the
    parameters by it: Reptile's outer SGD by the carried mean of global - adapted, the MAMLs' AdamW on the carried
    meta-gradient."""
    trainer, state, batch, stacked = stacked_targets(algorithm)
    extra, bound = META_PAYLOADS[payload]
    if payload != "int8":
        _, other = _trainer(["mesh.dp=2", *COMPRESSED[algorithm], *_meta(algorithm),
                             f"train.grad_compression={payload}", *extra])
        residual = other.init(jax.random.key(0)).residual
    else:
        residual = state.residual
    reference = state.params if algorithm == "reptile" else None
    mean_of = functools.partial(outer.compressed_mean, trainer.cfg, payload)
    mean, after = _on(trainer, mean_of, stacked, residual, reference)
    host = functools.partial(jax.tree.map, lambda x: np.asarray(x, np.float64))
    rows, carried, errors = host(stacked), host(mean), host(after["error"])
    exact = jax.tree.map(lambda r: r.mean(axis=0), rows)
    if reference is not None:
        exact = jax.tree.map(lambda p, x: p - x, host(reference), exact)
    for c, e, x in zip(jax.tree.leaves(carried), jax.tree.leaves(errors), jax.tree.leaves(exact)):
        # PowerSGD's projections round in fp32: within 1e-5 of each leaf's largest mean value.
        np.testing.assert_allclose(2 * c + e.sum(axis=0), 2 * x, rtol=1e-5, atol=1e-5 * np.abs(x).max())
    gap = np.sqrt(sum(np.sum((c - x) ** 2) for c, x in zip(jax.tree.leaves(carried), jax.tree.leaves(exact))))
    size = np.sqrt(sum(np.sum(x ** 2) for x in jax.tree.leaves(exact)))
    # dp2 x tp2: held to its float64 rank-2 reference (measured 2.9e-7, the rank-2 mean 0.86-0.88 from the exact
    # one); Reptile's pipelined stacks draw their Q per stage stack: a band, measured 0.917.
    if payload == "powersgd" and algorithm != "reptile":
        from test_grad_compression import POWERSGD_RTOL, powersgd_reference

        ref = powersgd_reference(trainer, exact, 2)
        off = np.sqrt(sum(np.sum((c - r) ** 2) for c, r in zip(jax.tree.leaves(carried), ref)))
        assert gap > 0 and off < POWERSGD_RTOL * np.sqrt(sum(np.sum(r ** 2) for r in ref)), (off, gap / size)
    else:
        assert 0 < gap < bound * size
    if payload != "int8":  # the step's use of `compressed_mean` is one code path for every payload
        return
    if algorithm == "reptile":
        want = jax.tree.map(lambda p, d: p - d, host(state.params), carried)
    else:
        updates = _on(trainer, trainer.optimizer.update, mean, state.opt_state, state.params)[0]
        want = jax.tree.map(lambda p, u: p + u, host(state.params), host(updates))
    new = host(trainer.step(jax.tree.map(jnp.copy, state), batch)[0].params)  # the step donates its input
    for a, b, c in zip(jax.tree.leaves(new), jax.tree.leaves(want), jax.tree.leaves(carried)):
        if algorithm != "reptile":
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
            continue
        # The step's pipelined adaptation and the fixture's are two programs: an int8 value may land a quantum away.
        assert_close_but_a_few(a, b, rtol=1e-6, atol=1e-9, bound=np.abs(c).max() / 127)


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    """Four tasks: consecutive 40,000-character stretches of the shipped novel."""
    text = assets.locate("data/prideprejudice.txt").read_text(encoding="utf-8")
    folder = tmp_path_factory.mktemp("tasks")
    paths = []
    for i in range(4):
        paths.append(folder / f"task{i}.txt")
        paths[-1].write_text(text[i * 40_000:(i + 1) * 40_000], encoding="utf-8")
    return [str(p) for p in paths]


def test_each_groups_rows_hold_its_task_in_turn():
    tokens = [(np.arange(t * 1000, t * 1000 + 600), np.arange(10)) for t in range(4)]  # tell tasks apart
    cfg = load_config("debug", ["mesh.dp=2", "mesh.tp=1"])
    mesh = make_mesh(cfg.mesh, jax.devices()[:2])
    it = TaskIterator(tokens, seq_len=8, batch_size=8, grad_accum=2, seed=0, mesh=mesh)
    for step in range(3):
        ids = [it.tasks[t].window_ids(it.tasks[t].epoch, it.tasks[t].step_in_epoch) for t in it.assignment(step)]
        want = [read_windows(it.tasks[t].tokens, i, 8)[..., :8] for t, i in zip(it.assignment(step), ids)]
        inputs = np.asarray(next(it)["inputs"])
        assert it.assignment(step) == [(2 * step) % 4, (2 * step + 1) % 4]
        for g in range(2):
            np.testing.assert_array_equal(inputs[:, 2 * g:2 * g + 2], want[g])


def test_tasks_can_be_the_values_of_a_jsonl_field(tmp_path):
    """meta.task_field=genre: task "b" is exactly the tokens of the records whose genre is b (as text: 2 is "2"),
    in file order; a record without the field, or a .txt source, is one line."""
    lines = [{"text": f"Document {i} of the corpus, in genre {g}. " * 3, "genre": g} for i, g in enumerate("abab")]
    lines.append({"text": "A record filed under a number, twice as short. " * 2, "genre": 2})
    source = tmp_path / "corpus.jsonl"
    source.write_text("\n".join(json.dumps(x) for x in lines), encoding="utf-8")
    only_b = tmp_path / "b.jsonl"
    only_b.write_text("\n".join(json.dumps(x) for x in lines if x["genre"] == "b"), encoding="utf-8")
    cfg = load_config("debug", ["mesh.dp=1", "mesh.tp=1", f"data.path={source}", f"data.cache_dir={tmp_path}/cache",
                                "data.eval_fraction=0", "train.seq_len=8", "train.batch_size=2", "train.grad_accum=1"])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    it = build_tasks(cfg.data, ("b", "2"), cfg.train, None, tokenizer, field="genre")
    want = load_tokens(dataclasses.replace(cfg.data, path=str(only_b)), tokenizer)
    np.testing.assert_array_equal(np.asarray(it.tasks[0].tokens), np.asarray(want))
    assert len(it.tasks[1].tokens) < len(it.tasks[0].tokens)
    with pytest.raises(ConfigError, match="holds no text with genre=c"):
        build_tasks(cfg.data, ("c",), cfg.train, None, tokenizer, field="genre")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no genre"}), encoding="utf-8")
    for path, message in [(tmp_path / "bad.jsonl", "bad.jsonl:1 has no \"genre\" field, which meta.task_field"),
                          (assets.locate("data/prideprejudice.txt"), "is plain text, with no fields")]:
        with pytest.raises(ConfigError, match=message):
            build_tasks(dataclasses.replace(cfg.data, path=str(path)), ("a",), cfg.train, None, tokenizer,
                        field="genre")


def test_a_resume_continues_bit_for_bit(tmp_path, task_files):
    """fomaml on dp2, saved at step 2 (the tasks' positions and the meta-step in the data state)."""
    def run(name: str) -> list[float]:
        overrides = [*SMALL, "mesh.dp=2", "mesh.tp=1", "train.steps=4", "log.every=1", "log.eval_every=0",
                     f"log.dir={tmp_path}/{name}", f"checkpoint.dir={tmp_path}/{name}/ckpt", "checkpoint.every=2",
                     f"data.cache_dir={tmp_path}/cache", *_meta("fomaml")[:-1], f"meta.tasks=[{','.join(task_files)}]"]
        cfg = load_config("debug", overrides)
        return [r["loss"] for r in train(cfg, progress=False, devices=jax.devices()[:2])]

    straight = run("a")
    preempted_after(tmp_path / "a", tmp_path / "b", 2)
    assert run("b") == straight[2:]


@pytest.mark.parametrize("overrides, message", [
    (["mesh.dp=2", *_meta("maml", tasks=3)], "meta.tasks names 3 tasks, which do not divide over the mesh.dp=2"),
    (["mesh.dp=2", *_meta("maml")[:1], "meta.tasks=[a.txt,b.txt]", "train.grad_accum=1"],
     "reads 2 micro-batches per step \\(1 to adapt and 1 to take the meta-gradient on\\): set train.grad_accum=2"),
    (["mesh.dp=2", "mesh.pp=2", *_meta("maml")], "meta.algorithm=maml does not run with mesh.pp=2: use mesh.pp=1"),
    (["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=interleaved", "model.num_hidden_layers=4",
      "pipeline.virtual_stages=2", *_meta("reptile", steps=2)],
     "does not run with pipeline.schedule=interleaved: use 1f1b"),
    (["mesh.dp=2", "train.local_steps=4", *_meta("reptile")], "does not run with train.local_steps=4"),
])
def test_runs_meta_learning_cannot_do_are_one_line(overrides, message):
    cfg = load_config("debug", overrides)
    with pytest.raises(ConfigError, match=message):
        validate_run(cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.context, cfg.precision, cfg.meta)
