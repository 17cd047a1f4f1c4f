"""Device profiles: what the planner's roofline knows about a device kind.

Peaks, memory and links are data-sheet figures, per device and one way (NVLink's "900 GB/s" is both
directions; one 400 or 200 Gb/s NIC per GPU between hosts); memory is `nvidia-smi`'s total. `calibration`
is MFU measured on pjax's own step (benchmarks/README.md, "Layout planner"); A100 and H200 borrow H100's."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

GB = 1e9
MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class Profile:
    """One device kind, per device; `shares_host`: a host's devices share its peak and links (fake CPU devices)."""

    name: str
    peak_flops: float
    memory_bytes: int
    intra_host_bw: float  # bytes/s one way (NVLink)
    inter_host_bw: float
    latency_s: float
    devices_per_host: int
    compute_dtype: str
    attention: str  # as compiled: its memory stands for the device's kernel's
    calibration: tuple[tuple[int, float], ...]  # (hidden, MFU)
    overlap_dp: bool  # XLA hides dp traffic behind compute (GPU)
    shares_host: bool = False
    curves: Any = None  # `pjax.plan.curves.Curves` from a calibration (`--calibration`): replaces `efficiency`

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


def host_share(profile: Profile, devices: int) -> int:
    """How many devices share one host's peak, memory and links: fake CPU devices do, GPUs do not."""
    return min(devices, profile.devices_per_host) if profile.shares_host else 1


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
    # The 2-core CI machine, fp32; its "links" are memcpys between device threads (benchmarks/README.md, "Collectives").
    "cpu": Profile("cpu", peak_flops=330e9, memory_bytes=24 * 2 ** 30, intra_host_bw=1.5 * GB,
                   inter_host_bw=1.5 * GB, latency_s=170e-6, devices_per_host=8, compute_dtype="float32",
                   attention="auto", calibration=((256, 0.535),), overlap_dp=False, shares_host=True),
}


def of_kind(kind: str, device_kind: str) -> bool:
    """Whether devices reporting `device_kind` (jax's, or a calibration record's; 'cpu' for CPU devices) are of
    the profile `kind` (a `PROFILES` key: 'h100' is any 'NVIDIA H100 ...')."""
    if "cpu" in (kind, device_kind):
        return kind == device_kind
    return kind.lower() in device_kind.lower()
