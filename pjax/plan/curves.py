"""A calibration record (`python -m pjax.plan.calibrate`) as the roofline's compute: each of a layout's matmuls
timed at its own shape and each layer's attention at its own, from the rates measured on the target, in place
of the peak times one MFU number (`Profile.efficiency`).

A shape that was not measured takes the rate of the measured ones nearest to it in log(rows, contraction,
columns), weighted by inverse distance: matmul throughput varies smoothly with the sizes and by 10x across
them (benchmarks/README.md, "One H100" and "One H200"). A backward matmul is two products of the forward's
FLOPs, each timed at its own transposed shape. What the curves do not hold (norms, RoPE, SwiGLU, the
optimizer: memory-bound work) is not counted here; the residual stream's share of it, which tp repeats on each
of its devices, is measured whole and priced apart (`stream_cost`)."""
from __future__ import annotations

import json
import math
from typing import Any

from pjax.observe.hlo import link_factor

_NEAREST = 3


class Curves:
    """The measured matmul and attention rates of one device kind, in one dtype."""

    def __init__(self, record: dict[str, Any], dtype: str | None = None) -> None:
        rows = [r for r in record["matmul"] if "flops_per_s" in r]
        dtype = dtype or ("bfloat16" if record["platform"] == "gpu" else "float32")
        self.device_kind, self.dtype = record["device_kind"], dtype
        self._matmul = [(_at(r["m"], r["k"], r["n"]), r["flops_per_s"]) for r in rows if r["dtype"] == dtype]
        if not self._matmul:
            raise ValueError(f"the calibration of {self.device_kind} holds no {dtype} matmul")
        self._attention = [((math.log(a["seq"]), math.log(a["head_dim"])), a["forward_backward_flops_per_s"])
                           for a in record.get("attention", [])]
        # per group size, (seconds per op, seconds per link byte); `link` is the largest group's, or None
        self.links = _fit_links(record.get("collectives", []))
        self.link = self.links[max(self.links)] if self.links else None
        # a pipeline's step and the same step without one, timed here (`pipeline_cost`), or None
        measured = record.get("pipeline") or {}
        self.pipeline = measured if "pipeline_s" in measured else None
        # a tp step and the same step with sequence parallelism, timed here (`stream_cost`), or None
        measured = record.get("stream") or {}
        self.stream = measured if "plain_s" in measured else None

    def link_for(self, group: int | None) -> tuple[int, tuple[float, float]] | None:
        """(group size, its fit) of the measured group size nearest `group` in log (the largest for None)."""
        if not self.links:
            return None
        size = max(self.links) if group is None else min(
            self.links, key=lambda g: (abs(math.log(g) - math.log(max(group, 1))), -g))
        return size, self.links[size]

    @classmethod
    def load(cls, path: str, dtype: str | None = None) -> "Curves":
        with open(path) as f:
            return cls(json.load(f), dtype)

    def matmul_seconds(self, m: float, k: float, n: float) -> float:
        """One [m, k] x [k, n] product."""
        return 2 * m * k * n / _nearest(self._matmul, _at(m, k, n))

    def attention_seconds(self, rows: float, seq: int, heads: float, head_dim: int) -> float:
        """Causal attention forward and backward over `rows` sequences of `seq` tokens (3x the forward's
        2·B·H·T²·D FLOPs), at the rate measured nearest in (seq, head_dim); 0 when none was measured."""
        if not self._attention:
            return 0.0
        flops = 3 * 2 * rows * heads * seq * seq * head_dim
        return flops / _nearest(self._attention, (math.log(seq), math.log(head_dim)))


def _at(m: float, k: float, n: float) -> tuple[float, float, float]:
    """A product's point on the curves: its transpose ([n, k] x [k, m]) is the same work, so the larger of
    rows and columns first, in logs."""
    return math.log(max(m, n)), math.log(k), math.log(min(m, n))


# `calibrate.collective`'s ops as HLO names, and their result's size per byte of the per-device buffer it times.
_AS_HLO = {"psum": ("all-reduce", lambda n: 1.0), "all_gather": ("all-gather", lambda n: n),
           "psum_scatter": ("reduce-scatter", lambda n: 1 / n), "all_to_all": ("all-to-all", lambda n: 1.0),
           "ppermute": ("collective-permute", lambda n: 1.0)}


def link_bytes(record: dict) -> float:
    """Link bytes one device sent in a calibrated collective, by ring algorithms (`observe.hlo.link_factor`)."""
    kind, result = _AS_HLO[record["kind"]]
    n = record.get("group", record["devices"])
    return link_factor(kind, n) * result(n) * record["megabytes"] * 2**20


