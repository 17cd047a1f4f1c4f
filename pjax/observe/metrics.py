"""Model FLOPs, MFU, and the metrics a run writes (metrics.jsonl and TensorBoard events)."""
from __future__ import annotations

import json
import math
import os
from typing import Any

import jax

from models.config import LlamaConfig
from models.moe import MoeConfig, capacity

# Dense bf16 data-sheet peaks by `device_kind` substring, first match wins ('H100 PCIe' before 'H100').
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
    """SwiGLU MLPs a token's FLOPs pay for in one layer: 1 dense, top-k, or under capacity routing E x C / tokens
    (the [E, C] buffer is the model's choice; dropless's excess should show in MFU)."""
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    if not e:
        return 1.0
    if moe is None or moe.routing != "capacity" or not group_tokens:
        return float(k)
    return e * capacity(group_tokens, k, e, moe.capacity_factor) / group_tokens


def routing_group_tokens(batch_size: int, grad_accum: int, seq_len: int, dp: int, cp: int) -> int:
    """Tokens an MoE layer routes together: a micro-batch, per device under expert parallelism."""
    tokens = batch_size // grad_accum * seq_len
    return tokens // (dp * cp) if dp > 1 else tokens


def model_flops_per_token(cfg: LlamaConfig, seq_len: int, moe: MoeConfig | None = None,
                          group_tokens: int | None = None) -> float:
    """Training FLOPs per token: 6 x the matmul parameters a token runs through + causal attention, no remat."""
    d, f, l, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    h, kv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    fs = cfg.shared_expert_intermediate_size  # + the router, and a shared expert with its gate
    shared = 3 * d * fs + d if fs else 0
    mlp = expert_mlps_per_token(cfg, moe, group_tokens) * 3 * d * f + d * cfg.num_local_experts + shared
    matmul_params = l * (d * dh * (2 * h + 2 * kv) + mlp) + d * v  # the embedding lookup is no matmul
    attention = l * 2 * seq_len * h * dh  # QK^T and PV over T/2 keys on average
    return 6 * matmul_params + 3 * attention


def peak_flops(device: jax.Device, override: float | None = None) -> float | None:
    """Per-device peak FLOP/s: `override` (log.peak_flops), else the table, else None (CPUs on purpose:
    ARCHITECTURE.md, "MFU only against a known peak")."""
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
    """Memory in use and its peak on the most loaded device (on CPU, XLA's compiled `estimate`)."""
    stats = [d.memory_stats() for d in devices]
    if all(stats) and all("bytes_in_use" in s for s in stats):
        return {"memory_in_use_bytes": max(s["bytes_in_use"] for s in stats),
                "memory_peak_bytes": max(s.get("peak_bytes_in_use", s["bytes_in_use"]) for s in stats),
                "memory_source": "device"}
    return {"memory_in_use_bytes": estimate[0], "memory_peak_bytes": estimate[1], "memory_source": "compiled"}


class MetricsWriter:
    """One JSON object per record in `<dir>/metrics.jsonl`, scalars mirrored to TensorBoard; process 0 only. A run
    resumed at step `start` > 0 continues the file, dropping the records of the steps it trains again (those a
    stopped run logged past its last checkpoint)."""

    def __init__(self, log_dir: str, start: int = 0) -> None:
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self._file = self._tb = None
        if self.enabled:
            os.makedirs(log_dir, exist_ok=True)
            if start > 0:
                _keep_through(self.path, start)
            self._file = open(self.path, "a" if start > 0 else "w", encoding="utf-8")
            from tensorboardX import SummaryWriter  # slow to import

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


def _keep_through(path: str, step: int) -> None:
    """Drop `path`'s records after `step` (a line that is no JSON record, e.g. one cut by a kill, goes too)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except (ValueError, AttributeError):
                continue
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
