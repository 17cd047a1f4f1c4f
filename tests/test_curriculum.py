"""pjax/data/curriculum.py: `data.curriculum` re-packs the same tokens into shorter windows, resumes exactly
across a length change, compiles every length before the first step, and refuses what cannot run in one line."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from mesh.errors import ConfigError
from mesh.mesh import MeshConfig, make_mesh
from pjax import assets
from pjax.config import DataConfig
from pjax.config_io import load_config
from pjax.data import text
from pjax.data.batches import DataIterator
from pjax.data.curriculum import Curriculum
from pjax.data.stream import StreamIterator
from pjax.observe import report as run_report
from pjax.observe.metrics import model_flops_per_token
from pjax.parallel.context.zigzag import zigzag_layout
from pjax.train import train
from pjax.validate import Run

SEQ = 32
STAGES = "8x2,16x2"  # steps 1-2 at 8 tokens, 3-4 at 16, then 32


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> np.ndarray:
    cfg = DataConfig(path=str(assets.ROOT / "data/prideprejudice.txt"), cache_dir=str(tmp_path_factory.mktemp("c")))
    return text.load_tokens(cfg, text.load_tokenizer(cfg.tokenizer))


def in_stream_order(batch: dict) -> dict[str, np.ndarray]:
    """Each row's inputs and labels by position (undoing a zigzag layout), rows of k windows joined: [ga, b, SEQ]."""
    order = np.argsort(np.asarray(batch["positions"]), axis=-1)
    out = {}
    for key in ("inputs", "labels"):
        rows = np.take_along_axis(np.asarray(batch[key]), order, axis=-1)
        out[key] = rows.reshape(rows.shape[0], -1, SEQ)
    return out


# -- the schedule and its one-line refusals ------------------------------------------------------

def test_stages_give_each_step_its_length():
    curriculum = Curriculum.of(STAGES, SEQ)
    assert [curriculum.length(i) for i in range(7)] == [8, 8, 16, 16, 32, 32, 32]
    assert curriculum.lengths == (8, 16, 32)
    np.testing.assert_array_equal(curriculum.split(np.array([[3, 5]]), 8), [[12, 13, 14, 15, 20, 21, 22, 23]])
    assert Curriculum.of(None, SEQ) is None and Curriculum.of("", SEQ) is None


@pytest.mark.parametrize("stages, message", [
    ("8x2,16", "write a comma-separated list of LENGTHxSTEPS stages"),
    ("8:2", "write a comma-separated list"),
    ("0x2", "lengths and steps positive"),
    ("8x0", "lengths and steps positive"),
    ("16x2,8x4", "lengths must increase"),
    ("12x2", "length 12 does not divide train.seq_len=32"),
    ("32x2", "length 32 does not divide train.seq_len=32 into two or more windows"),
])
def test_a_malformed_curriculum_is_one_line(stages, message):
    with pytest.raises(ConfigError, match=message):
        Curriculum.of(stages, SEQ)


def test_a_length_the_layout_cannot_split_is_one_line_in_train_and_in_the_planner(tmp_path):
    from pjax.plan.layouts import Layout, check

    cfg = load_config("debug", ["mesh.dp=1", "mesh.tp=1", "mesh.cp=4", "train.seq_len=32", "train.grad_accum=1",
                                "data.curriculum=4x2", f"log.dir={tmp_path}"])
    curriculum = Curriculum.of(cfg.data.curriculum, cfg.train.seq_len)
    with pytest.raises(ConfigError, match=r"data.curriculum length 4 \(128 rows of 4 tokens\) does not fit this "
                                          r"layout: train.seq_len=4 is not divisible by 2\*mesh.cp = 8"):
        curriculum.check(Run(cfg.mesh, cfg.model, cfg.train))
    with pytest.raises(ConfigError, match="data.curriculum length 4"):
        check(cfg, Layout.parse("cp4"))
    check(cfg, Layout.parse("cp2"))  # 4 tokens split into 2*cp = 4 chunks
    with pytest.raises(ConfigError, match="data.curriculum=.*lengths must increase"):
        train(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, curriculum="8x2,4x3")), progress=False)


# -- the data: the same tokens, the same position ------------------------------------------------

def test_a_short_step_holds_the_plain_step_s_tokens_in_order_on_any_layout(tokens):
    mesh = make_mesh(MeshConfig(dp=2, cp=2, tp=2))
    layout = zigzag_layout(2)
    plain = DataIterator(tokens, SEQ, 8, 2, 0, mesh, sequence_layout=layout)
    short = DataIterator(tokens, SEQ, 8, 2, 0, mesh, sequence_layout=layout, curriculum=Curriculum.of(STAGES, SEQ),
                         eval_tokens=tokens[:2000])
    for length, rows in ((8, 16), (8, 16), (16, 8), (16, 8), (32, 4)):
        want, got = next(plain), next(short)
        assert got["inputs"].shape == (2, rows, length)
        np.testing.assert_array_equal(np.sort(np.asarray(got["positions"]), axis=-1)[0, 0], np.arange(length))
        for key, value in in_stream_order(got).items():
            np.testing.assert_array_equal(value, in_stream_order(want)[key])
    for batch in short.eval_batches(1):  # held-out loss at train.seq_len throughout
        assert batch["inputs"].shape == (2, 4, SEQ)


