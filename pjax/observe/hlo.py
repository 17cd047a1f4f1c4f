"""Collectives in a compiled program: how many run per step and how many bytes they move.

`as_text()` lists a scan body once, so this walks the call graph from the entry, multiplying by each while
loop's `known_trip_count`. Bytes are per device, from each op's result shape (async pairs at `-start`: its
outputs, where the start's result also holds its operands)."""
from __future__ import annotations

import collections
import math
import re
from typing import Any, Callable

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_COMP_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")  # name, result, opcode, rest
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


def _start_output(result: str) -> str:
    """The outputs in an async start's result: XLA:GPU's all-gather-, reduce-scatter- and collective-permute-start
    return (operands, outputs[, context]) (all-reduce-start returns its outputs alone)."""
    text = result.strip()
    if not text.startswith("("):
        return result
    parts, depth, begin = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or depth == 0:  # a top-level element ends
            parts.append(text[begin:i])
            begin = i + 1
        if depth == 0:
            break
    return parts[1] if len(parts) >= 2 else result


def callees(rest: str) -> list[str]:
    """The computations an instruction calls, from the text after its opcode: a fusion's or a reduce's, a while
    loop's body and condition, a conditional's branches."""
    branches = [b.strip().lstrip("%") for group in _BRANCHES.findall(rest) for b in group.split(",")]
    return _CALLED.findall(rest) + branches


def walk(hlo_text: str, on_instr: Callable[[str, str, str, str, str, str], None]) -> dict[str, int]:
    """Each instruction to `on_instr(computation, name, result shape, opcode, rest, line)`; returns how many
    times each computation runs per run of the entry: a while loop's body `known_trip_count` times (or as
    `hlo_loops.trip_count` reads its condition, where XLA gives none), each conditional branch once per call
    (an upper bound)."""
    entry, current = None, None
    calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for line in hlo_text.splitlines():
        header = _COMP_HEADER.match(line)
        if header:
            current = header.group(1)
            entry = current if line.startswith("ENTRY") else entry
            continue
        m = _INSTR.match(line) if current else None
        if not m:
            continue
        name, result, opcode, rest = m.groups()
        on_instr(current, name, result, opcode, rest, line)
        trips = 1  # a while's callees, its body and condition, run as often as its trip count says
        if opcode == "while":
            from pjax.observe import hlo_loops  # it reads this module's patterns

            known = _TRIP.search(rest)
            trips = int(known.group(1)) if known else hlo_loops.trip_count(hlo_text, current, rest) or 1
        calls[current].extend((callee, trips) for callee in callees(rest))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    runs: dict[str, int] = collections.defaultdict(int)

    def visit(comp: str, mult: int, depth: int = 0) -> None:
        if depth > 64:
            raise ValueError("HLO call graph too deep (a cycle?)")
        runs[comp] += mult
        for callee, trips in calls.get(comp, ()):
            visit(callee, mult * trips, depth + 1)

    visit(entry, 1)
    return dict(runs)


