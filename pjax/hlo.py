"""Collectives in a compiled program: how many run per step and how many bytes they move.

`compiled.as_text()` lists each computation once, so a collective inside a `lax.scan` body
(micro-batches, layers, pipeline ticks) appears once but runs trip-count times. This module
walks the call graph from the entry computation and multiplies by each while loop's
`known_trip_count`, which XLA records for scans.

Bytes are per device, from the result shape(s) of each op (what arrives on a device):
all-reduce and collective-permute move their operand; all-gather's result is the gathered
tensor; reduce-scatter's result is the scattered slice. Async pairs (`-start`/`-done`, GPU)
are counted at `-start`.
"""
from __future__ import annotations

import collections
import re
from typing import Any, Callable

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_COMP_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.+?) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\dm\d(?:fn)?)?)\[([\d,]*)\]")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO result shape such as `f32[64,64]{1,0}` or a tuple of them."""
    total = 0
    for dtype, dims in _SHAPE.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def _parse(hlo_text: str, classify: Callable[[str, str], str | None]
           ) -> tuple[str, dict[str, list[tuple[str, int]]], dict[str, list[tuple[str, int]]]]:
    """(entry name, computation -> [(class, bytes)], computation -> [(callee, multiplier)])."""
    entry, current = None, None
    ops: dict[str, list] = collections.defaultdict(list)
    calls: dict[str, list] = collections.defaultdict(list)
    for line in hlo_text.splitlines():
        header = _COMP_HEADER.match(line)
        if header:
            current = header.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        m = _INSTR.match(line) if current else None
        if not m:
            continue
        result, opcode, rest = m.groups()
        base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
        if base in KINDS and not opcode.endswith("-done"):
            label = classify(base, line)
            if label is not None:
                ops[current].append((label, shape_bytes(result)))
        trips = 1
        if opcode == "while":
            trip = _TRIP.search(rest)
            trips = int(trip.group(1)) if trip else 1
        for callee in _CALLED.findall(rest):
            calls[current].append((callee, trips if opcode == "while" else 1))
        for group in _BRANCHES.findall(rest):  # each branch counted once: an upper bound per call
            calls[current].extend((name.strip().lstrip("%"), 1) for name in group.split(","))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, ops, calls


def collective_stats(hlo_text: str, classify: Callable[[str, str], str | None] = lambda kind, line: kind
                     ) -> dict[str, dict[str, Any]]:
    """Per collective kind: {'count': executions per step, 'bytes': bytes per device per step}.

    `classify(kind, instruction_line)` may group differently (e.g. by the op_name in the line's
    metadata); returning None leaves the op out.
    """
    entry, ops, calls = _parse(hlo_text, classify)
    totals: dict[str, dict[str, Any]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for kind in KINDS:
        totals[kind]  # the standard kinds are always present, zero when absent

    def visit(comp: str, mult: int, depth: int = 0) -> None:
        if depth > 64:
            raise ValueError("HLO call graph too deep (a cycle?)")
        for label, nbytes in ops.get(comp, ()):
            totals[label]["count"] += mult
            totals[label]["bytes"] += mult * nbytes
        for callee, trips in calls.get(comp, ()):
            visit(callee, mult * trips, depth + 1)

    visit(entry, 1)
    return dict(totals)
