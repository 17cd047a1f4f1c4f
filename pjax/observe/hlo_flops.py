"""The matmul FLOPs a compiled program executes per device: every `dot` (fused or not) and cuBLAS GEMM call, each
counted as often as the loops around it run (a while loop's `known_trip_count`, as `hlo.collective_stats` walks).

Model FLOPs count what the model needs; this counts what XLA runs: a remat policy's recomputed forward, a
Mixture of Experts whose grouped matmuls run every expert over a padded buffer, a masked block of attention.
A conditional's branches are each counted once per call (an upper bound), and kernels that are not dots
(cuDNN's fused attention) are not counted."""
from __future__ import annotations

import collections
import math
import re

from pjax.observe.hlo import _BRANCHES, _CALLED, _COMP_HEADER, _SHAPE, _TRIP

_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_PARAMS = re.compile(r"([\w.\-]+): ([a-z]+\d*(?:e\dm\d(?:fn)?)?\[[\d,]*\])")
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
    entry, current = None, None
    shapes: dict[str, str] = {}
    own: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for line in hlo_text.splitlines():
        header = _COMP_HEADER.match(line)
        if header:
            current = header.group(1)
            entry = current if line.startswith("ENTRY") else entry
            shapes.update(_PARAMS.findall(line))
            continue
        m = _INSTR.match(line) if current else None
        if not m:
            continue
        name, result, opcode, rest = m.groups()
        shapes[name] = result
        own[current] += _flops(result, opcode, rest, shapes)
        trip = _TRIP.search(rest) if opcode == "while" else None
        calls[current].extend((callee, int(trip.group(1)) if trip else 1) for callee in _CALLED.findall(rest))
        for group in _BRANCHES.findall(rest):
            calls[current].extend((branch.strip().lstrip("%"), 1) for branch in group.split(","))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    def total(comp: str, depth: int = 0) -> float:
        if depth > 64:
            raise ValueError("HLO call graph too deep (a cycle?)")
        return own.get(comp, 0.0) + sum(runs * total(callee, depth + 1) for callee, runs in calls.get(comp, ()))

    return total(entry)