def collective_stats(hlo_text: str, classify: Callable[[str, str], str | None] = lambda kind, line: kind,
                     scale: Callable[[str, str], float] = lambda kind, line: 1) -> dict[str, dict[str, Any]]:
    """Per collective kind (or `classify`'s label; None leaves an op out): {'count', 'bytes'} per device
    per step; `scale` multiplies what the HLO cannot know, such as a loop's real trip count."""
    ops: dict[str, list[tuple[Any, int, float]]] = collections.defaultdict(list)

    def collective(comp: str, name: str, result: str, opcode: str, rest: str, line: str) -> None:
        base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
        if base in KINDS and not opcode.endswith("-done"):
            label = classify(base, line)
            if label is not None:
                shape = _start_output(result) if opcode.endswith("-start") and base != "all-reduce" else result
                ops[comp].append((label, shape_bytes(shape), scale(base, line)))

    runs = walk(hlo_text, collective)
    totals: dict[Any, dict[str, Any]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for kind in KINDS:
        totals[kind]  # always present
    for comp, mult in runs.items():
        for label, nbytes, per_call in ops.get(comp, ()):
            totals[label]["count"] += mult * per_call
            totals[label]["bytes"] += mult * per_call * nbytes
    return dict(totals)


_GROUPS_LIST = re.compile(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)?\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                          r" \{([^}]*)\}")
_ints = lambda text: [int(x) for x in text.split(",") if x]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    """XLA's iota tile assignment: arange(prod(dims)) reshaped to dims, transposed by perm."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def device_groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of one collective's HLO line (a permute's pairs); all devices when it names none."""
    m = _GROUPS_MESH.search(line)
    if m:  # mesh['a'=2,'b'=4], device_ids=([..]T(..)) {'b'}: groups vary over the named axes
        names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(n) for _, n in names]
        ids = (_iota(_ints(m.group(2)), _ints(m.group(3) or "")) if m.group(2) else np.arange(math.prod(sizes)))
        ids = ids.reshape(sizes)
        over = [i for i, (name, _) in enumerate(names) if f"'{name}'" in m.group(4)]
        keep = [i for i in range(len(sizes)) if i not in over]
        return ids.transpose(keep + over).reshape(-1, math.prod(sizes[i] for i in over)).tolist()
    m = _GROUPS_IOTA.search(line)
    if m:  # [groups, size]<=[dims]T(perm)
        return _iota(_ints(m.group(2)), _ints(m.group(3) or "")).reshape(_ints(m.group(1))).tolist()
    m = _GROUPS_LIST.search(line)
    if m and m.group(1):
        return [_ints(group) for group in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return [list(range(num_devices))]


def link_factor(kind: str, n: int) -> float:
    """Bytes a device sends per byte of the op's result, for ring algorithms over n devices."""
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
            "reduce-scatter": n - 1, "collective-permute": 1.0}[kind]


