"""The planner's roofline: a layout's step time from its FLOPs, its collectives and its pipeline bubble
(ARCHITECTURE.md, "The planner compiles, it does not guess"). The collectives come from the compiled
step or, before a compile, `analytic_comm`; `analytic_memory` only chooses what to compile."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from models.moe import capacity
from models.ragged_dispatch import receive_rows
from pjax.config import Config
from pjax.observe.hlo_flops import StepMatmuls
from pjax.observe.metrics import model_flops_per_token, routing_group_tokens
from pjax.parallel.compression import bytes_per_value
from pjax.parallel.pipeline.table import SPLIT_BACKWARD
from pjax.plan.curves import compute_seconds, replay_seconds
from pjax.plan.layouts import REMAT_RECOMPUTE, Layout, state_bytes
from pjax.plan.pipeline_cost import pipeline_factor, pipeline_ratio, weight_share
from pjax.plan.profiles import Profile, host_share
from pjax.plan.stream_cost import stream_seconds

# The traffic XLA can overlap with compute: the gradient's reduction and ZeRO's gathers (HSDP's sum over its copies
# and tp, of the vocabulary-split weights, is a dp+tp row).
DP_AXES = ("dp", "dp+cp", "dp+tp")
WORK = ("compute", "stream", "bubble")  # the terms that are not collectives


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_s: float
    terms: dict[str, float]  # seconds: compute, stream, bubble, one per set of mesh axes
    limit: str
    tokens_per_s: float
    mfu: float
    memory_bytes: int
    usable_bytes: int
    executed: tuple[float, str] = (1.0, "")  # FLOPs run per model FLOP, and why (`executed_per_model_flop`)

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.usable_bytes


def per_device(profile: Profile, devices: int) -> tuple[float, int]:
    """(peak FLOP/s, memory bytes) of one device; fake CPU devices share their host's."""
    share = host_share(profile, devices)
    return profile.peak_flops / share, profile.memory_bytes // share


def usable_bytes(profile: Profile, devices: int, mem_fraction: float) -> int:
    """What the allocator lets one device use."""
    return int(per_device(profile, devices)[1] * mem_fraction)


def _spans_hosts(layout: Layout, axes: str, per_host: int) -> bool:
    """Whether a group over `axes` reaches past a host of `per_host` consecutive devices, tp innermost ('dp' of
    an HSDP layout: its shard group's replicas)."""
    sizes = {"dp": layout.zero_shard or layout.dp, "pp": layout.pp, "cp": layout.cp, "tp": layout.tp}
    names = list(sizes)
    outer = min(names.index(a) for a in axes.split("+"))
    return sizes[names[outer]] * math.prod(sizes[a] for a in names[outer + 1:]) > per_host


def _copies_span_hosts(layout: Layout, per_host: int) -> bool:
    """Whether an HSDP layout's all-reduce over rp (its shard groups' copies) reaches past a host."""
    return layout.dp * layout.pp * layout.cp * layout.tp > per_host