def _fit_links(records: list[dict]) -> dict[int, tuple[float, float]]:
    """`_fit_link` per group size (a record without one spans all its devices)."""
    groups: dict[int, list[dict]] = {}
    for r in records:
        groups.setdefault(r.get("group", r["devices"]), []).append(r)
    fits = {g: _fit_link(rs) for g, rs in groups.items()}
    return {g: fit for g, fit in fits.items() if fit is not None}


def _fit_link(records: list[dict]) -> tuple[float, float] | None:
    """seconds = latency + link bytes x seconds per byte, fitted to the measured collectives by least squares of
    the relative error (sizes span 256x: a plain fit would leave the small ones' latency to chance): the
    roofline's link for this device set, its sharing of a host included. None without two sizes."""
    points = [(link_bytes(r), r["seconds"]) for r in records]
    if len({x for x, _ in points}) < 2:
        return None
    w = [1.0 / y**2 for _, y in points]
    sw, sx, sy = sum(w), sum(wi * x for wi, (x, _) in zip(w, points)), sum(wi * y for wi, (_, y) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, points))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return max((sy - slope * sx) / sw, 0.0), max(slope, 1e-15)


def _nearest(points: list[tuple[tuple[float, ...], float]], at: tuple[float, ...]) -> float:
    """The rate at `at`: geometric mean of the nearest points' rates, weighted by inverse distance."""
    ranked = sorted(points, key=lambda p: math.dist(p[0], at))[:_NEAREST]
    weights = [1.0 / max(math.dist(p[0], at), 1e-9) for p in ranked]
    return math.exp(sum(w * math.log(p[1]) for w, p in zip(weights, ranked)) / sum(weights))


LAYER_PRODUCTS = ("q", "k", "v", "o", "gate", "up", "down")  # `layer_matmuls`' order


def micro_batch(config: Any, layout: Any) -> tuple[int, int]:
    """(sequences, tokens) of one micro-batch on one device of `layout`."""
    tc = config.train
    rows = tc.batch_size // layout.grad_accum // layout.dp
    return rows, rows * tc.seq_len // layout.cp


def layer_matmuls(cfg: Any, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """(rows, contraction, columns) of one decoder layer's forward products on one device (`LAYER_PRODUCTS`)."""
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * dh // tp, cfg.num_key_value_heads * dh // tp
    return [(tokens, d, q), (tokens, d, kv), (tokens, d, kv), (tokens, q, d),
            (tokens, d, f // tp), (tokens, d, f // tp), (tokens, f // tp, d)]


def backward_products(shape: tuple[int, int, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A forward [m, k] x [k, n] product's backward two: dX = dY W^T [m, n] x [n, k], dW = X^T dY [k, m] x [m, n]."""
    m, k, n = shape
    return (m, n, k), (k, m, n)


def forward_and_backward(curves: Curves, shape: tuple[int, int, int]) -> float:
    """A product's forward and its backward's two (`backward_products`), each at its own rate."""
    return sum(curves.matmul_seconds(*s) for s in (shape, *backward_products(shape)))


def compute_seconds(curves: Curves, config: Any, layout: Any) -> float:
    """One device's matmuls and attention for a whole step of `layout` (every micro-batch, its stage's layers)."""
    mc, tc = config.model, config.train
    rows, tokens = micro_batch(config, layout)
    layers = mc.num_hidden_layers // layout.pp
    if mc.num_local_experts:
        raise ValueError("the layer's products hold no MoE expert matmuls: replay a compiled step (`replay_seconds`)")
    layer = sum(forward_and_backward(curves, s) for s in layer_matmuls(mc, tokens, layout.tp))
    layer += curves.attention_seconds(rows, tc.seq_len // layout.cp, mc.num_attention_heads / layout.tp, mc.head_dim)
    head = forward_and_backward(curves, (tokens, mc.hidden_size, mc.vocab_size // layout.tp)) / layout.pp
    return layout.grad_accum * (layers * layer + head)


def replay_seconds(curves: Curves, matmuls: Any, config: Any, layout: Any) -> float:
    """One device's step from its compiled matmuls (`observe.hlo_flops.StepMatmuls`: XLA's own shapes, merged and
    split as it runs them, remat's recompute and MoE's expert buffers included), each at its calibrated rate;
    plus attention where cuDNN's fused kernel runs it (no dot): every layer of every micro-batch."""
    seconds = sum(runs * curves.matmul_seconds(m, k, n) for m, k, n, runs in matmuls.products)
    if matmuls.fused_attention:
        mc = config.model
        rows, _ = micro_batch(config, layout)
        layers = mc.num_hidden_layers // layout.pp
        seconds += layout.grad_accum * layers * curves.attention_seconds(
            rows, config.train.seq_len // layout.cp, mc.num_attention_heads / layout.tp, mc.head_dim)
    return seconds