def collectives_by_axis(hlo_text: str, mesh_shape: dict[str, int], devices_per_host: int | None = None,
                        scale: Callable[[str, str], float] | None = None, merge: bool = True
                        ) -> dict[str, dict[str, Any]]:
    """Per set of mesh axes an op spans ('tp', 'dp+cp', ...): {'count', 'bytes', 'link_bytes', 'inter_host',
    'inter_link_bytes', 'kinds', 'group' (the devices those axes span)} per device per step; hosts are consecutive
    blocks of `devices_per_host` devices, 'inter_host' says whether any op's group spans them and
    'inter_link_bytes' the link bytes of those ops. The `ep` and `rp` axes count as part of dp (they split it),
    unless not `merge`."""
    mesh_shape = _merge_ep(dict(mesh_shape)) if merge else dict(mesh_shape)
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    n_dev, per_host = math.prod(sizes), devices_per_host or math.prod(sizes)

    def classify(kind: str, line: str) -> tuple:
        groups = device_groups(line, n_dev)
        coords = [np.array(np.unravel_index(g, sizes)) for g in groups if g]
        axes = sorted({names[a] for c in coords for a in range(len(names)) if len(set(c[a])) > 1},
                      key=names.index)
        inter = any(len({d // per_host for d in g}) > 1 for g in groups)
        size = 2 if kind == "collective-permute" else max(len(g) for g in groups)
        return kind, "+".join(axes) or "none", size, inter

    out: dict[str, dict[str, Any]] = {}
    for label, stats in collective_stats(hlo_text, classify, scale or (lambda kind, line: 1)).items():
        if isinstance(label, str):
            continue
        kind, axes, size, inter = label
        group = math.prod(mesh_shape[a] for a in axes.split("+") if a in mesh_shape)  # the axes' devices
        row = out.setdefault(axes, {"count": 0, "bytes": 0, "link_bytes": 0.0, "inter_host": False,
                                    "inter_link_bytes": 0.0, "kinds": {}, "group": group})
        link = stats["bytes"] * link_factor(kind, size)
        row["count"] += stats["count"]
        row["bytes"] += stats["bytes"]
        row["link_bytes"] += link
        row["inter_host"] |= inter
        row["inter_link_bytes"] += link if inter else 0.0
        row["kinds"][kind] = row["kinds"].get(kind, 0) + stats["count"]
    return out


def _merge_ep(shape: dict[str, int]) -> dict[str, int]:
    """`shape` with ep and rp folded into dp, their neighbour in the mesh (the dp of `MeshConfig`)."""
    folded = shape.pop("ep", 1) * shape.pop("rp", 1)
    return {a: v * folded if a == "dp" else v for a, v in shape.items()}


_WORK = ("fusion", "custom-call", "convolution", "dot")


def computations(hlo_text: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """Each computation of an HLO module's text: its instructions in order, as (name, result type, opcode, the
    rest)."""
    body: dict[str, list[tuple[str, str, str, str]]] = collections.defaultdict(list)
    current = None
    for line in hlo_text.splitlines():
        header = _COMP_HEADER.match(line)
        if header:
            current = header.group(1)
            continue
        m = _INSTR.match(line) if current else None
        if m:
            body[current].append(m.groups())
    return dict(body)


def async_overlap(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per kind, {'sites', 'overlapped'}: the collectives of a scheduled module (XLA:GPU's) and those run
    asynchronously with compute scheduled between start and done (`all-reduce-start` ... `all-reduce-done`, or
    an `async-start` calling a computation that holds the collective); places in the program, not executions."""
    body = {comp: [(name, op, rest) for name, _, op, rest in instrs] for comp, instrs in computations(hlo_text).items()}
    holds = {comp: op for comp, instrs in body.items() for _, op, _ in instrs if op in KINDS}
    out = {kind: {"sites": 0, "overlapped": 0} for kind in KINDS}
    wrapped = set()
    for instrs in body.values():
        for i, (name, op, rest) in enumerate(instrs):
            kind, done_op = _async_kind(op, rest, holds)
            if kind is None:
                continue
            if op == "async-start":
                wrapped.add(re.search(r"calls=%([\w.\-]+)", rest).group(1))
            done = next((j for j in range(i + 1, len(instrs)) if instrs[j][1] == done_op
                         and re.match(rf"%{re.escape(name)}(?![\w.\-])", instrs[j][2])), len(instrs))
            out[kind]["sites"] += 1
            out[kind]["overlapped"] += any(op2 in _WORK for _, op2, _ in instrs[i + 1:done])
    for comp, instrs in body.items():
        if comp not in wrapped:
            for _, op, _ in instrs:
                if op in KINDS:
                    out[op]["sites"] += 1
    return {kind: row for kind, row in out.items() if row["sites"]}


def async_spans(hlo_text: str, kind: str = "all-reduce") -> list[tuple[str, str, list[str]]]:
    """Each `kind-start` ... `kind-done` of a scheduled module: (its computation, its result type, the opcodes
    scheduled between the two)."""
    spans = []
    for comp, instrs in computations(hlo_text).items():
        for i, (name, result, op, _) in enumerate(instrs):
            if op == f"{kind}-start":
                done = next((j for j in range(i + 1, len(instrs)) if instrs[j][2] == f"{kind}-done"
                             and re.match(rf"%{re.escape(name)}(?![\w.\-])", instrs[j][3])), len(instrs))
                spans.append((comp, result, [ins[2] for ins in instrs[i + 1:done]]))
    return spans


def _async_kind(op: str, rest: str, holds: dict[str, str]) -> tuple[str | None, str]:
    """(the collective an asynchronous start begins, the opcode of its done), or (None, '')."""
    if op.endswith("-start") and op[:-len("-start")] in KINDS:
        return op[:-len("-start")], op[:-len("-start")] + "-done"
    callee = re.search(r"calls=%([\w.\-]+)", rest) if op == "async-start" else None
    if callee and callee.group(1) in holds:
        return holds[callee.group(1)], "async-done"
    return None, ""
