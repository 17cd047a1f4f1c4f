"""Every pair of pjax's features: refused with the line `pjax.train` prints, or proven by a test (tests/composition.py
reads the matrix from the rules and the tests' `proves` marks); and runs of several features at once, each equal to
its reference: the same run without the features that only change the layout.

A run's reference keeps its math features (`MATH`: fp8, the curriculum, the payload of the reduction, DiLoCo,
meta-learning, the experts themselves) on the smallest mesh they run on: one device, or dp 2 where one of them
groups or reduces over data replicas. A run equal to its reference proves each pair with a feature the reference
drops: that feature changed nothing the other computes. Expert parallelism is dropped with the mesh when the
reference runs on one device."""
from __future__ import annotations

import contextlib
import io

import jax
import numpy as np
import pytest

import composition
from pjax import compose
from pjax import train as pjax_train
from pjax.config_io import load_config
from test_errors import in_process

# Math features: the reference keeps them. The rest (schedules, context strategies, SP, ZeRO, remat, loss_chunk, and
# the experts' split over dp) change only where and in what order the same sums run.
MATH = ("moe", "bf16_reduce", "int8_reduce", "powersgd", "diloco", "streaming", "reptile", "fomaml", "maml",
        "curriculum", "fp8")
REPLICA_MATH = ("bf16_reduce", "int8_reduce", "powersgd", "diloco", "streaming", "reptile", "fomaml", "maml")
# Loss tolerance (relative) of a run against its reference: float32 sums in another order (1e-5); with a bf16
# reduction its rounding of other blocks of the same values (measured 1.2e-4 after two steps); with fp8 GEMMs such
# a sum's last bit now and then moves an e4m3 or e5m2 rounding (3 or 2 mantissa bits), and later roundings amplify
# it as the parameters move (measured up to 4.1e-4 at the third step; how often depends on the CPU's vector code);
# with MoE such a difference can flip a router's choice, so MoE and fp8 share no run. The first step's loss, from
# the same parameters, must equal the reference's to FIRST_RTOL (fp8: FIRST_RTOL_FP8, measured 7e-7): the forward's
# fp8 scales are per data replica, and where a run has more replicas than its reference they fall in the same power
# of two on these batches (tests/test_fp8.py checks the loss to 1e-6 on layouts against their exact reference).
RTOL = {"bf16_reduce": 1e-3, "int8_reduce": 1e-3, "fp8": 1e-3}  # int8: as bf16's (measured 3.1e-5, ZB-V's third step)
FIRST_RTOL, FIRST_RTOL_FP8 = 1e-6, 1e-5
RUN = ["train.steps=3", "train.lr=1e-2", "train.warmup_steps=0", "log.every=1", "log.eval_every=0"]

# Feature sets, each a run (tests/composition.py: the pairs each proves), as many features at once as the rules
# and 8 devices accept. The rest of the composing pairs are composition.UNPROVEN until a test proves them.
RUNS: tuple[tuple[str, ...], ...] = (
    ("1f1b", "ring", "zero1", "moe", "bf16_reduce", "curriculum", "remat_full", "loss_chunk"),
    ("interleaved", "all_gather", "zero3", "fp8", "loss_chunk"),
    ("zb_h1", "sp", "zero1", "bf16_reduce", "curriculum", "remat_full"),
    ("zb_h1", "sp", "int8_reduce", "streaming", "curriculum", "remat_full", "loss_chunk"),
    ("interleaved", "ulysses", "zero3", "moe", "curriculum", "remat_full", "loss_chunk"),
    ("ulysses", "sp", "zero1", "diloco", "fp8", "remat_full", "loss_chunk"),
    ("all_gather", "streaming", "curriculum"),
    ("ulysses", "streaming", "remat_full"),
    ("zb_v", "streaming", "loss_chunk"),
    ("1f1b", "streaming"),
    ("zb_v", "ulysses", "fomaml", "remat_full", "loss_chunk"),
    ("zb_h1", "all_gather", "reptile", "remat_full", "loss_chunk"),
    ("zb_v", "diloco", "curriculum", "fp8"),
    ("interleaved", "diloco", "loss_chunk"),
    ("all_gather", "moe", "remat_full"),
    ("zb_h1", "all_gather", "powersgd", "diloco", "remat_full", "loss_chunk"),
    ("1f1b", "all_gather", "zero1", "loss_chunk"),
    ("1f1b", "ring", "zero3", "remat_full"),
    ("zb_h1", "sp", "fomaml"),
    ("zb_v", "ulysses", "reptile"),
    ("ring", "sp", "reptile"),
    ("ring", "fomaml", "remat_full", "loss_chunk"),
    ("all_gather", "maml", "remat_full", "loss_chunk"),
    ("all_gather", "fomaml"),
    ("hsdp", "moe", "curriculum", "remat_full", "loss_chunk"),
    ("ulysses", "hsdp", "remat_full"),
    ("ring", "maml", "fp8"),  # a triple that ended in a traceback (pmax's missing derivative under MAML)
)


