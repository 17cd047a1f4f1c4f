"""The matmul FLOPs a compiled program executes per device: every `dot` (fused or not) and cuBLAS GEMM call, each
counted as often as the loops around it run (`hlo.walk`: a while loop's `known_trip_count`).

Model FLOPs count what the model needs; this counts what XLA runs: a remat policy's recomputed forward, a
Mixture of Experts whose grouped matmuls run every expert over a padded buffer, a masked block of attention.
A conditional's branches are each counted once per call (an upper bound), and kernels that are not dots
(cuDNN's fused attention) are not counted."""
from __future__ import annotations

import collections
import math
import re

from pjax.observe.hlo import _SHAPE, walk

_DOT_DIMS = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _dims(shape: str) -> list[int]:
    """The first array shape's dimensions in an HLO shape (a tuple's first element)."""
    m = _SHAPE.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _flops(result: str, opcode: str, rest: str, shapes: dict[str, str]) -> float:
    """2 x output elements x contracted size, for a dot or a cuBLAS GEMM custom call; 0 for anything else."""
    if opcode == "dot":
        dims = _DOT_DIMS.search(rest)
    elif opcode == "custom-call" and re.search(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)', rest):
        dims = _GEMM_DIMS.search(rest)
    else:
        return 0.0
    lhs = re.match(r"\s*(?:[^%]*?)%([\w.\-]+)", rest)
    lhs_dims = _dims(shapes.get(lhs.group(1), "")) if lhs else []
    if not dims or not lhs_dims:
        return 0.0
    contracted = math.prod(lhs_dims[int(i.strip('" '))] for i in dims.group(1).split(",") if i.strip('" '))
    return 2.0 * math.prod(_dims(result)) * contracted


def dot_flops(hlo_text: str) -> float:
    """Matmul FLOPs per device per run of the program `hlo_text` (`compiled.as_text()`)."""
    shapes: dict[str, str] = {}  # every instruction's result shape (parameters included): a dot's operand shapes
    own: dict[str, float] = collections.defaultdict(float)

    def matmul(comp: str, name: str, result: str, opcode: str, rest: str, line: str) -> None:
        shapes[name] = result
        own[comp] += _flops(result, opcode, rest, shapes)

    return sum(own.get(comp, 0.0) * runs for comp, runs in walk(hlo_text, matmul).items())
