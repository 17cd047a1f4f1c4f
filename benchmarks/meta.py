"""Meta-learning that shows its point, or does not: adaptation to a held-out text in k SGD steps.

    python benchmarks/meta.py --plot benchmarks/plots/meta.png

The `debug` model is meta-trained on four Austen novels (`pjax/assets/data/austen`: emma, mansfieldpark,
northangerabbey, sensesensibility; one task per dp group, dp4 on forced CPU devices) with each
`meta.algorithm`, and trained conventionally (AdamW, the same steps, batch and so the same tokens) on the four
texts concatenated. Each model, and the untrained one, is then adapted to persuasion.txt, which none saw, by k
SGD steps on its first windows at each learning rate of `--adapt-lrs` (the meta-training's `meta.inner_lr`
among them: a conventionally trained model gets its best rate, not only the one meta-training assumed),
and evaluated on its held-out tail after each step. Prints one JSON line per model and rate: the held-out
loss after 0..k steps.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

TRAIN_TASKS = ("emma", "mansfieldpark", "northangerabbey", "sensesensibility")
HELD_OUT = "persuasion"


def _path(name: str) -> str:
    return f"data/austen/{name}.txt"


def train_model(kind: str, steps: int, inner_steps: int, inner_lr: float, tmp: str, extra: list[str]) -> str:
    """Train one model (a meta.algorithm, or 'conventional'); the checkpoint directory of its final step."""
    import jax

    from pjax import assets
    from pjax.config_io import load_config
    from pjax.train import train

    common = ["mesh.dp=4", "mesh.tp=1", f"train.steps={steps}", "train.batch_size=24", "log.eval_every=0",
              "log.every=10", f"log.dir={tmp}/{kind}", f"checkpoint.dir={tmp}/{kind}/ckpt", *extra]
    if kind == "conventional":
        mixed = os.path.join(tmp, "four_novels.txt")
        with open(mixed, "w", encoding="utf-8") as f:
            f.write("".join(assets.locate(_path(t)).read_text(encoding="utf-8") for t in TRAIN_TASKS))
        overrides = [*common, "train.grad_accum=2", f"data.path={mixed}"]
    else:
        reads = inner_steps + (0 if kind == "reptile" else 1)
        overrides = [*common, f"meta.algorithm={kind}", f"meta.inner_steps={inner_steps}", f"meta.inner_lr={inner_lr}",
                     f"train.grad_accum={reads}", f"meta.tasks=[{','.join(_path(t) for t in TRAIN_TASKS)}]"]
    train(load_config("debug", overrides), progress=False, devices=jax.devices()[:4])
    return f"{tmp}/{kind}/ckpt"


def adaptation(k: int, eval_batches: int) -> Callable[[object, float], list[float]]:
    """`adapt(params, lr)`: the held-out novel's held-out loss after 0..k SGD steps at `lr` (8 windows each, its
    first windows, the same for every model and rate); the data is read and the steps compiled once."""
    import jax

    from mesh.mesh import make_mesh
    from pjax.config_io import load_config
    from pjax.data import build_data
    from pjax.step import build_trainer

    cfg = load_config("debug", ["mesh.dp=1", "mesh.tp=1", "train.batch_size=8", "train.grad_accum=1",
                                "meta.algorithm=reptile", f"meta.tasks=[{_path(HELD_OUT)}]", "data.eval_fraction=0.2"])
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    learner = build_trainer(mesh, cfg.model, cfg.train, meta_cfg=cfg.meta).learner
    data, _, _ = build_data(cfg.data, cfg.train, mesh, cfg.meta.tasks)
    support, held_out = [next(data) for _ in range(k)], list(data.eval_batches(eval_batches))
    first = lambda batch: jax.tree.map(lambda x: x[0], batch)  # noqa: E731 - the one micro-batch

    @jax.jit
    def sgd(p, batch, lr):
        grads = jax.grad(learner.task_loss)(p, first(batch))
        return jax.tree.map(lambda w, g: w - lr * g, p, grads)

    @jax.jit
    def loss(p, batch):
        return learner.task_loss(p, first(batch))

    def adapt(params: object, lr: float) -> list[float]:
        curve = []
        with jax.set_mesh(mesh):
            params = jax.device_put(params, jax.devices()[0])
            for step in range(k + 1):
                curve.append(round(sum(float(loss(params, b)) for b in held_out) / len(held_out), 4))
                if step < k:
                    params = sgd(params, support[step], lr)
        return curve
    return adapt


def final_params(checkpoint: str | None) -> object:
    """A trained model's parameters on one device, or (None) the untrained model's."""
    import jax

    from mesh.mesh import make_mesh
    from models import llama
    from pjax.config_io import load_config
    from pjax.eval import load_checkpoint_on_mesh

    cfg = load_config("debug", ["mesh.dp=1", "mesh.tp=1"])
    if checkpoint is None:
        return llama.init_params(cfg.model, jax.random.key(cfg.train.seed))
    return load_checkpoint_on_mesh(checkpoint, make_mesh(cfg.mesh, jax.devices()[:1]))[1]


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    best = {}
    for row in rows:  # each model at the rate that ends lowest
        if row["model"] not in best or row["held_out_loss"][-1] < best[row["model"]]["held_out_loss"][-1]:
            best[row["model"]] = row
    for row in best.values():
        curve = row["held_out_loss"]
        ax.plot(range(len(curve)), curve, marker="o", ms=3, label=f"{row['model']} (SGD lr {row['adapt_lr']})")
    ax.set_xlabel(f"SGD steps on {HELD_OUT}.txt (8 windows of 128 tokens each)")
    ax.set_ylabel(f"held-out loss on {HELD_OUT}.txt")
    ax.set_title("Adapting to an unseen novel: meta-trained vs conventionally trained")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="conventional,reptile,fomaml,maml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--inner-steps", type=int, default=2)
    ap.add_argument("--inner-lr", type=float, default=0.1)
    ap.add_argument("--adapt-lrs", default="0.01,0.03,0.1", help="SGD rates the held-out adaptation is run at")
    ap.add_argument("--k", type=int, default=8, help="adaptation steps on the held-out novel")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--plot", default=None)
    ap.add_argument("overrides", nargs="*", default=[], help="for every training run, e.g. train.lr=3e-3")
    args = ap.parse_args()
    rows, adapt = [], adaptation(args.k, args.eval_batches)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ["untrained", *args.models.split(",")]:
            checkpoint = None if kind == "untrained" else train_model(kind, args.steps, args.inner_steps,
                                                                     args.inner_lr, tmp, args.overrides)
            params = final_params(checkpoint)
            for lr in map(float, args.adapt_lrs.split(",")):
                curve = adapt(params, lr)
                rows.append({"model": kind, "steps": args.steps, "inner_steps": args.inner_steps,
                             "meta_inner_lr": args.inner_lr, "adapt_lr": lr, "held_out_loss": curve})
                print(json.dumps(rows[-1]), flush=True)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