def comparable(features: tuple[str, ...]) -> bool:
    """Whether a run of `features` has a reference here: PowerSGD compresses each tp block apart (a rank-r image
    of each), so with tp (SP) its sum is not the reference's, which has no tp (measured 2.3% off by step 3)."""
    return not ("powersgd" in features and any("tp" in compose.BY_NAME[f].axes for f in features))


def reference(features: tuple[str, ...]) -> tuple[str, ...]:
    """The features a run's reference keeps (on the mesh `pjax.compose.run_overrides` gives them)."""
    return tuple(f for f in features if f in MATH)


def proven_by_run(features: tuple[str, ...]) -> list[tuple[str, str]]:
    """The pairs a run equal to its reference proves: those with a feature the reference drops."""
    kept = set(reference(features))
    dropped = {f for f in features if f not in kept}
    if "moe" in kept and not any(f in REPLICA_MATH for f in kept):
        dropped.add("moe")  # the reference runs the experts on one device
    return [composition.pair(a, b) for i, a in enumerate(features) for b in features[i + 1:]
            if a in dropped or b in dropped]


def losses(features: tuple[str, ...], tmp: str, cache: str, reference_mesh: bool = False) -> list[float]:
    """The per-step losses of a `pjax.train` run with `features` on (`pjax.compose.run_overrides`); with
    `reference_mesh`, on one device unless a feature reads data replicas (the experts then stay on one device)."""
    overrides = compose.run_overrides([compose.BY_NAME[f] for f in features])
    if reference_mesh and not any(f in REPLICA_MATH for f in features):
        overrides.append("mesh.dp=1")
    cfg = load_config("debug", [*overrides, *RUN, f"log.dir={tmp}", f"data.cache_dir={cache}"])
    with contextlib.redirect_stdout(io.StringIO()):
        metrics = pjax_train.train(cfg, progress=False, devices=jax.devices()[:cfg.mesh.size])
    return [m["loss"] for m in metrics if "loss" in m]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("token_cache"))


_references: dict[tuple[str, ...], list[float]] = {}


def _run(features: tuple[str, ...]):
    """A run's parameter: it proves the pairs `proven_by_run` gives, held by tests/proofs.py to what it ran."""
    claims = ["+".join(p) for p in proven_by_run(features)]
    return pytest.param(features, marks=pytest.mark.proves(*claims), id="-".join(features))


@pytest.mark.parametrize("features", [_run(f) for f in (*RUNS, *composition.recorded_triples())])
def test_features_together_equal_their_reference(features, cache, tmp_path):
    kept = reference(features)
    if kept not in _references:
        _references[kept] = losses(kept, str(tmp_path / "reference"), cache, reference_mesh=True)
    got = losses(features, str(tmp_path / "run"), cache)
    rtol = max([1e-5, *(RTOL.get(f, 0) for f in features)])
    np.testing.assert_allclose(got, _references[kept], rtol=rtol, err_msg=f"{features} against {kept}")
    first = FIRST_RTOL_FP8 if "fp8" in features else FIRST_RTOL
    np.testing.assert_allclose(got[0], _references[kept][0], rtol=first, err_msg=f"{features}: first step")