def test_the_position_resumes_across_a_length_change(tokens):
    curriculum = Curriculum.of(STAGES, SEQ)
    straight = DataIterator(tokens, SEQ, 8, 2, 0, curriculum=curriculum)
    expected = [{k: np.asarray(v) for k, v in next(straight).items()} for _ in range(6)]
    first = DataIterator(tokens, SEQ, 8, 2, 0, curriculum=curriculum)
    for _ in range(2):  # the last step at 8 tokens
        next(first)
    resumed = DataIterator(tokens, SEQ, 8, 2, 0, curriculum=curriculum)
    resumed.restore(json.loads(json.dumps(first.state())))
    for want in expected[2:]:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(np.asarray(got[key]), want[key])


def test_streamed_windows_are_cut_the_same_way_and_resume_by_their_batch_count(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text((assets.ROOT / "data/prideprejudice.txt").read_text(encoding="utf-8")[:60_000])
    tokenizer = text.load_tokenizer(DataConfig().tokenizer)

    def stream(curriculum=None):
        return StreamIterator(lambda start: text.documents(str(path), start=start, streaming=True), tokenizer,
                              SEQ, 8, 2, curriculum=curriculum)

    curriculum = Curriculum.of(STAGES, SEQ)
    plain_it, short_it = stream(), stream(curriculum)
    plain = [in_stream_order(next(plain_it)) for _ in range(6)]
    short = [in_stream_order(next(short_it)) for _ in range(6)]
    for want, got in zip(plain, short):
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
    first = stream(curriculum)
    for _ in range(3):  # one step into the 16-token stage
        next(first)
    saved = json.loads(json.dumps(first.state()))
    assert saved["batches"] == 3
    resumed = stream(curriculum)
    resumed.restore(saved)
    for want in short[3:]:
        np.testing.assert_array_equal(in_stream_order(next(resumed))["inputs"], want["inputs"])
    del saved["batches"]  # a position saved before streams counted their batches
    with pytest.raises(ConfigError, match="does not count its batches"):
        stream(curriculum).restore(saved)
    stream().restore(saved)  # without a curriculum nothing needs the count


# -- training: compiled ahead, resumed exactly, the same on any layout -----------------------------

RUN = ["mesh.dp=1", "mesh.tp=1", "train.batch_size=8", f"train.seq_len={2 * SEQ}", "train.grad_accum=1",
       "train.schedule_steps=4", f"data.curriculum={SEQ}x2", "log.every=1", "log.eval_every=0", "log.peak_flops=1e12"]


def curriculum_cfg(tmp: Path, cache: Path, *overrides: str):
    return load_config("debug", [*RUN, f"data.cache_dir={cache}", f"log.dir={tmp}/run", *overrides])


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token_cache")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache) -> tuple[list[dict], list[int]]:
    """(records, backend compiles seen by each step) of 4 steps on one device: lengths 32, 32, 64, 64."""
    compiles: list[int] = []
    seen: list[int] = []
    listener = lambda event, *_, **__: compiles.append(1) if event.endswith("backend_compile_duration") else None  # noqa: E731
    took = run_report.RunReport.took
    jax.monitoring.register_event_duration_secs_listener(listener)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_report.RunReport, "took", lambda self, length: (seen.append(len(compiles)),
                                                                             took(self, length))[1])
        try:
            records = train(curriculum_cfg(tmp_path_factory.mktemp("straight"), cache, "train.steps=4"),
                            progress=False, devices=jax.devices()[:1])
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
    return records, seen


def test_every_length_is_compiled_before_the_first_step_and_counted_in_mfu(straight):
    records, compiles_at_step = straight
    assert [r["seq_len"] for r in records] == [32, 32, 64, 64]
    # Length 32's step (16 rows: unique to this module, so never an in-memory cache hit) compiled before
    # step 1, and no step compiled anything.
    assert compiles_at_step[0] >= 1 and len(set(compiles_at_step)) == 1
    cfg = load_config("debug", RUN)
    for r in records:  # mfu = tokens/s x FLOPs per token at the step's length / peak
        flops = r["mfu"] * 1e12 / r["tokens_per_sec"]
        assert flops == pytest.approx(model_flops_per_token(cfg.model, r["seq_len"]), rel=1e-9)
    assert model_flops_per_token(cfg.model, 32) < model_flops_per_token(cfg.model, 64)


