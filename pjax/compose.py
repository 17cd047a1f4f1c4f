"""Which of pjax's features compose: every pair, asked of the rules `pjax.train` checks before its first step.

A feature is a few config overrides (`FEATURES`); a pair's run is the shipped `debug` config with both
features' overrides, on a mesh with the axes they need (dp 2 where either reads data replicas). The pair is
refused when the rules refuse that run (`refusal`: the line `pjax.train` prints); two features that set the
same key (two schedules, two context strategies) are alternatives, not a pair. Which composing pairs are
proven, and by which test, the tests say themselves (`pytest.mark.proves`); `tests/test_composition.py` checks
that every composing pair has one and writes the matrix into README.md.

    python -m pjax.compose zb_h1 ring      # composes, or the line that refuses it
    python -m pjax.compose ring maml fp8   # any set of features
    python -m pjax.compose                 # every pair
"""
from __future__ import annotations

import itertools
import sys
from typing import Any, NamedTuple, Sequence

from mesh.errors import ConfigError


class Feature(NamedTuple):
    """One row of the matrix: its name, its label, the key it sets (features that share one are
    alternatives), the overrides that turn it on, and the mesh axes it needs besides dp."""

    name: str
    label: str
    key: str
    overrides: tuple[str, ...]
    axes: tuple[str, ...] = ()
    replicas: bool = False  # needs dp >= 2: it shards over, reduces over or groups the data replicas
    dp: int = 2  # the data replicas it needs when `replicas` (HSDP: 2 groups of 2)


def _schedule(name: str, label: str, virtual: int = 1) -> Feature:
    return Feature(name, label, "pipeline.schedule", (f"pipeline.schedule={name}", f"pipeline.virtual_stages={virtual}"),
                   ("pp",))


def _context(name: str, label: str) -> Feature:
    return Feature(name, label, "context.strategy", (f"context.strategy={name}",), ("cp",))


def _compression(name: str, label: str) -> Feature:
    return Feature(f"{name}_reduce" if name != "powersgd" else name, label, "train.grad_compression",
                   (f"train.grad_compression={name}",), replicas=True)


def _meta(name: str, label: str) -> Feature:
    inner = 2 if name == "reptile" else 1  # grad_accum = inner steps (+1 query for fomaml, maml) = 2
    return Feature(name, label, "meta.algorithm", (f"meta.algorithm={name}", "meta.tasks=[data/austen/emma.txt,data/austen/persuasion.txt]",
                                                   f"meta.inner_steps={inner}"), replicas=True)


FEATURES: tuple[Feature, ...] = (
    _schedule("1f1b", "1F1B"), _schedule("interleaved", "interleaved", 2), _schedule("zb_h1", "ZB-H1"),
    _schedule("zb_v", "ZB-V", 2),
    _context("ring", "ring"), _context("all_gather", "all-gather"), _context("ulysses", "Ulysses"),
    Feature("sp", "SP", "train.sequence_parallel", ("train.sequence_parallel=true",), ("tp",)),
    Feature("zero1", "ZeRO-1", "train.zero", ("train.zero=1",), replicas=True),
    Feature("zero3", "ZeRO-3", "train.zero", ("train.zero=3",), replicas=True),
    Feature("hsdp", "HSDP", "train.zero", ("train.zero=3", "train.zero_shard=2"), replicas=True, dp=4),
    Feature("moe", "MoE", "model.num_local_experts", ("model.num_local_experts=4", "model.num_experts_per_tok=2"),
            replicas=True),
    _compression("bf16", "bf16 reduce"), _compression("int8", "int8 reduce"), _compression("powersgd", "PowerSGD"),
    Feature("diloco", "DiLoCo", "train.local_steps", ("train.local_steps=2",), replicas=True),
    Feature("streaming", "streaming DiLoCo", "train.local_steps", ("train.local_steps=2", "train.diloco_fragments=2"),
            replicas=True),
    _meta("reptile", "Reptile"), _meta("fomaml", "FOMAML"), _meta("maml", "MAML"),
    Feature("curriculum", "curriculum", "data.curriculum", ("data.curriculum=16x2",)),
    Feature("fp8", "fp8", "precision.fp8", ("precision.fp8=true",)),
    Feature("remat_full", "remat full", "train.remat", ("train.remat=full",)),
    Feature("loss_chunk", "loss_chunk", "train.loss_chunk", ("train.loss_chunk=16",)),
)
BY_NAME = {f.name: f for f in FEATURES}
# Wide enough that no pair is refused for its sizes, small enough that a test runs every pair: 4 layers (pp 2 x 2
# virtual stages), 8 heads and 4 kv heads (Ulysses over cp 2 x tp 2), 8 rows in 2 micro-batches of 32 tokens, 10
# steps (DiLoCo synchronises at 2).
BASE = ("model.num_hidden_layers=4", "model.num_attention_heads=8", "model.num_key_value_heads=4",
        "model.hidden_size=64", "model.intermediate_size=128", "train.steps=10", "train.batch_size=8",
        "train.grad_accum=2", "train.seq_len=32")


class Cell(NamedTuple):
    """A pair's verdict: 'alternatives', 'refused' (with the line) or 'composes'."""

    status: str
    line: str = ""


def pair_overrides(a: Feature, b: Feature) -> list[str]:
    """The `pjax.train` overrides of the pair's run: BASE, the mesh both need, then both features'."""
    return run_overrides((a, b))


