"""Device profiles: what the planner's roofline knows about a device kind, and where each figure comes from.

Peaks, memory and links are the vendors' data-sheet figures, per device and per direction.
NVLink's "900 GB/s" for H100/H200 is both directions together, so 450 GB/s one way; between
hosts a DGX/HGX node has one 400 Gb/s (H100, H200) or 200 Gb/s (A100) NIC per GPU, 50 or 25
GB/s one way. Memory is what `nvidia-smi` reports as the card's total.

The efficiency factor is the share of the peak that pjax's own step reaches when nothing else
limits it, measured, not assumed: on one H100 (benchmarks/README.md, "One GPU"), model FLOPs
utilisation was 28.0% for SmolLM-135M (hidden 576), 34.4% for SmolLM-360M (960) and 45.5% for
SmolLM-1.7B (2048): wider matmuls run closer to the peak. `efficiency(hidden)` interpolates
those three points in log(hidden) and holds the widest one's value beyond it (the planner does
not extrapolate to 7B-class widths it has not measured). A100 and H200 use the H100 curve:
no run has been measured on them. The CPU profile is this project's 2-core CI machine: one
picotron-cpu step on one device (586 ms, 103.5 GFLOP) against the 330 GFLOP/s its matmuls reach.
"""
from __future__ import annotations

import dataclasses
import math

GB = 1e9
MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class Profile:
    """One device kind. FLOP/s and bytes/s are per device; `shares_host`: the devices of one
    host share its `peak_flops` and links (fake CPU devices), instead of each having its own."""

    name: str
    peak_flops: float  # dense, in the compute dtype the planner compiles for
    memory_bytes: int
    intra_host_bw: float  # bytes/s one way, per device, inside a host (NVLink)
    inter_host_bw: float  # bytes/s one way, per device, between hosts (InfiniBand / RoCE)
    latency_s: float  # fixed cost of one collective
    devices_per_host: int
    compute_dtype: str  # train.dtype the planner compiles with
    attention: str  # train.attention the planner compiles with (its memory is the device's kernel's)
    calibration: tuple[tuple[int, float], ...]  # (hidden size, measured MFU)
    overlap_dp: bool  # XLA's scheduler hides dp gradient/parameter traffic behind compute (GPU)
    shares_host: bool = False

    def efficiency(self, hidden: int) -> float:
        """Measured MFU at this hidden size: interpolated in log(hidden), held flat outside the measured range."""
        points = sorted(self.calibration)
        if hidden <= points[0][0]:
            return points[0][1]
        for (h0, e0), (h1, e1) in zip(points, points[1:]):
            if hidden <= h1:
                t = (math.log(hidden) - math.log(h0)) / (math.log(h1) - math.log(h0))
                return e0 + t * (e1 - e0)
        return points[-1][1]


_H100_MFU = ((576, 0.280), (960, 0.344), (2048, 0.455))

PROFILES: dict[str, Profile] = {
    "h100": Profile("h100", peak_flops=989e12, memory_bytes=81559 * MIB, intra_host_bw=450 * GB,
                    inter_host_bw=50 * GB, latency_s=10e-6, devices_per_host=8, compute_dtype="bfloat16",
                    attention="chunked", calibration=_H100_MFU, overlap_dp=True),
    "h200": Profile("h200", peak_flops=989e12, memory_bytes=143771 * MIB, intra_host_bw=450 * GB,
                    inter_host_bw=50 * GB, latency_s=10e-6, devices_per_host=8, compute_dtype="bfloat16",
                    attention="chunked", calibration=_H100_MFU, overlap_dp=True),
    "a100": Profile("a100", peak_flops=312e12, memory_bytes=81920 * MIB, intra_host_bw=300 * GB,
                    inter_host_bw=25 * GB, latency_s=10e-6, devices_per_host=8, compute_dtype="bfloat16",
                    attention="chunked", calibration=_H100_MFU, overlap_dp=True),
    # This machine: 2 cores, fp32 (XLA:CPU has no fast bf16); "links" are memcpys between the
    # devices' threads (XLA's all-reduce bus bandwidth 1.2-2.0 GB/s at 1-16 MB, ~0.17 ms for 1 KB:
    # benchmarks/README.md, "Collectives"); memory is the host's RAM, shared.
    "cpu": Profile("cpu", peak_flops=330e9, memory_bytes=24 * 2 ** 30, intra_host_bw=1.5 * GB,
                   inter_host_bw=1.5 * GB, latency_s=170e-6, devices_per_host=8, compute_dtype="float32",
                   attention="auto", calibration=((256, 0.535),), overlap_dp=False, shares_host=True),
}

