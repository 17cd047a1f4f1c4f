"""Model FLOPs, MFU, and the metrics a run writes (metrics.jsonl and TensorBoard events).

MFU = achieved model FLOP/s per device / the device's peak. Model FLOPs count the matmuls a
training step must do (forward 2 FLOPs per multiply-add, backward twice that), with causal
attention counted once: a query attends to T/2 keys on average, so the score and value matmuls
cost 2·T·H·Dh per token per layer forward, not 4·T·H·Dh (the PaLM appendix formula counts the
masked half too). Recomputation (remat) is not model FLOPs and is not counted.

An MoE layer counts its router and the expert MLPs a token pays for: its top-k, or under
capacity routing the whole [E, C] buffer over the tokens routed together (the capacity factor is
the model's choice, its padding runs on every step). The dense reference routing and dropless
routing under expert parallelism (whose exact buffer is E/k times the top-k work) are counted at
top-k: that excess is the implementation's, and MFU should show it.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import jax

from models.config import LlamaConfig
from models.moe import MoeConfig, capacity

# Dense peak FLOP/s by `device.device_kind` substring, first match wins (order matters: 'H100 PCIe'
# before 'H100'). bf16 tensor-core numbers from the vendors' data sheets (without sparsity).
PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A10G", 70e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("V100", 125e12),  # fp16 tensor cores; V100 has no bf16
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v6", 918e12),
)


def expert_mlps_per_token(cfg: LlamaConfig, moe: MoeConfig | None = None, group_tokens: int | None = None) -> float:
    """How many SwiGLU MLPs a token's FLOPs pay for in one layer: 1 dense; top-k in an MoE layer;
    E x capacity / tokens under capacity routing of `group_tokens` tokens at a time."""
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    if not e:
        return 1.0
    if moe is None or moe.routing != "capacity" or not group_tokens:
        return float(k)
    return e * capacity(group_tokens, k, e, moe.capacity_factor) / group_tokens


def routing_group_tokens(batch_size: int, grad_accum: int, seq_len: int, dp: int, cp: int) -> int:
    """Tokens an MoE layer routes together: a micro-batch, split over dp and cp under expert
    parallelism (dp > 1: each device routes its own tokens, `models.moe.moe_mlp`)."""
    tokens = batch_size // grad_accum * seq_len
    return tokens // (dp * cp) if dp > 1 else tokens


def model_flops_per_token(cfg: LlamaConfig, seq_len: int, moe: MoeConfig | None = None,
                          group_tokens: int | None = None) -> float:
    """Training FLOPs per token: 6 x matmul parameters a token runs through (MoE: the router and
    `expert_mlps_per_token` experts) + causal attention (counted once)."""
    d, f, l, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    h, kv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    mlp = expert_mlps_per_token(cfg, moe, group_tokens) * 3 * d * f + d * cfg.num_local_experts  # + the router
    matmul_params = l * (d * dh * (2 * h + 2 * kv) + mlp) + d * v  # the embedding lookup is no matmul
    attention = l * 2 * seq_len * h * dh  # forward, per token: QK^T and PV over T/2 keys on average
    return 6 * matmul_params + 3 * attention


def peak_flops(device: jax.Device, override: float | None = None) -> float | None:
    """Per-device peak FLOP/s: `override` (log.peak_flops) if given, else the table, else None.

    CPUs have no table entry on purpose: their peak depends on the core count, clock and vector
    units in use, so MFU on CPU is reported only against a peak the user measured and configured.
    """
    if override:
        return override
    if device.platform == "cpu":
        return None
    kind = getattr(device, "device_kind", "")
    return next((peak for name, peak in PEAK_BF16 if name in kind), None)


def mfu(tokens_per_sec: float, flops_per_token: float, num_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None without a known peak."""
    if not peak:
        return None
    return tokens_per_sec * flops_per_token / num_devices / peak


def memory_per_device(devices: list[jax.Device], estimate: tuple[int, int]) -> dict[str, Any]:
    """Memory in use and its peak, in bytes per device (the most loaded of `devices`): the
    allocator's own figures (`memory_stats()`: GPUs, TPUs) or, where the backend keeps none (CPU),
    XLA's compiled estimate (`estimate`: resident state and batch, and the step's peak)."""
    stats = [d.memory_stats() for d in devices]
    if all(stats) and all("bytes_in_use" in s for s in stats):
        return {"memory_in_use_bytes": max(s["bytes_in_use"] for s in stats),
                "memory_peak_bytes": max(s.get("peak_bytes_in_use", s["bytes_in_use"]) for s in stats),
                "memory_source": "device"}
    return {"memory_in_use_bytes": estimate[0], "memory_peak_bytes": estimate[1], "memory_source": "compiled"}


class MetricsWriter:
    """Appends one JSON object per record to `<dir>/metrics.jsonl` and mirrors scalars to TensorBoard.

    Only process 0 writes, so multi-host runs produce one log.
    """

    def __init__(self, log_dir: str, append: bool = False) -> None:
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self._file = self._tb = None
        if self.enabled:
            os.makedirs(log_dir, exist_ok=True)
            self._file = open(self.path, "a" if append else "w", encoding="utf-8")
            from tensorboardX import SummaryWriter  # imported lazily: it is slow to import

            self._tb = SummaryWriter(log_dir)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        for key, value in clean.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()
