"""Why a layout's predicted step takes what it takes (`python -m pjax.plan --explain`): each term of
`estimate.predict` next to what it was computed from — the matmul shapes and the rates the calibrated curves
gave them (or the profile's one MFU number), the residual stream's work that tp repeats, the schedule's
bubble ratio, each set of mesh axes' collectives as ops x latency + ring bytes / bandwidth, and whether the
roofline hides it behind compute."""
from __future__ import annotations

from typing import Any

from pjax.observe.hlo_flops import StepMatmuls
from pjax.plan.curves import LAYER_PRODUCTS, forward_and_backward, layer_matmuls, micro_batch
from pjax.plan.estimate import DP_AXES, Prediction, across_link_bytes, compute_model, link_model, per_device
from pjax.plan.layouts import Layout
from pjax.plan.pipeline_cost import pipeline_factor, pipeline_ratio, weight_share
from pjax.plan.profiles import Profile, host_share
from pjax.plan.stream_cost import stream_seconds


def breakdown(config: Any, layout: Layout, profile: Profile, comm: dict[str, dict[str, Any]],
              prediction: Prediction, matmuls: StepMatmuls | None = None) -> str:
    """The terms of `prediction` as a table with their sources, then the matmuls it timed (with curves): the
    compiled step's (`matmuls`, `observe.hlo_flops.StepMatmuls`) where `estimate.compute_model` replays them."""
    mc, tc = config.model, config.train
    devices = layout.dp * layout.pp * layout.cp * layout.tp
    share = host_share(profile, devices)
    executed, why = prediction.executed
    again = f" x {executed:.3g} ({why})" if executed != 1 else ""
    model = compute_model(config, profile, matmuls, layout)
    if model == "efficiency":
        source = (f"model FLOPs{again} at {100 * profile.efficiency(mc.hidden_size):.1f}% of "
                  f"{per_device(profile, devices)[0] / 1e12:,.2f} TFLOP/s (the profile's MFU at hidden "
                  f"{mc.hidden_size})")
    elif model == "replay":
        source = (f"the compiled step's matmuls below ({matmuls.flops / 1e12:,.4g} TFLOP) at the calibrated rates "
                  f"of {profile.curves.device_kind}" + (", and cuDNN's attention at its curve's"
                                                         if matmuls.fused_attention else "")
                  + (f", x {share} devices sharing the host" if share > 1 else ""))
    else:
        source = (f"the matmuls and attention below at the calibrated rates of {profile.curves.device_kind}{again}"
                  + (f", x {share} devices sharing the host" if share > 1 else ""))
    ratio = pipeline_ratio(layout, weight_share(mc, tc.seq_len))
    bubble = (f"{layout.schedule} p={layout.pp} m={layout.grad_accum} v={layout.virtual_stages}: span / busy = "
              f"{ratio:.3f}; {pipeline_factor(layout, profile, ratio)[1]}" if layout.pp > 1 else "no pipeline")
    terms = [("compute", prediction.terms["compute"], source),
             ("stream", prediction.terms["stream"], stream_seconds(config, layout, profile)[1]),
             ("bubble", prediction.terms["bubble"], bubble)]
    for axes, row in sorted(comm.items(), key=lambda kv: -prediction.terms[kv[0]]):
        hidden = "overlapped with compute" if axes in DP_AXES and profile.overlap_dp else "exposed"
        terms.append((axes, prediction.terms[axes], f"{_link(row, profile, devices)}; {hidden}"))
    total = prediction.step_s
    how = "max(compute + stream + bubble, dp traffic) + the rest" if profile.overlap_dp else "the sum of the terms"
    rows = [("term", "ms", "of step", "from")]
    rows += [(name, _ms(t), f"{100 * t / total:.0f}%", why) for name, t, why in terms]
    rows.append(("step", _ms(total), "100%", how))
    parts = [_table(rows)]
    if model == "replay":
        parts.append(_replay_table(profile.curves, matmuls))
    elif model == "curves":
        parts.append(_matmul_table(profile.curves, config, layout))
    return "\n\n".join(parts)


def _link(row: dict[str, Any], profile: Profile, devices: int) -> str:
    """How `estimate.comm_seconds` charged one row of collectives: its ops' latency, then its link bytes inside a
    host and across hosts, each at its link's rate."""
    latency = link_model(row, profile, devices, row["inter_host"])[0]
    across = across_link_bytes(row)
    parts = [f"{row['count']:g} ops x {latency * 1e6:,.1f} us"]
    for nbytes, crossing in ((row["link_bytes"] - across, False), (across, True)):
        if nbytes or (not crossing and not across):
            _, per_byte, source = link_model(row, profile, devices, crossing)
            parts.append(f"{nbytes / 1e6:,.2f} MB at {1 / per_byte / 1e9:,.2f} GB/s ({source})")
    return " + ".join(parts)


def _matmul_table(curves: Any, config: Any, layout: Layout) -> str:
    """Each product of one layer and the output layer on one device: its shape, forward + backward time, rate."""
    mc, tc = config.model, config.train
    rows_per_micro, tokens = micro_batch(config, layout)
    shapes = list(zip(LAYER_PRODUCTS, layer_matmuls(mc, tokens, layout.tp)))
    shapes.append(("output", (tokens, mc.hidden_size, mc.vocab_size // layout.tp)))
    rows = [("product (per micro-batch)", "rows x contraction x columns", "fwd+bwd ms", "TFLOP/s")]
    for name, (m, k, n) in shapes:
        seconds = forward_and_backward(curves, (m, k, n))
        rows.append((name, f"{m} x {k} x {n}", f"{seconds * 1e3:,.3f}", f"{3 * 2 * m * k * n / seconds / 1e12:,.2f}"))
    attention = curves.attention_seconds(rows_per_micro, tc.seq_len // layout.cp, mc.num_attention_heads / layout.tp,
                                         mc.head_dim)
    rows.append(("attention", f"{rows_per_micro} x {tc.seq_len // layout.cp} tokens",
                 f"{attention * 1e3:,.3f}" if attention else "not calibrated (0)", ""))
    return _table(rows)


def _replay_table(curves: Any, matmuls: StepMatmuls, shown: int = 12) -> str:
    """The compiled step's matmul shapes on one device, the longest first: runs per step (a pipeline's: an
    average device's, so maybe a fraction), time, rate."""
    timed = sorted(((runs * curves.matmul_seconds(m, k, n), (m, k, n), runs) for m, k, n, runs in matmuls.products),
                   reverse=True)
    rows = [("compiled matmul", "rows x contraction x columns", "runs per step", "ms", "TFLOP/s")]
    for i, (seconds, (m, k, n), runs) in enumerate(timed[:shown]):
        count = f"{runs:,.0f}" if runs == int(runs) else f"{runs:,.2f}"
        rate = f"{2 * m * k * n * runs / seconds / 1e12:,.2f}"
        rows.append((f"#{i + 1}", f"{m} x {k} x {n}", count, _ms(seconds), rate))
    if len(timed) > shown:
        rows.append((f"{len(timed) - shown} more", "", "", _ms(sum(t for t, _, _ in timed[shown:])), ""))
    return _table(rows)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