def minimum_bytes(config: Config, layout: Layout, act_bytes: int = 4) -> dict[str, float]:
    """The least each mechanism must move per device per step, in bytes arriving on a device (what
    `benchmarks/comm.py` holds XLA against). tp: 4 all-reduces per layer plus the embedding's and output
    layer's; under SP each a gather and a scatter, plus the backward's second gather. pp: each activation
    across the boundaries and back, and one reduction of the shared weights, which every stage holds."""
    mc, tc = config.model, config.train
    k, dp, pp, cp, tp = layout.grad_accum, layout.dp, layout.pp, layout.cp, layout.tp
    tokens = tc.batch_size // k // dp * tc.seq_len // cp
    layers = mc.num_hidden_layers // pp
    act = tokens * mc.hidden_size * act_bytes
    params, shared = reduced_gradient_bytes(config, layout), shared_bytes(config, layout)
    out = {"dp": 0.0, "tp": 0.0, "cp": 0.0, "pp": 0.0}
    zero = 0 if tc.local_steps else layout.zero  # DiLoCo's ZeRO splits its group's ring in halves: the same bytes
    shard = layout.zero_shard or dp  # HSDP: ZeRO within groups of `shard`, then its shard summed over the copies
    copies = params / shard if shard < dp else 0.0
    if dp * cp > 1 and zero >= 3 and dp > 1:
        out["dp"] = k * params / shard + 2 * k * params + copies
    elif dp * cp > 1:  # the gradient sum in train.grad_compression's payload; ZeRO-1's fp32 parameter gather
        out["dp"] = params * _payload(config, dp) + (params / shard if zero == 1 and dp > 1 else 0) + copies
    if tp > 1 and layout.sequence_parallel:
        out["tp"] = k * ((6 * layers + 3 / pp) * act + (4 * layers + 2 / pp) * act / tp)
    elif tp > 1:
        out["tp"] = k * (4 * layers + 2 / pp) * act
    if cp > 1:
        out["cp"] = k * layers * cp_bytes(config, layout, tokens, act_bytes)[0]
    if pp > 1:
        out["pp"] = 2 * k * (pp * layout.virtual_stages - 1) / pp * act + shared
    return out