def run_overrides(features: Sequence[Feature]) -> list[str]:
    """The overrides of a run with all of `features` on: BASE, a mesh of 2 along each axis one needs (dp 2 when
    one needs data replicas, 4 for HSDP's two groups of two), then the features' own."""
    axes = {axis for f in features for axis in f.axes}
    mesh = {axis: 2 if axis in axes else 1 for axis in ("pp", "cp", "tp")}
    mesh["dp"] = max((f.dp for f in features if f.replicas), default=1)
    return [*BASE, *(f"mesh.{axis}={size}" for axis, size in mesh.items()), *(o for f in features for o in f.overrides)]


def check(config: Any) -> None:
    """The ConfigError `pjax.train` raises before its first step, unless `config` (a Config) runs: the layout's rules
    (`pjax.validate`), the curriculum's, the meta-learning tasks' reading (`pjax.data.tasks`). The planner asks the
    same of each layout it lists."""
    from pjax.data import tasks
    from pjax.data.curriculum import Curriculum
    from pjax.validate import Run, validate_run

    run = Run(config.mesh, config.model, config.train, config.pipeline, config.context, config.precision, config.meta,
              config.moe)
    validate_run(*run)
    Curriculum.for_run(config.data.curriculum, run)
    if config.meta.algorithm is not None:
        tasks.check_reads(config.data)


def refusal(overrides: Sequence[str]) -> str | None:
    """The line `pjax.train` prints before its first step for the `debug` config with `overrides` (its own checks,
    then `check`'s), or None when it runs."""
    from pjax.config_io import load_config

    try:
        check(load_config("debug", overrides))
    except ConfigError as e:
        return str(e)
    return None


def cell(a: str, b: str) -> Cell:
    """The verdict on features `a` and `b` (names in FEATURES)."""
    return verdict((a, b))


def verdict(names: Sequence[str]) -> Cell:
    """The verdict on a set of features (names in FEATURES): 'alternatives' where two set one key, else whether
    the rules accept their run (`run_overrides`) or the line that refuses it."""
    features = [BY_NAME[name] for name in names]
    if len({f.key for f in features}) < len(features):
        return Cell("alternatives")
    line = refusal(run_overrides(features))
    return Cell("composes") if line is None else Cell("refused", line)


def pairs() -> list[tuple[str, str]]:
    """Every unordered pair of FEATURES, in the matrix's order."""
    return [(a.name, b.name) for a, b in itertools.combinations(FEATURES, 2)]


def exercised(run: Any, curriculum: Any = None) -> frozenset[str]:
    """The FEATURES a resolved run (a `pjax.validate.Run`, its mesh built) exercises, each in a form that can
    fail: a schedule at pp >= 2 (interleaved with 2 or more virtual stages), a context strategy at cp >= 2, SP at
    tp >= 2, ZeRO sharding over 2 or more replicas (HSDP: 2 or more groups of them), experts split over 2 or more
    devices, a compressed reduction, DiLoCo's or meta-learning's 2 or more groups, a `curriculum` (its
    `pjax.data.curriculum.Curriculum`) with a shorter stage, a device's loss in 2 or more chunks.
    `tests/proofs.py` holds a test's `proves` marks to the runs it made."""
    mesh, train, model = run.mesh, run.train, run.model
    on: set[str] = set()
    if mesh.pp >= 2 and (run.pipeline.schedule not in ("interleaved", "zb_v") or run.pipeline.virtual_stages >= 2):
        on.add(run.pipeline.schedule)
    if mesh.cp >= 2:
        on.add(run.context.strategy)
    if mesh.tp >= 2 and train.sequence_parallel:
        on.add("sp")
    shard = train.zero_shard or mesh.dp
    if train.zero and shard >= 2:
        on.add(f"zero{train.zero}")
        if train.zero_shard and mesh.dp // train.zero_shard >= 2:
            on.add("hsdp")
    if model.num_local_experts and max(mesh.ep, mesh.tp) >= 2:
        on.add("moe")
    copies = mesh.model_copies(model.num_local_experts)
    if train.grad_compression != "none" and mesh.dp >= 2:
        on.add(train.grad_compression if train.grad_compression == "powersgd" else f"{train.grad_compression}_reduce")
    if train.local_steps and (train.diloco_groups or copies) >= 2:
        on.add("streaming" if train.diloco_fragments >= 2 else "diloco")
    if run.meta.algorithm and copies >= 2:
        on.add(run.meta.algorithm)
    if curriculum is not None and curriculum.stages:
        on.add("curriculum")
    if run.precision.resolve(train.dtype).fp8:
        on.add("fp8")
    if train.remat == "full":
        on.add("remat_full")
    tokens = train.batch_size // train.grad_accum // mesh.dp * train.seq_len // mesh.cp  # a device's micro-batch
    if 0 < train.loss_chunk < tokens:
        on.add("loss_chunk")
    return frozenset(on)


def parser() -> Any:
    """The command line's parser (tests/test_docs.py parses the commands the docs show with it)."""
    from pjax.cli import ArgumentParser

    ap = ArgumentParser(prog="python -m pjax.compose", description="Whether two or more of pjax's features "
                        "compose, by the rules pjax.train checks; with no names, every pair.")
    ap.add_argument("features", nargs="*", help=f"two or more of: {', '.join(BY_NAME)}")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from pjax.cli import run_main

    args = parser().parse_args(argv)

    def body() -> None:
        unknown = [name for name in args.features if name not in BY_NAME]
        if unknown or len(args.features) == 1:
            raise ConfigError(f"name two or more features, or none for every pair{'; unknown: ' if unknown else ''}"
                              f"{', '.join(unknown)} (python -m pjax.compose --help lists them).")
        for names in [tuple(args.features)] if args.features else pairs():
            answer = verdict(names)
            print(f"{' + '.join(names)}: {answer.status}{': ' + answer.line if answer.line else ''}")
    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