def test_every_pair_is_proven_refused_or_alternatives_and_every_proof_names_a_test():
    cells = composition.matrix()
    assert set(cells) == set(compose.pairs()) and len(cells) == len(compose.FEATURES) * (len(compose.FEATURES) - 1) // 2
    unproven = {p for p, (cell, tests) in cells.items() if cell.status == "composes" and not tests}
    assert unproven == composition.UNPROVEN, (f"now proven, drop from composition.UNPROVEN: "
                                              f"{sorted(composition.UNPROVEN - unproven)}; composing without a test: "
                                              f"{sorted(unproven - composition.UNPROVEN)}")
    for p, (cell, tests) in cells.items():
        assert not (tests and cell.status != "composes"), f"{p} is {cell.status} yet {tests} claims to prove it"
        for test in tests:
            file, _, name = test.partition("::")
            source = (composition.ROOT / file).read_text()
            assert f"def {name.split('[')[0]}(" in source, test


def test_every_refused_pair_is_the_line_pjax_train_prints(monkeypatch, capfd, tmp_path):
    in_process(monkeypatch)
    refused = [(a, b) for a, b in compose.pairs() if compose.cell(a, b).status == "refused"]
    assert refused
    for a, b in refused:
        overrides = compose.pair_overrides(compose.BY_NAME[a], compose.BY_NAME[b])
        status = pjax_train.main(["--no_progress", *overrides, f"log.dir={tmp_path}/run"])
        err = capfd.readouterr().err.strip()
        assert status == 2 and err == f"error: {compose.cell(a, b).line}", (a, b, err)


def test_readme_and_the_guide_show_the_matrix_the_rules_and_tests_give():
    cells = composition.matrix()
    readme = composition.README.read_text()
    assert composition.with_block(readme, composition.readme_block(cells)) == readme, \
        "README.md's matrix is out of date: run python tests/composition.py"
    assert composition.GUIDE.read_text() == composition.guide(cells), \
        "docs/composition.md is out of date: run python tests/composition.py"


def test_a_claim_holds_only_where_a_run_exercises_both_features():
    """ZeRO-3 at dp 1 shards nothing: a zero-bubble run there proves nothing about ZeRO-3, at dp 2 it does; the
    plugin (tests/proofs.py) fails a test whose runs are all of the first kind."""
    import dataclasses

    import proofs
    from mesh import MeshConfig
    from models.config import LlamaConfig
    from pjax.config import PipelineConfig, TrainConfig
    from pjax.validate import Run

    def zb_zero3(dp: int) -> frozenset[str]:
        tc = dataclasses.replace(TrainConfig(), zero=3)
        return compose.exercised(Run(MeshConfig(dp=dp, pp=2, ep=1), LlamaConfig(), tc, PipelineConfig("zb_h1")))

    assert zb_zero3(1) == {"zb_h1"} and zb_zero3(2) == {"zb_h1", "zero3"}
    assert proofs.unexercised(["zb_h1+zero3"], [zb_zero3(1)]) == ["zb_h1+zero3"]
    assert proofs.unexercised(["zb_h1+zero3"], [zb_zero3(1), zb_zero3(2)]) == []


def test_the_rules_answer_for_any_set_of_features():
    assert compose.verdict(("ring", "maml", "fp8")).status == "composes"
    assert compose.verdict(("ring", "ulysses", "fp8")).status == "alternatives"
    refused = compose.verdict(("sp", "zero1", "fomaml"))
    assert refused.status == "refused" and "meta.algorithm=fomaml" in refused.line
    drawn = composition.recorded_triples()
    assert len(drawn) == composition.TRIPLES and all(compose.verdict(t).status == "composes" for t in drawn)