def _payload(config: Config, dp: int) -> float:
    """A gradient value's link bytes per step under train.grad_compression, per fp32 byte; under DiLoCo
    (`train.local_steps` = H) the parameter average in that payload once every H steps, plus each step's fp32
    gradient sum
    within a group of k = dp / train.diloco_groups replicas, a ring of k at 2(k-1)/k where dp's is 2(dp-1)/dp
    (a cp group's per-step gradient sum is counted at the outer rate: an underestimate with cp > 1)."""
    tc = config.train
    if tc.local_steps:
        k = max(1, dp // (tc.diloco_groups or dp))
        outer = bytes_per_value(tc.grad_compression) / 4 / tc.local_steps
        return outer + (((k - 1) / k) / ((dp - 1) / dp) if k > 1 else 0.0)
    return bytes_per_value(tc.grad_compression) / 4


def cp_bytes(config: Config, layout: Layout, tokens: int, act_bytes: int) -> tuple[float, float, int]:
    """(payload, link bytes, collectives) per device, micro-batch and layer of `layout.context`; a block
    is one device's K or V, dK and dV in fp32; ulysses repeats kv-heads up to cp."""
    mc, cp, tp = config.model, layout.cp, layout.tp
    kv_tp = mc.num_key_value_heads // tp
    elements = tokens * kv_tp * mc.head_dim
    block, grad_block = elements * act_bytes, elements * 4
    if layout.context == "all_gather":
        return 4 * cp * block + 2 * grad_block, 4 * (cp - 1) * block + 2 * (cp - 1) * grad_block, 6
    if layout.context == "ulysses":
        q = tokens * (mc.num_attention_heads // tp) * mc.head_dim * act_bytes
        payload = 4 * (q + block * max(1, cp // kv_tp))
        return payload, payload * (cp - 1) / cp, 8
    payload = 4 * (cp - 1) * block + 2 * cp * grad_block
    return payload, payload, 6 * (cp - 1)


def shared_bytes(config: Config, layout: Layout) -> float:
    """fp32 bytes per device of the embedding, final norm and output layer (split over tp only)."""
    mc = config.model
    return (mc.vocab_size * mc.hidden_size * (1 if mc.tie_word_embeddings else 2) + mc.hidden_size) * 4 / layout.tp


def held_gradient_bytes(config: Config, layout: Layout) -> float:
    """fp32 bytes of the gradient a device holds before any ZeRO split (the shared weights on every stage)."""
    shared = shared_bytes(config, layout)
    return (config.model.num_params * 4 / layout.tp - shared) / layout.pp + shared


def reduced_gradient_bytes(config: Config, layout: Layout) -> float:
    """`held_gradient_bytes` with an MoE model's experts counted only where dp copies them: a device reduces
    its E/ep experts over dp's dp/ep replicas of the expert group (none at ep = dp)."""
    mc = config.model
    experts = 3 * mc.num_local_experts * mc.hidden_size * mc.intermediate_size * mc.num_hidden_layers * 4
    ep = layout.mesh.with_experts(mc.num_local_experts).ep or 1
    copied = experts / ep if layout.dp > ep else 0
    return held_gradient_bytes(config, layout) - (experts - copied) / (layout.tp * layout.pp)


def analytic_comm(config: Config, layout: Layout, act_bytes: int, per_host: int) -> dict[str, dict[str, Any]]:
    """`minimum_bytes` as ring link bytes and op counts, shaped like `collectives_by_axis`'s rows."""
    mc = config.model
    k, dp, pp, cp, tp = layout.grad_accum, layout.dp, layout.pp, layout.cp, layout.tp
    layers = mc.num_hidden_layers // pp
    payload = minimum_bytes(config, layout, act_bytes)
    ring = lambda n: 2 * (n - 1) / n  # all-reduce link bytes per payload byte
    rows: dict[str, tuple[int, float]] = {}
    across: dict[str, float] = {}  # a row's link bytes that cross hosts, where not all or none of them
    if dp * cp > 1:
        shard = layout.zero_shard or dp  # HSDP: ZeRO within groups of `shard` replicas, copies over rp
        n, params, key = shard * cp, reduced_gradient_bytes(config, layout), "dp+cp" if cp > 1 else "dp"
        if layout.zero >= 3 and dp > 1:
            rows[key] = (k * (layers * 9 + 3) + 2 * k * layers, 3 * k * params * (n - 1) / n)
        else:  # a reduce-scatter and an all-gather of the gradient in the compression's payload (ZeRO-1:
            # the gather is of the fp32 parameters)
            gather = 1.0 if layout.zero == 1 and dp > 1 else _payload(config, dp)
            rows[key] = (layers * 9 + 3, params * (n - 1) / n * (_payload(config, dp) + gather))
        if shard < dp:  # each group's shard of the reduced gradient, all-reduced over the copies once a step
            group_link = rows[key][1] if _spans_hosts(layout, key, per_host) else 0.0
            copies = params / shard * ring(dp // shard)
            across[key] = group_link + (copies if _copies_span_hosts(layout, per_host) else 0.0)
            rows[key] = (rows[key][0] + layers * 9 + 3, rows[key][1] + copies)
    if tp > 1 and layout.sequence_parallel:
        act = payload["tp"] / k / ((6 * layers + 3 / pp) + (4 * layers + 2 / pp) / tp)
        rows["tp"] = (round(k * (10 * layers + 5 / pp)), k * (10 * layers + 5 / pp) * act * (tp - 1) / tp)
    elif tp > 1:
        rows["tp"] = (round(k * (4 * layers + 2 / pp)), payload["tp"] * ring(tp))
    if cp > 1:
        tokens = config.train.batch_size // k // dp * config.train.seq_len // cp
        _, link, count = cp_bytes(config, layout, tokens, act_bytes)
        rows["cp"] = (k * layers * count, k * layers * link)
    if pp > 1:
        shared = shared_bytes(config, layout)
        sends = (payload["pp"] - shared) * pp / (pp * layout.virtual_stages - 1) * layout.virtual_stages
        rows["pp"] = (4 * (k * layout.virtual_stages + pp - 1) + 1, sends + shared * ring(pp))
    sizes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
    out = {}
    for axes, (count, link) in rows.items():
        crossing = across.get(axes, link if _spans_hosts(layout, axes, per_host) else 0.0)
        out[axes] = {"count": count, "link_bytes": link, "inter_host": crossing > 0, "inter_link_bytes": crossing,
                     "group": math.prod(sizes[a] for a in axes.split("+"))}
    return out


# Bytes XLA keeps per activation element without remat, fitted to compiled steps (an order of magnitude).
_KEPT_PER_ELEMENT = {2: 12, 4: 17}


def expert_rows(config: Config, layout: Layout, tokens: int) -> int:
    """The rows a device's experts hold per MoE layer for `tokens` local tokens: the receive buffer under dropless
    expert parallelism (`moe.receive_factor`'s bound), the [E, C] capacity buffer, or every expert on every token."""
    mc, moe = config.model, config.moe
    experts, k = mc.num_local_experts, mc.num_experts_per_tok
    ep = layout.mesh.with_experts(experts).ep or 1
    if moe.routing == "dropless":
        return receive_rows(tokens, k, ep, moe.receive_factor) if ep > 1 else tokens * k
    if moe.routing == "capacity":
        return experts * capacity(tokens, k, experts, moe.capacity_factor)
    return experts * tokens  # dense: every expert on every token (under ep, the capacity that never drops)


def analytic_memory(config: Config, layout: Layout, act_bytes: int, attention: str) -> int:
    """State (exact) + batch + a rough activation estimate, bytes per device."""
    mc, tc = config.model, config.train
    d, f, v, tp = mc.hidden_size, mc.intermediate_size, mc.vocab_size, layout.tp
    heads = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
    tokens = tc.batch_size // layout.grad_accum // layout.dp * tc.seq_len // layout.cp
    between = d // tp if layout.sequence_parallel else d
    mlp_rows = expert_rows(config, layout, tokens) if mc.num_local_experts else tokens
    layer = _KEPT_PER_ELEMENT[act_bytes] * (tokens * (between + heads // tp)
                                            + mlp_rows * (3 * f // tp + (d if mc.num_local_experts else 0)))
    if attention in ("auto", "blocked", "reference"):
        layer += tokens * mc.num_attention_heads // tp * tc.seq_len // 2 * 4
    layers = mc.num_hidden_layers // layout.pp
    # remat=full keeps each layer's input, but in a zero-bubble table B leaves W every layer's (x, g)
    recomputed = layout.remat == "full" and layout.schedule not in SPLIT_BACKWARD
    saved = layers * tokens * between * 4 + 3 * layer if recomputed else layers * layer
    if layout.pp > 1:
        saved *= layout.pp + 1
    logits = 2 * tokens * v // tp * 4 if not tc.loss_chunk else 2 * tc.loss_chunk * v // tp * 4
    batch = 3 * tc.batch_size // layout.dp * tc.seq_len * 4
    return state_bytes(config, layout)["total"] + batch + saved + logits


def across_link_bytes(row: dict[str, Any]) -> float:
    """The link bytes of a row's collectives whose groups span hosts (all of them, in a row that predates the
    split, where any does)."""
    return row.get("inter_link_bytes", row["link_bytes"] if row["inter_host"] else 0.0)


def link_model(row: dict[str, Any], profile: Profile, devices: int, across: bool) -> tuple[float, float, str]:
    """(seconds per op, seconds per link byte, where they come from) for one row's collectives inside a host or
    `across` hosts: inside, the fit to a calibration's collectives in the group size nearest the row's, when the
    profile has one, else the profile's link."""
    fit = profile.curves.link_for(row.get("group")) if profile.curves is not None else None
    if fit is not None and not across:
        return (*fit[1], f"fitted to the calibration's collectives in groups of {fit[0]}")
    bw = (profile.inter_host_bw if across else profile.intra_host_bw) / host_share(profile, devices)
    return profile.latency_s, 1.0 / bw, "between hosts" if across else "within a host"


def comm_seconds(row: dict[str, Any], profile: Profile, devices: int) -> float:
    """One row of collectives: latency per op (the slower link's, where any op crosses hosts) + its link bytes
    inside a host and across hosts, each over its own link (`link_model`)."""
    across = across_link_bytes(row)
    latency = link_model(row, profile, devices, row["inter_host"])[0]
    inside, across_s = link_model(row, profile, devices, False)[1], link_model(row, profile, devices, True)[1]
    return row["count"] * latency + (row["link_bytes"] - across) * inside + across * across_s


def executed_per_model_flop(layout: Layout, model_flops: float, dot_flops: float | None) -> tuple[float, str]:
    """(FLOPs the step runs per model FLOP, why): the compiled step's matmul FLOPs over the model's (a
    pipeline's counted as its table runs each tick's part, `inspect.step_matmuls`), at least 1 (cuDNN's
    attention is no dot); else, and for a lockstep pipeline (cp > 1), whose idle stages compute on discard
    slots that its bubble already charges, remat's recompute alone."""
    if dot_flops and (layout.pp == 1 or layout.cp == 1):
        return max(dot_flops / model_flops, 1.0), "the compiled step's matmul FLOPs over the model's"
    remat = REMAT_RECOMPUTE.get(layout.remat, 1.0)
    return remat, (f"remat={layout.remat} computes the forward twice" if remat != 1 else "")


def compute_model(config: Config, profile: Profile, matmuls: StepMatmuls | None, layout: Layout) -> str:
    """How `predict` prices compute: 'replay' (the compiled step's matmuls at calibrated rates,
    `curves.replay_seconds`: with a calibration and a compile, at pp = 1: replayed pipelines came out further
    from their steps than their layer's products, benchmarks/README.md), 'curves' (the layer's products at
    calibrated rates: a calibration, no compile or a pipeline), or 'efficiency' (the profile's one MFU; also an
    MoE model's without a compile to replay, whose expert matmuls the layer's products do not hold)."""
    if profile.curves is None:
        return "efficiency"
    if matmuls is not None and layout.pp == 1:
        return "replay"
    return "efficiency" if config.model.num_local_experts else "curves"


def predict(config: Config, layout: Layout, profile: Profile, comm: dict[str, dict[str, Any]],
            memory_bytes: int, mem_fraction: float, matmuls: StepMatmuls | None = None) -> Prediction:
    """The roofline step time of `layout` given its collectives per set of axes, its memory per device and
    the matmuls its compiled step runs per device (`observe.hlo_flops.StepMatmuls`; None: not compiled)."""
    mc, tc = config.model, config.train
    devices = layout.dp * layout.pp * layout.cp * layout.tp
    peak = per_device(profile, devices)[0]
    tokens = tc.batch_size * tc.seq_len
    group = routing_group_tokens(tc.batch_size, layout.grad_accum, tc.seq_len, layout.dp, layout.cp)
    flops = model_flops_per_token(mc, tc.seq_len, config.moe, group) * tokens / devices
    executed = executed_per_model_flop(layout, flops, matmuls.flops if matmuls else None)
    model = compute_model(config, profile, matmuls, layout)
    if model == "efficiency":
        compute = flops * executed[0] / (peak * profile.efficiency(mc.hidden_size))
    elif model == "replay":  # measured on the whole host: devices on it share its rate
        compute = replay_seconds(profile.curves, matmuls, config, layout) * host_share(profile, devices)
    else:
        compute = compute_seconds(profile.curves, config, layout) * executed[0] * host_share(profile, devices)
    ratio = pipeline_ratio(layout, weight_share(mc, tc.seq_len))
    stream = stream_seconds(config, layout, profile)[0]  # the residual stream's work, which tp repeats
    # "bubble": what the pipeline costs beyond its work, the idle ticks it pays and its ticks' own work
    bubble = (compute + stream) * (pipeline_factor(layout, profile, ratio)[0] - 1.0)
    terms = {"compute": compute, "stream": stream, "bubble": bubble}
    terms.update({axes: comm_seconds(row, profile, devices) for axes, row in comm.items()})
    busy = compute + stream + bubble
    dp_traffic = sum(t for a, t in terms.items() if a in DP_AXES)
    critical = sum(t for a, t in terms.items() if a not in DP_AXES and a not in WORK)
    step = (max(busy, dp_traffic) if profile.overlap_dp else busy + dp_traffic) + critical
    limit = max(terms, key=terms.get)
    return Prediction(step, terms, limit, tokens / step, flops / (step * peak), int(memory_bytes),
                      usable_bytes(profile, devices, mem_fraction), executed)
