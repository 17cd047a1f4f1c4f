"""What tensor parallelism repeats on each of its devices: the residual stream's work, measured on the model
at hand.

Under tp a device runs its share of the heads and of the MLP, but the [tokens, hidden] residual stream between
them whole (the RMSNorms and residual adds, forward and backward), so every device of a tp group repeats it;
sequence parallelism splits it. The matmul and attention curves hold none of this memory-bound work, so without
it the roofline prices a tp layout and its sequence-parallel twin alike (benchmarks/README.md, "What tensor
parallelism repeats").

Measured whole, as `pipeline_cost` measures a pipeline's ticks: the model's own step at tp 4 (tp 2 where 4
does not divide the devices or the key/value heads) without and with sequence parallelism. The difference is
the stream's work on (1 - 1/tp) of each device's tokens, a cost per token and layer (`per_token_layer`); it
also holds what the two forms' collectives differ by, which the pair cannot separate. `stream_seconds`
charges a layout its devices' tokens times their layers at that cost."""
from __future__ import annotations

from typing import Any, Sequence

import jax

from mesh.errors import ConfigError
from pjax.config_io import load_config
from pjax.plan.layouts import REMAT_RECOMPUTE, Layout
from pjax.plan.profiles import Profile, host_share
from pjax.plan.step_pairs import timed_pair

_MICRO_BATCHES = 2


def pair(devices: int, kv_heads: int) -> tuple[Layout, Layout]:
    """(tp without sequence parallelism, the same with it) the section times on `devices` for a model of
    `kv_heads` key/value heads: tp 4 where 4 divides both (the difference is then 3/4 of the stream's work rather
    than 1/2), else tp 2; dp takes the rest of the devices."""
    tp = 4 if devices % 4 == 0 and kv_heads % 4 == 0 else 2
    plain = Layout(dp=devices // tp, tp=tp, grad_accum=_MICRO_BATCHES)
    return plain, Layout(dp=devices // tp, tp=tp, grad_accum=_MICRO_BATCHES, sequence_parallel=True)


def measure_stream(config_name: str, overrides: Sequence[str] = (), steps: int = 3, rounds: int = 3
                   ) -> dict[str, Any]:
    """The record of the `stream` calibration section: both steps' seconds of the median round (`pair`), what
    `per_token_layer` needs (each device's tokens per step, layers, hidden size, tp) and `saved`, the plain
    step's time over the sequence-parallel one's, less one; an `error` where this machine has fewer than 2
    devices or an odd number, or the layouts cannot split the config."""
    n = len(jax.devices())
    fixed: dict[str, Any] = {"config": config_name, "overrides": list(overrides), "devices": n}
    if n < 2 or n % 2:
        return {**fixed, "error": f"tensor parallelism over 2 devices or more needs an even number, not {n}"}
    try:
        cfg = load_config(config_name, overrides)
        plain, split = pair(n, cfg.model.num_key_value_heads)
        split_s, plain_s, by_round = timed_pair(config_name, overrides, split, plain, steps, rounds)
    except ConfigError as e:
        return {**fixed, "error": f"tp with sequence parallelism against tp without: {e}"}
    return {**fixed, "plain": plain.name, "split": split.name, "plain_s": plain_s, "split_s": split_s,
            "saved": plain_s / split_s - 1.0, "saved_by_round": by_round, "tp": plain.tp,
            "tokens_per_device": cfg.train.batch_size * cfg.train.seq_len // plain.dp,
            "layers": cfg.model.num_hidden_layers, "hidden_size": cfg.model.hidden_size}


def per_token_layer(measured: dict[str, Any], share: int) -> float:
    """Seconds of the stream's work per token and layer on one device, `share` devices sharing a host's cores
    in the measurement (they then run one after another, so the difference is theirs together); never below
    0 (a slower sequence-parallel step is noise or collectives, not a stream that costs nothing)."""
    repeated = measured["tokens_per_device"] * measured["layers"] * (1 - 1 / measured["tp"])
    return max(0.0, measured["plain_s"] - measured["split_s"]) / (share * repeated)


def stream_seconds(config: Any, layout: Layout, profile: Profile) -> tuple[float, str]:
    """(one device's step of residual-stream work, times the devices sharing its host, why): its tokens per
    step times its stage's layers at the measured cost, over tp under sequence parallelism, again for the
    forward's recompute under `remat=full`. 0 without a calibration's `stream` measurement."""
    measured = profile.curves.stream if profile.curves is not None else None
    if measured is None:
        why = "no calibration" if profile.curves is None else "not measured: calibrate with --config"
        return 0.0, f"0 ({why})"
    devices = layout.dp * layout.pp * layout.cp * layout.tp
    cost = per_token_layer(measured, host_share(profile, measured["devices"]))
    cost *= config.model.hidden_size / measured["hidden_size"]
    tokens = config.train.batch_size * config.train.seq_len // (layout.dp * layout.cp)
    tokens //= layout.tp if layout.sequence_parallel else 1
    layers = config.model.num_hidden_layers / layout.pp
    share = host_share(profile, devices)
    seconds = cost * tokens * layers * REMAT_RECOMPUTE.get(layout.remat, 1.0) * share
    split = "split over tp (sequence parallel)" if layout.sequence_parallel else (
        f"repeated on each of tp = {layout.tp}" if layout.tp > 1 else "no tp")
    return seconds, (f"{tokens:,} tokens x {layers:g} layers at {cost * 1e9:,.2f} ns, {split}"
                     + (f", x {share} devices sharing the host" if share > 1 else "")
                     + f"; measured by {measured['plain']} against {measured['split']} of {measured['config']}")
