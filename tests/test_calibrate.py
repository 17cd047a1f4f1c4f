"""The planner's calibration measures every kind of figure on this machine: finite, positive, and the
collectives on the 8 forced devices."""
import math
import time

import jax
import jax.numpy as jnp
import pytest

from pjax.plan import calibrate, measurements


@pytest.fixture(scope="module")
def record():
    grids = {"cpu": {"rows": (64,), "square": (64,), "rect": ((64, 128),)}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibrate, "_GRIDS", grids)
        mp.setattr(calibrate, "_ATTENTION", {"cpu": ((1, 128, 2, 32),)})
        mp.setattr(calibrate, "_BANDWIDTH_MB", {"cpu": (1,)})
        mp.setattr(calibrate, "_COLLECTIVE_MB", (0.0625,))
        yield calibrate.calibrate()


def _positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_every_figure_is_measured(record):
    assert record["platform"] == "cpu" and record["devices"] == jax.device_count()
    assert [(r["m"], r["k"], r["n"]) for r in record["matmul"]] == [(64, 64, 64), (64, 64, 128)]
    assert all(_positive(r["seconds"]) and _positive(r["flops_per_s"]) for r in record["matmul"])
    assert all(_positive(b["bytes_per_s"]) for b in record["bandwidth"])
    (att,) = record["attention"]
    assert _positive(att["forward_s"]) and att["forward_backward_s"] > att["forward_s"] / 10
    kinds = {(c["kind"], c["group"]) for c in record["collectives"]}
    assert kinds == {(k, g) for k in ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute") for g in (2, 4, 8)}
    assert all(c["devices"] == 8 and _positive(c["seconds"]) for c in record["collectives"])
    assert measurements.collective_groups(8) == [2, 4, 8] and measurements.collective_groups(6) == [2, 6]
    assert measurements.collective_groups(1) == []


def test_matmul_rate_is_flops_over_time():
    r = calibrate.run_jobs([measurements.matmul_job(32, 48, 16, "float32", repeat=2)], threads=2)[0]
    assert r["flops_per_s"] == pytest.approx(2 * 32 * 48 * 16 / r["seconds"])


def test_the_calibrated_roofline_reads_the_measured_rates(record):
    """On a measured shape the curve returns its measured rate; the compute term is every micro-batch's layer
    products (forward and both backward ones), attention and output layer, at those rates."""
    import dataclasses

    from pjax.config_io import load_config
    from pjax.plan.curves import Curves, compute_seconds, forward_and_backward, layer_matmuls
    from pjax.plan.estimate import predict
    from pjax.plan.layouts import Layout
    from pjax.plan.profiles import PROFILES

    curves = Curves(record)
    for r in record["matmul"]:
        assert curves.matmul_seconds(r["m"], r["k"], r["n"]) == pytest.approx(r["seconds"], rel=1e-9)
    config = load_config("debug", ["train.batch_size=8", "train.grad_accum=2", "train.seq_len=64"])
    layout = Layout(dp=2, tp=2, grad_accum=2)
    mc = config.model
    layer = sum(forward_and_backward(curves, s) for s in layer_matmuls(mc, 2 * 64, 2))
    layer += curves.attention_seconds(2, 64, mc.num_attention_heads / 2, mc.head_dim)
    head = forward_and_backward(curves, (2 * 64, mc.hidden_size, mc.vocab_size // 2))
    assert compute_seconds(curves, config, layout) == pytest.approx(2 * (mc.num_hidden_layers * layer + head))
    profile = dataclasses.replace(PROFILES["cpu"], curves=curves)  # 4 devices share the host's rate
    p = predict(config, layout, profile, {}, 0, 1.0)
    assert p.terms["compute"] == pytest.approx(4 * compute_seconds(curves, config, layout))


def test_a_compiled_step_s_matmuls_are_replayed_at_their_calibrated_rates(record):
    """With a calibration and a compile (pp = 1), compute is each compiled product's runs at its shape's rate (a
    product and its transpose alike), plus attention's curve where cuDNN's fused kernel runs it; `--explain`
    lists the products, the longest first."""
    import dataclasses

    from pjax.config_io import load_config
    from pjax.observe.hlo_flops import StepMatmuls
    from pjax.plan.breakdown import breakdown
    from pjax.plan.curves import Curves
    from pjax.plan.estimate import predict
    from pjax.plan.layouts import Layout
    from pjax.plan.profiles import PROFILES

    curves = Curves(record)
    assert curves.matmul_seconds(64, 64, 128) == pytest.approx(curves.matmul_seconds(128, 64, 64), rel=1e-12)
    config = load_config("debug", ["train.batch_size=8", "train.grad_accum=2", "train.seq_len=64"])
    layout, mc = Layout(dp=2, tp=2, grad_accum=2), config.model
    profile = dataclasses.replace(PROFILES["cpu"], curves=curves)  # 4 devices share the host's rate
    products = ((64, 64, 64, 10), (64, 64, 128, 3))
    step = 10 * curves.matmul_seconds(64, 64, 64) + 3 * curves.matmul_seconds(64, 64, 128)
    p = predict(config, layout, profile, {}, 0, 1.0, StepMatmuls(products))
    assert p.terms["compute"] == pytest.approx(4 * step)
    attention = 2 * mc.num_hidden_layers * curves.attention_seconds(2, 64, mc.num_attention_heads / 2, mc.head_dim)
    fused = predict(config, layout, profile, {}, 0, 1.0, StepMatmuls(products, fused_attention=True))
    assert attention > 0 and fused.terms["compute"] == pytest.approx(4 * (step + attention))
    moe = load_config("mixtral-tiny")  # before a compile its experts' matmuls are only in the model's FLOPs
    plain = predict(moe, layout, PROFILES["cpu"], {}, 0, 1.0).terms["compute"]
    assert predict(moe, layout, profile, {}, 0, 1.0).terms["compute"] == pytest.approx(plain)
    assert predict(moe, layout, profile, {}, 0, 1.0, StepMatmuls(products)).terms["compute"] == pytest.approx(4 * step)
    text = breakdown(config, layout, profile, {}, p, StepMatmuls(products))
    assert "the compiled step's matmuls below" in text
    ranked = {line.split()[0]: line for line in text.splitlines() if line.startswith("#")}
    longest = sorted(products, key=lambda p: -p[3] * curves.matmul_seconds(*p[:3]))  # the measured rates decide
    assert [f"{m} x {k} x {n} " in ranked[f"#{i + 1}"] for i, (m, k, n, _) in enumerate(longest)] == [True, True]


def test_a_config_s_own_products_are_those_its_compiled_step_runs():
    """`--config`: the shapes of the step compiled for one device, the output layer's among them."""
    from pjax.config_io import load_config

    overrides = ["train.batch_size=4", "train.grad_accum=2", "train.seq_len=64"]
    shapes = measurements.model_products("debug", overrides)
    mc = load_config("debug", overrides).model
    tokens = 4 // 2 * 64
    assert len(shapes) == len(set(shapes)) > 3
    assert any(k == mc.hidden_size and {m, n} == {tokens, mc.padded_vocab_size} for m, k, n in shapes)


def test_plan_calibrate_measures_this_machine_once_and_refuses_another_kind(record, tmp_path, capsys, monkeypatch):
    """`python -m pjax.plan --calibrate`: measured on the first call, read back from the cache on the next (but
    measured again once the record's form has changed); planning an H100 on this CPU with it, or with its
    record as `--calibration`, is one line that says what to do instead."""
    from pjax.plan import __main__ as plan_cli

    first, path, fresh = calibrate.this_machine("cpu", str(tmp_path))
    assert fresh and path.startswith(str(tmp_path)) and first["devices"] == jax.device_count()
    assert first["form"] == calibrate.FORM
    again, same, fresh_again = calibrate.this_machine("cpu", str(tmp_path))
    assert (again, same, fresh_again) == (first, path, False)
    with monkeypatch.context() as m:  # another form: not the cached record (the measurement itself stood in for)
        m.setattr(calibrate, "FORM", calibrate.FORM + 1)
        m.setattr(calibrate, "calibrate", lambda **_: {"form": calibrate.FORM})
        newer, other, measured = calibrate.this_machine("cpu", str(tmp_path))
        assert measured and other != path and newer == {"form": calibrate.FORM}
    code = plan_cli.main(["--devices", "1", "--device-kind", "h100", "--xla", "cpu", "--calibrate",
                          "--cache", str(tmp_path), "--explain", "1-m1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "not h100's" in err[0] and "--calibration FILE" in err[0]
    # the record read back for another kind: refused before any compile, in one line
    code = plan_cli.main(["--devices", "1", "--device-kind", "h100", "--xla", "cpu", "--calibration", path,
                          "--explain", "1-m1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "was measured on cpu, not on h100: plan with --device-kind cpu," in err[0]
    code = plan_cli.main(["--devices", "1", "--calibrate", "--calibration", path, "--explain", "1-m1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "give one of them" in err[0]


def test_a_timed_call_runs_enough_products_within_the_operand_budget():
    """A CPU call runs up to 32 small products, a GPU call up to 4 (XLA:GPU compiles each on its own), and a
    product too big for the operand budget still runs twice."""
    assert measurements.products_per_call(8, 8, 8, 4, "cpu") == 32
    small = measurements.products_per_call(8, 8, 8, 4, "gpu")
    big = measurements.products_per_call(16384, 8192, 49152, 2, "gpu")
    assert small == 4 and big == 2
    fits = measurements.products_per_call(256, 256, 256, 4, "cpu")
    assert 2 < fits < 32 and fits * 2 * 256**3 >= 2e8


def test_a_timed_sample_queues_its_chain_of_calls_and_reports_seconds_per_call():
    calls = []

    def fn(x):  # 20 ms a call: a sample of 3 takes 60 ms, of which timed reports a call's share
        calls.append(time.perf_counter())
        time.sleep(0.02)
        return x + 1
    seconds = calibrate.timed(fn, jnp.ones(3), calls=2, chain=3)
    # sleep's overshoot and the scheduler (measured 0.0205); a sample's whole 0.06 or a share of 6 calls' (0.01) fail
    assert len(calls) == 1 + 2 * 3 and 0.02 <= seconds < 0.04


def test_the_calibrated_link_is_a_fit_to_the_measured_collectives_of_each_group_size(record):
    """Collectives within a host cost the fitted latency per op and seconds per link byte of the measured group
    size nearest the row's (all devices without one); the fit stays within the measured points' own spread."""
    import dataclasses

    from pjax.plan.curves import Curves, link_bytes
    from pjax.plan.estimate import comm_seconds
    from pjax.plan.profiles import PROFILES

    curves = Curves(record)
    assert sorted(curves.links) == [2, 4, 8] and curves.link == curves.links[8]
    assert curves.link_for(None)[0] == 8 and curves.link_for(3)[0] == 4 and curves.link_for(64)[0] == 8
    profile = dataclasses.replace(PROFILES["cpu"], curves=curves)
    for group in (2, 4, 8):
        latency, per_byte = curves.links[group]
        assert latency >= 0 and per_byte > 0
        row = {"count": 3, "link_bytes": 1e6, "inter_host": False, "group": group}
        assert comm_seconds(row, profile, 8) == pytest.approx(3 * latency + 1e6 * per_byte)
        measured = [c for c in record["collectives"] if c["group"] == group]
        psum = next(c for c in measured if c["kind"] == "psum")
        assert link_bytes(psum) == pytest.approx(2 * (group - 1) / group * psum["megabytes"] * 2**20)  # a ring's
        seconds = [c["seconds"] for c in measured]  # a busy host spreads them: the fit stays inside that spread
        assert min(seconds) / 2 < latency + link_bytes(psum) * per_byte < 2 * max(seconds)


def test_explain_breaks_the_prediction_into_its_terms_and_their_sources(record):
    """`--explain`'s breakdown: each term's milliseconds are the prediction's, the bubble names its schedule's
    ratio, a collective row says how it was charged, and the products' table gives the curves' own times."""
    import dataclasses

    from pjax.config_io import load_config
    from pjax.plan.breakdown import breakdown
    from pjax.plan.curves import Curves, forward_and_backward
    from pjax.plan.estimate import predict
    from pjax.plan.pipeline_cost import pipeline_ratio, weight_share
    from pjax.plan.layouts import Layout
    from pjax.plan.profiles import PROFILES

    config = load_config("debug", ["train.batch_size=8", "train.grad_accum=2", "train.seq_len=64"])
    layout = Layout(dp=2, pp=2, grad_accum=2)
    profile = dataclasses.replace(PROFILES["cpu"], curves=Curves(record))
    comm = {"dp": {"count": 3, "link_bytes": 1e6, "inter_host": False}}
    p = predict(config, layout, profile, comm, 0, 1.0)
    text = breakdown(config, layout, profile, comm, p)
    rows = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    ms = lambda name: float(rows[name].split()[1].replace(",", ""))  # noqa: E731
    for term in ("compute", "bubble", "dp"):  # printed to 0.01 ms: off by 0.005 at most (measured 4.3e-3)
        assert ms(term) == pytest.approx(p.terms[term] * 1e3, abs=0.006)
    assert ms("step") == pytest.approx(p.step_s * 1e3, abs=0.006)
    ratio = pipeline_ratio(layout, weight_share(config.model, 64))
    assert f"1f1b p=2 m=2 v=1: span / busy = {ratio:.3f}" in rows["bubble"]
    assert "3 ops x" in rows["dp"] and "(fitted to the calibration's collectives in groups of 8); exposed" in rows["dp"]
    tokens = 8 // 2 // 2 * 64
    d = config.model.hidden_size
    assert f"{tokens} x {d} x {config.model.num_attention_heads * config.model.head_dim}" in rows["q"]
    assert float(rows["q"].split()[-2]) == pytest.approx(  # printed to 0.001 ms (measured 1.9e-4)
        forward_and_backward(profile.curves, (tokens, d, d)) * 1e3, abs=6e-4)


@pytest.fixture(scope="module")
def piped():
    """What a 2-stage pipeline of the debug model pays on these 8 devices (`pipeline_cost.measure_pipeline`)."""
    from pjax.plan.pipeline_cost import measure_pipeline

    return measure_pipeline("debug", ["train.seq_len=32"], steps=1, rounds=1)


def test_a_pipeline_s_cost_is_its_step_measured_against_the_step_without_one(piped):
    """The section times the model's own step at dp4 x pp2 (four micro-batches) and at dp8 (two: the same
    products) and records the pipeline's extra time; a batch the layouts cannot split is one line, not a
    traceback."""
    from pjax.config_io import load_config
    from pjax.plan.pipeline_cost import pipeline_ratio, weight_share
    from pjax.plan.layouts import Layout
    from pjax.plan.pipeline_cost import measure_pipeline

    assert (piped["pipeline"], piped["flat"]) == ("dp4-pp2-m4", "dp8-m2") and piped["devices"] == 8
    assert _positive(piped["flat_s"]) and _positive(piped["pipeline_s"])
    config = load_config("debug", ["train.seq_len=32"])
    ratio = pipeline_ratio(Layout(dp=4, pp=2, grad_accum=4), weight_share(config.model, 32))
    assert piped["table_ratio"] == pytest.approx(ratio) and ratio > 1
    extra = piped["pipeline_s"] / piped["flat_s"] - 1
    assert piped["extra"] == pytest.approx(extra) and piped["extra_by_round"] == [round(extra, 4)]
    bad = measure_pipeline("debug", ["train.batch_size=8"])
    assert "error" in bad and "batch_size" in bad["error"] and "\n" not in bad["error"]


def test_the_roofline_charges_a_pipeline_its_ticks_share_and_the_bubble_the_machine_pays(record, piped):
    """With the measurement a pipeline costs its work times one plus its ticks' share: on a shared host that is
    its measured extra time and the bubble is free, except for a lockstep table (cp > 1), whose idle stages
    compute; on devices of their own the whole bubble is paid and the share is what is left of the measured
    time after it. Without a measurement, the whole bubble, and `--explain` says how to measure one."""
    import dataclasses

    from pjax.config_io import load_config
    from pjax.plan.breakdown import breakdown
    from pjax.plan.curves import Curves
    from pjax.plan.estimate import predict
    from pjax.plan.pipeline_cost import pipeline_ratio, weight_share
    from pjax.plan.layouts import Layout
    from pjax.plan.pipeline_cost import ticks_share
    from pjax.plan.profiles import PROFILES

    config = load_config("debug", ["train.batch_size=8", "train.grad_accum=2", "train.seq_len=64"])
    timed = {**piped, "flat_s": 1.0, "pipeline_s": 1.8}  # the shares fixed: the measured ones may be 0
    own = 1.8 / timed["table_ratio"] - 1  # devices of their own: what is left after the whole bubble
    assert ticks_share(timed, True) == pytest.approx(0.8) and 0 < own == pytest.approx(ticks_share(timed, False))
    assert ticks_share(piped, True) == pytest.approx(max(0.0, piped["extra"]))
    curves = Curves({**record, "pipeline": timed})
    plain = dataclasses.replace(PROFILES["cpu"], curves=Curves(record))
    shared, apart = (dataclasses.replace(PROFILES[kind], curves=curves) for kind in ("cpu", "h100"))
    # (layout, profile, the step over its work as a function of the table's ratio, what --explain says)
    cases = [(Layout(dp=2, pp=2, grad_accum=2), shared, lambda r: 1.8, "bubble free (shared cores) x 1.800"),
             (Layout(pp=2, cp=2, grad_accum=2, dp=1), shared, lambda r: r * 1.8,
              "(lockstep: idle stages compute) x 1.800"),
             (Layout(dp=2, pp=2, grad_accum=2), apart, lambda r: r * (1 + own), f"(the whole bubble) x {1 + own:.3f}")]
    for layout, profile, factor, why in cases:
        whole, paid = (predict(config, layout, p, {}, 0, 1.0) for p in (plain, profile))
        ratio = pipeline_ratio(layout, weight_share(config.model, 64))
        assert whole.terms["bubble"] == pytest.approx(whole.terms["compute"] * (ratio - 1))
        assert paid.terms["bubble"] == pytest.approx(paid.terms["compute"] * (factor(ratio) - 1))
        bubble_row = next(line for line in breakdown(config, layout, profile, {}, paid).splitlines()
                          if line.startswith("bubble"))
        assert why in bubble_row and "the ticks' share measured by dp4-pp2-m4 against dp8-m2 of debug" in bubble_row
    text = breakdown(config, Layout(dp=2, pp=2, grad_accum=2), plain, {}, whole)
    assert "the whole bubble (the calibration measured no pipeline: calibrate with --config)" in text


def test_the_pipeline_section_without_a_model_is_one_line(monkeypatch):
    monkeypatch.setattr("sys.argv", ["calibrate", "--only", "pipeline"])
    with pytest.raises(SystemExit) as exit_:
        calibrate.main()
    assert str(exit_.value) == "--only pipeline measures a model's step: give it --config NAME [overrides]"


@pytest.fixture(scope="module")
def streamed():
    """What tp 4 repeats of the debug model's step on these 8 devices (`stream_cost.measure_stream`); its 2
    key/value heads made 4 for tp 4."""
    from pjax.plan.stream_cost import measure_stream

    return measure_stream("debug", ["train.seq_len=32", "model.num_key_value_heads=4"], steps=1, rounds=1)


def test_the_stream_section_times_a_tp_step_against_its_sequence_parallel_twin(streamed):
    """The section times the model's own step at dp2 x tp4 without and with sequence parallelism and records
    what each device holds (tokens per step, layers, hidden size); tp 2 where 4 does not divide the devices; a
    batch the layouts cannot split is one line, not a traceback."""
    from pjax.plan.layouts import Layout
    from pjax.plan.stream_cost import measure_stream, pair

    assert (streamed["plain"], streamed["split"], streamed["tp"], streamed["devices"]) == (
        "dp2-tp4-m2", "dp2-tp4-sp-m2", 4, 8)
    assert _positive(streamed["plain_s"]) and _positive(streamed["split_s"])
    saved = streamed["plain_s"] / streamed["split_s"] - 1
    assert streamed["saved"] == pytest.approx(saved) and streamed["saved_by_round"] == [round(saved, 4)]
    assert (streamed["tokens_per_device"], streamed["layers"], streamed["hidden_size"]) == (16 * 32 // 2, 2, 128)
    assert pair(6, 4) == (Layout(dp=3, tp=2, grad_accum=2), Layout(dp=3, tp=2, grad_accum=2, sequence_parallel=True))
    assert pair(8, 2)[0] == Layout(dp=4, tp=2, grad_accum=2)  # 2 key/value heads: tp 2
    bad = measure_stream("debug", ["train.batch_size=6"])
    assert "error" in bad and "batch_size" in bad["error"] and "\n" not in bad["error"]


def test_the_roofline_charges_tp_the_stream_work_it_repeats(record, streamed):
    """Each device's tokens times its layers at the measured cost per token and layer: repeated in full on each
    device of a tp group, split over it under sequence parallelism, again for remat's recompute and in
    proportion to the hidden size; so the measured pair's difference comes back exactly, on a shared host
    and on devices of their own. `--explain` says where the cost came from, or that it was not measured."""
    import dataclasses

    from pjax.config_io import load_config
    from pjax.plan.breakdown import breakdown
    from pjax.plan.curves import Curves
    from pjax.plan.estimate import predict
    from pjax.plan.layouts import Layout
    from pjax.plan.profiles import PROFILES
    from pjax.plan.stream_cost import stream_seconds

    overrides = ["train.batch_size=8", "train.grad_accum=2", "train.seq_len=64"]
    config = load_config("debug", overrides)
    timed = {**streamed, "overrides": overrides, "plain_s": 1.3, "split_s": 1.0, "tokens_per_device": 8 * 64 // 2}
    plain, split = Layout(dp=2, tp=4, grad_accum=2), Layout(dp=2, tp=4, grad_accum=2, sequence_parallel=True)
    for kind in ("cpu", "h100"):
        profile = dataclasses.replace(PROFILES[kind], curves=Curves({**record, "stream": timed}))
        charged = {layout: stream_seconds(config, layout, profile)[0] for layout in (plain, split)}
        assert charged[plain] - charged[split] == pytest.approx(0.3)
        assert charged[plain] == pytest.approx(4 * charged[split])
    flat = Layout(dp=8, grad_accum=2)
    assert stream_seconds(config, flat, profile)[0] == pytest.approx(charged[split])
    remat = dataclasses.replace(flat, remat="full")
    assert stream_seconds(config, remat, profile)[0] == pytest.approx(4 / 3 * charged[split])
    wide = load_config("debug", [*overrides, "model.hidden_size=256"])
    assert stream_seconds(wide, flat, profile)[0] == pytest.approx(2 * charged[split])
    without = dataclasses.replace(profile, curves=Curves(record))
    p, q = (predict(config, plain, prof, {}, 0, 1.0) for prof in (profile, without))
    assert p.terms["stream"] == pytest.approx(charged[plain]) and q.terms["stream"] == 0
    assert p.step_s == pytest.approx(q.step_s + charged[plain])
    row = lambda prof, pred: next(line for line in breakdown(config, plain, prof, {}, pred).splitlines()  # noqa: E731
                                  if line.startswith("stream"))
    assert "repeated on each of tp = 4; measured by dp2-tp4-m2 against dp2-tp4-sp-m2 of debug" in row(profile, p)
    assert "0 (not measured: calibrate with --config)" in row(without, q)