def test_a_resume_across_a_length_change_repeats_the_straight_losses(straight, cache, tmp_path):
    losses = [r["loss"] for r in straight[0]]
    ckpt = [f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.every=2"]
    train(curriculum_cfg(tmp_path, cache, "train.steps=2", *ckpt), progress=False, devices=jax.devices()[:1])
    resumed = train(curriculum_cfg(tmp_path, cache, "train.steps=4", *ckpt), progress=False,
                    devices=jax.devices()[:1])
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == losses[2:]  # fp32 on CPU: exactly equal


def test_dp2_x_cp2_trains_the_curriculum_as_one_device_does(straight, cache, tmp_path):
    records = train(curriculum_cfg(tmp_path, cache, "train.steps=4", "mesh.dp=2", "mesh.cp=2"), progress=False,
                    devices=jax.devices()[:4])
    # fp32 sums over dp and cp in another order (measured 1.2e-7); a lost update repeats a loss the next step
    # moves by 2e-3 or more (measured on the straight run)
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in straight[0]], rtol=2e-6)


# -- with the other features: the same program as their plain runs --------------------------------

def _lowered(trainer, seq_len: int | None = None) -> str:
    """The text of the step `Trainer.compile_step` compiles for `abstract_batch(seq_len)`, lowered only."""
    with jax.set_mesh(trainer.mesh):
        return trainer.step.jitted.lower(trainer.abstract_state(), trainer.abstract_batch(seq_len)).as_text()


def _is_on(feature: str, trainer, text: str) -> bool:
    """Whether the step really runs `feature`: its state's entries, or its types in the program."""
    from pjax.parallel import outer, streaming

    state = trainer.abstract_state()
    residual = sorted(state.residual or {})
    return {"bf16_reduce": residual == ["error"] and "xbf16>" in text,  # the run itself is float32
            "int8_reduce": residual == ["error"] and "xi8>" in text,
            "powersgd": residual == ["error", "q"],
            "diloco": state.local is not None and type(trainer.diloco) is outer.DiLoCo,
            "streaming": isinstance(trainer.diloco, streaming.StreamingDiLoCo) and trainer.diloco.parts == 2,
            "fp8": "xf8E4M3FN>" in text}[feature]


@pytest.mark.parametrize("feature", [
    pytest.param("bf16_reduce", marks=pytest.mark.proves("bf16_reduce+curriculum")),
    pytest.param("int8_reduce", marks=pytest.mark.proves("int8_reduce+curriculum")),
    pytest.param("powersgd", marks=pytest.mark.proves("powersgd+curriculum")),
    pytest.param("diloco", marks=pytest.mark.proves("diloco+curriculum")),
    pytest.param("streaming", marks=pytest.mark.proves("streaming+curriculum")),
    pytest.param("fp8", marks=pytest.mark.proves("curriculum+fp8")),
])
def test_each_length_s_step_is_the_plain_run_s_program_at_that_length(feature):
    """A curriculum composes with `feature` (the pair's run of `pjax.compose`) because it changes nothing but the
    batch's shape: `pjax.train` compiles the run's one `trainer.step`, from its one state, at `abstract_batch(L)`
    for each length L, so the state (residuals, DiLoCo's groups, fp8's scales) passes through the same step at
    every length, and each length's step is the program of `feature`'s plain run with `train.seq_len=L` and
    `batch_size` times seq_len/L (the same tokens). The lowered texts are compared whole, nothing normalised:
    equal texts (and equal compile options, the one input of the compile not in them) are one executable. With
    the short steps' data proven above (the plain step's tokens) and each plain run by `feature`'s own tests, the
    pair is proven: its step depends on `train.seq_len` only through the batch's shape. `feature` is checked to
    be on, so that the pair cannot pass with it off."""
    from pjax import compose
    from pjax.step import trainer_for

    overrides = compose.run_overrides([compose.BY_NAME[feature], compose.BY_NAME["curriculum"]])
    cfg = load_config("debug", overrides)
    mesh = make_mesh(cfg.mesh, jax.devices()[:cfg.mesh.size])
    trainer = trainer_for(mesh, cfg, cfg.train)
    curriculum = Curriculum.for_run(cfg.data.curriculum, Run(cfg.mesh, cfg.model, cfg.train, cfg.pipeline,
                                                             cfg.context, cfg.precision))
    plain = [o for o in overrides if not o.startswith("data.curriculum=")]
    texts = {}
    for length in curriculum.lengths:
        rows = cfg.train.batch_size * cfg.train.seq_len // length
        twin_cfg = load_config("debug", [*plain, f"train.seq_len={length}", f"train.batch_size={rows}"])
        twin = trainer_for(mesh, twin_cfg, twin_cfg.train)
        texts[length] = _lowered(trainer, length)
        assert texts[length] == _lowered(twin), f"{feature}: the step at length {length} is not its plain run's"
        assert trainer.xla_options == twin.xla_options
        assert _is_on(feature, trainer, texts[length])
    assert len(curriculum.lengths) >= 2 and len(set(texts.values())) == len(texts)  # the lengths' programs differ
