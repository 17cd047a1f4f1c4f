"""What a pipeline pays on this machine beyond its work, measured on the model at hand.

A schedule's table says how long a device idles (the bubble, `pipeline_ratio`). What the machine
pays for it is another matter. On devices of their own every tick ends in a permute that all of them meet,
so an idle tick lasts as long as the busiest device's item: the whole bubble is paid. On forced CPU devices
that share a host's cores, the stages with work run on the idle stages' cores, so the bubble costs next to
nothing. Either way each tick also does work of its own (the conditionals, the slot writes and reads, the
permutes' rendezvous), which grows with the step's work, not with its bubble: on this host a pipeline's extra
time was about the same share of its step for every schedule (benchmarks/README.md, "What a pipeline pays,
per schedule"). That share is measured whole: the model's own training step at pp = 2 (1F1B, four
micro-batches, the other devices on dp) against the same step without a pipeline at two micro-batches, whose
products have the same shapes and which does the same FLOPs per device (`step_pairs`). `pipeline_factor`
turns it into what the roofline charges a layout: its work, times the table's span over busy time where the
bubble is paid, times one plus the ticks' share."""
from __future__ import annotations

from typing import Any, Sequence

import jax

from mesh.errors import ConfigError
from models.config import LlamaConfig
from pjax.config_io import load_config
from pjax.observe.metrics import expert_mlps_per_token
from pjax.parallel.pipeline.table import PipelineConfig, make_schedule
from pjax.plan.layouts import Layout
from pjax.plan.profiles import Profile
from pjax.plan.step_pairs import timed_pair

_MICRO_BATCHES = 2  # the flat step's; the pipeline's dp is half, so twice as many give the same products


def weight_share(cfg: LlamaConfig, seq_len: int) -> float:
    """A layer's W in forwards, its backward being 2: W lacks attention's share (its backward is B's)."""
    d, f, h, kv, dh = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                       cfg.head_dim)
    projections = 2 * (d * dh * (2 * h + 2 * kv) + expert_mlps_per_token(cfg) * 3 * d * f)
    attention = 2 * seq_len * h * dh  # QK^T and PV over T/2 keys on average
    return projections / (projections + attention)


def pipeline_ratio(layout: Layout, weight: float = 1.0) -> float:
    """The schedule's span over a device's busy time (1 without a pipeline), a backward twice a forward."""
    if layout.pp == 1:
        return 1.0
    m, p, v = layout.grad_accum, layout.pp, layout.virtual_stages
    # The table the executor runs: in lockstep with cp > 1 (`table.make_schedule`).
    sched = make_schedule(PipelineConfig(layout.schedule, v), p, m, lockstep=layout.cp > 1)
    return sched.span(1.0, 2.0, weight) / (3.0 * m * v)


def pair(devices: int) -> tuple[Layout, Layout]:
    """(the flat step, the pipeline) the section times on `devices`: dp n at two micro-batches, and dp n/2 x
    pp 2 at four, so that every product has the same rows and every device the same FLOPs."""
    return (Layout(dp=devices, grad_accum=_MICRO_BATCHES),
            Layout(dp=devices // 2, pp=2, grad_accum=2 * _MICRO_BATCHES))


def measure_pipeline(config_name: str, overrides: Sequence[str] = (), steps: int = 3, rounds: int = 3
                     ) -> dict[str, Any]:
    """The record of the `pipeline` calibration section: both steps' seconds (`pair`), the pipeline's table
    ratio of span to busy time and `extra`, its step's time over the flat one's, less one, of the median of
    `rounds` rounds (`step_pairs.timed_pair`); an `error` where this machine has fewer than 2 devices or an odd
    number, or the layouts cannot split the config."""
    n = len(jax.devices())
    fixed: dict[str, Any] = {"config": config_name, "overrides": list(overrides), "devices": n}
    if n < 2 or n % 2:
        return {**fixed, "error": f"a pipeline of 2 stages needs an even number of devices, not {n}"}
    flat, piped = pair(n)
    try:
        flat_s, piped_s, by_round = timed_pair(config_name, overrides, flat, piped, steps, rounds)
    except ConfigError as e:  # e.g. a batch that dp x micro-batches does not divide: said, not raised
        return {**fixed, "error": f"{piped.name} against {flat.name}: {e}"}
    cfg = load_config(config_name, overrides)
    ratio = pipeline_ratio(piped, weight_share(cfg.model, cfg.train.seq_len))
    return {**fixed, "flat": flat.name, "pipeline": piped.name, "flat_s": flat_s, "pipeline_s": piped_s,
            "table_ratio": ratio, "extra": piped_s / flat_s - 1.0, "extra_by_round": by_round}


def ticks_share(measured: dict[str, Any], shares_host: bool) -> float:
    """What a pipeline's ticks cost beyond its work and the bubble it pays, as a share of that: its measured
    extra time where the host's cores are shared (the bubble free), else what is left of it after the
    table's whole bubble; never below 0 (a faster pipeline is this host's noise, not a gain)."""
    paid = 1.0 if shares_host else measured["table_ratio"]
    return max(0.0, measured["pipeline_s"] / (measured["flat_s"] * paid) - 1.0)


def pipeline_factor(layout: Layout, profile: Profile, ratio: float) -> tuple[float, str]:
    """(the layout's pipelined step over its work, why), `ratio` being its table's span over busy time. Without
    a calibration's pipeline measurement, the whole bubble. With one, its ticks' share (`ticks_share`) on top
    of the bubble the machine pays: the whole bubble on devices of their own, and for a lockstep table (cp >
    1), whose idle stages run the tick's op on a discard slot, so there the bubble is work; none on devices
    that share a host's cores (which assumes that the busy stages' devices outnumber the cores, as this host's
    8 devices on 2 cores do)."""
    if layout.pp == 1:
        return 1.0, "no pipeline"
    if profile.curves is None:
        return ratio, "the whole bubble"
    measured = profile.curves.pipeline
    if measured is None:
        return ratio, "the whole bubble (the calibration measured no pipeline: calibrate with --config)"
    ticks = ticks_share(measured, profile.shares_host)
    source = f"{measured['pipeline']} against {measured['flat']} of {measured['config']}"
    if profile.shares_host and layout.cp == 1:
        return 1.0 + ticks, f"bubble free (shared cores) x {1 + ticks:.3f}, the ticks' share measured by {source}"
    why = "lockstep: idle stages compute" if layout.cp > 1 else "the whole bubble"
    return ratio * (1.0 + ticks), f"x {ratio:.3f} ({why}) x {1 + ticks:.3f}, the ticks' share measured by {source}"
