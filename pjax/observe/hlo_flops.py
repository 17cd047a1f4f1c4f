"""The matmuls a compiled program executes per device: every `dot` (fused or not) and cuBLAS GEMM call, by shape,
each counted as often as the loops around it run (`hlo.walk`: a while loop's `known_trip_count`), and their FLOPs.

Model FLOPs count what the model needs; this counts what XLA runs: a remat policy's recomputed forward, a
Mixture of Experts whose grouped matmuls run every expert over a padded buffer, a masked block of attention.
A conditional's branches are each counted once per call (an upper bound), and kernels that are not dots
(cuDNN's fused attention) are not counted. A pipeline's tick runs its parts in loops of zero or one trip, which
the HLO shows once per tick: `part_runs` (`pipeline.table.part_runs`) weights each dot by how often its part
really runs."""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any, Callable

from pjax.observe.hlo import _SHAPE, callees, walk

_DOT_DIMS = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DOT_BATCH = re.compile(r"lhs_batch_dims=\{([\d,]*)\}")
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_GEMM_BATCH = re.compile(r'"lhs_batch_dimensions":\[([^\]]*)\]')
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)')
_FUSED_ATTENTION = 'custom_call_target="__cudnn$fmha'  # cuDNN's fused attention: its FLOPs are in no dot
_GROUPED = re.compile(r'custom_call_target="mosaic_gpu')  # a Pallas Mosaic GPU kernel: tokamax's grouped GEMM
GROUPED = "[grouped GEMM kernel]"  # what `gemm_sites` and `gemm_census`'s callers see after such a kernel's op name
_CONSTRAINTS = re.compile(r"operand_layout_constraints=\{(.*?)\}, api_version")

Product = tuple[int, int, int]  # (rows, contraction, columns); a batched product's batch is in its rows


def _dims(shape: str) -> list[int]:
    """The first array shape's dimensions in an HLO shape (a tuple's first element)."""
    m = _SHAPE.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _indices(match: re.Match | None) -> list[int]:
    return [int(i.strip('" ')) for i in match.group(1).split(",") if i.strip('" ')] if match else []


def _grouped(result: str, rest: str) -> Product | None:
    """A tokamax grouped GEMM's (rows, contraction, columns), from its first floating-point operand [rows,
    contraction] and its output's last dimension (forward, dX and dW alike). It computes the routed rows at run
    time; its buffer's rows, counted here, bound them."""
    operands = _CONSTRAINTS.search(rest)
    shapes = _SHAPE.finditer(operands.group(1) if operands else "")
    floats = [[int(d) for d in m.group(2).split(",") if d] for m in shapes if m.group(1) in ("bf16", "f16", "f32")]
    out = _dims(result)
    return (*floats[0], out[-1]) if floats and len(floats[0]) == 2 and out else None


def _product(result: str, opcode: str, rest: str, shapes: dict[str, str]) -> Product | None:
    """A dot's, a cuBLAS GEMM call's or a grouped GEMM kernel's (rows, contraction, columns); None for anything else."""
    if opcode == "custom-call" and _GROUPED.search(rest) and "RaggedDot" in rest:
        return _grouped(result, rest)
    if opcode == "dot":
        contracting, batch = _DOT_DIMS.search(rest), _DOT_BATCH.search(rest)
    elif opcode == "custom-call" and _GEMM.search(rest):
        contracting, batch = _GEMM_DIMS.search(rest), _GEMM_BATCH.search(rest)
    else:
        return None
    lhs = re.match(r"\s*(?:[^%]*?)%([\w.\-]+)", rest)
    lhs_dims = _dims(shapes.get(lhs.group(1), "")) if lhs else []
    if not contracting or not lhs_dims:
        return None
    k = math.prod(lhs_dims[i] for i in _indices(contracting))
    rows = math.prod(lhs_dims) // k  # the batch and the lhs's free dimensions
    batch = math.prod(lhs_dims[i] for i in _indices(batch))
    return rows, k, math.prod(_dims(result)) // max(rows // batch, 1) // batch


def dot_products(hlo_text: str, part_runs: Callable[[str], float | None] | None = None) -> dict[Product, float]:
    """How many times per run of the program `hlo_text` (`compiled.as_text()`) each matmul shape runs; with
    `part_runs` (a pipeline's), each dot weighted by its tick part's runs per tick (`_enclosing`: a dot outside
    every part)."""
    shapes: dict[str, str] = {}  # every instruction's result shape (parameters included): a dot's operand shapes
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    scoped: dict[str, list[float]] = collections.defaultdict(list)  # each computation's part weights
    parent: dict[str, str] = {}

    def matmul(comp: str, name: str, result: str, opcode: str, rest: str, line: str) -> None:
        shapes[name] = result
        weight = part_runs(line) if part_runs else 1
        if part_runs and weight is not None:
            scoped[comp].append(weight)
        for callee in callees(rest):
            parent.setdefault(callee, comp)
        product = _product(result, opcode, rest, shapes)
        if product:
            own[comp][product, weight] += 1

    total: collections.Counter = collections.Counter()
    for comp, runs in walk(hlo_text, matmul).items():
        for (product, weight), count in own.get(comp, {}).items():
            total[product] += count * runs * (weight if weight is not None else _enclosing(comp, scoped, parent))
    return dict(total)


def _enclosing(comp: str, scoped: dict[str, list[float]], parent: dict[str, str]) -> float:
    """A dot without a tick part of its own (XLA:CPU's library fusions keep no op name, nor do the fusions that
    call them) runs as often as the computation it sits in, or the nearest one around it, that has parts: the
    largest of their weights (a guarded part's body holds that part and the parts nested in it); 1 outside."""
    for _ in range(64):
        if scoped.get(comp):
            return max(scoped[comp])
        if comp not in parent:
            return 1.0
        comp = parent[comp]
    raise ValueError("HLO call graph too deep (a cycle?)")


GEMM_KINDS = ("fp8", "fp16", "bf16", "fp32")  # narrowest first


def kind_order(kind: str) -> int:
    """A GEMM kind's place in `GEMM_KINDS` (others after them)."""
    return GEMM_KINDS.index(kind) if kind in GEMM_KINDS else len(GEMM_KINDS)


def _kind(dtype: str) -> str:
    """A GEMM operand's HLO dtype as the census names it: fp8 (either format), bf16, fp16, fp32, or as it is."""
    return "fp8" if dtype.startswith("f8") else {"bf16": "bf16", "f16": "fp16", "f32": "fp32"}.get(dtype, dtype)


def _gemm_kinds(hlo_text: str, on_gemm: Callable[[str, str, Product, str], None]) -> dict[str, int]:
    """`walk`, calling `on_gemm(computation, kind, product, op_name)` for each dot and cuBLAS GEMM, its kind its
    operands' dtype ('fp8', 'bf16', 'fp32', ...; the wider of two that differ); returns `walk`'s runs."""
    shapes: dict[str, str] = {}

    def visit(comp: str, name: str, result: str, opcode: str, rest: str, line: str) -> None:
        shapes[name] = result
        product = _product(result, opcode, rest, shapes)
        if product:
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])[:2]
            kinds = sorted({_kind(m.group(1)) for o in operands if (m := _SHAPE.search(shapes.get(o, "")))},
                           key=kind_order)
            op_name = re.search(r'op_name="([^"]*)"', rest)
            op_name = op_name.group(1) if op_name else ""
            if _GROUPED.search(rest):  # its first operands are the groups' integer metadata: its output's dtype
                kinds, op_name = [_kind(_SHAPE.search(result).group(1))], op_name + " " + GROUPED
            on_gemm(comp, kinds[-1] if kinds else "?", product, op_name)

    return walk(hlo_text, visit)


def gemm_census(hlo_text: str, part_runs: Callable[[str], float | None] | None = None
                ) -> dict[str, dict[str, float]]:
    """A compiled program's matmuls by operand dtype ('fp8', 'bf16', 'fp32', ...): {'gemms': runs per run of
    the program, 'flops'}, each dot or cuBLAS GEMM counted as often as the loops around it run (`walk`) and, with
    `part_runs` (a pipeline's), as often per tick as its tick part runs (a GEMM outside every part: once per tick).
    cuDNN's fused attention is in no GEMM."""
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def weight(op_name: str) -> float:
        found = part_runs(f'op_name="{op_name}"') if part_runs else None
        return 1.0 if found is None else found

    runs = _gemm_kinds(hlo_text, lambda comp, kind, product, op_name: own[comp].update([(kind, product,
                                                                                         weight(op_name))]))
    census: dict[str, dict[str, float]] = {}
    for comp, times in runs.items():
        for (kind, (m, k, n), w), count in own.get(comp, {}).items():
            row = census.setdefault(kind, {"gemms": 0.0, "flops": 0.0})
            row["gemms"] += count * times * w
            row["flops"] += 2.0 * m * k * n * count * times * w
    return census


def scoped_gemm_flops(hlo_text: str, scope: str, grouped: bool = True) -> float:
    """FLOPs per run of the program of the matmuls traced under the named scope `scope` (their op names hold
    `/scope/`), each counted as often as the loops around it run; `grouped=False` leaves out the grouped GEMM
    kernels (counted at their buffers' rows: `_grouped`)."""
    own: dict[str, list[Product]] = collections.defaultdict(list)
    keep = lambda op_name: f"/{scope}/" in op_name and (grouped or GROUPED not in op_name)  # noqa: E731
    runs = _gemm_kinds(hlo_text, lambda comp, kind, product, op_name: own[comp].append(product)
                       if keep(op_name) else None)
    return sum(2.0 * m * k * n * times for comp, times in runs.items() for m, k, n in own.get(comp, []))


def gemm_sites(hlo_text: str) -> list[tuple[str, str]]:
    """Each matmul's place in a compiled program: (operand kind, its op name, which holds the named scopes
    it was traced under: `transpose(...)` for autodiff's backward)."""
    sites: list[tuple[str, str]] = []
    _gemm_kinds(hlo_text, lambda comp, kind, product, op_name: sites.append((kind, op_name)))
    return sites


def fused_attention(hlo_text: str, part_runs: Callable[[str], float | None] | None = None) -> dict[str, float]:
    """cuDNN's fused attention calls per run of a compiled program, each counted as often as the loops around it
    run (`walk`) and, with `part_runs` (a pipeline's), as often per tick as its tick part runs on an average
    device (`dot_products`): {'forward', 'backward'}."""
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    scoped: dict[str, list[float]] = collections.defaultdict(list)
    parent: dict[str, str] = {}

    def visit(comp: str, name: str, result: str, opcode: str, rest: str, line: str) -> None:
        weight = part_runs(line) if part_runs else 1
        if part_runs and weight is not None:
            scoped[comp].append(weight)
        for callee in callees(rest):
            parent.setdefault(callee, comp)
        call = re.search(r'custom_call_target="__cudnn\$fmha\w*?(Backward)?"', rest) if opcode == "custom-call" else None
        if call:
            own[comp]["backward" if call.group(1) else "forward", weight] += 1

    out = {"forward": 0.0, "backward": 0.0}
    for comp, runs in walk(hlo_text, visit).items():
        for (direction, weight), count in own.get(comp, {}).items():
            out[direction] += count * runs * (weight if weight is not None else _enclosing(comp, scoped, parent))
    return out


def product_flops(products: dict[Product, int]) -> float:
    """The FLOPs of `dot_products`' result: 2 x rows x contraction x columns each time a product runs."""
    return float(sum(2 * m * k * n * runs for (m, k, n), runs in products.items()))


def dot_flops(hlo_text: str) -> float:
    """Matmul FLOPs per device per run of the program `hlo_text` (`compiled.as_text()`)."""
    return product_flops(dot_products(hlo_text))


@dataclasses.dataclass(frozen=True)
class StepMatmuls:
    """A compiled step's matmuls per device: (rows, contraction, columns, runs per step) of each shape, and
    whether cuDNN's fused attention (whose FLOPs are in no dot) runs in it."""

    products: tuple[tuple[int, int, int, float], ...]  # a pipeline's runs: an average device's
    fused_attention: bool = False

    @classmethod
    def from_hlo(cls, hlo_text: str, part_runs: Callable[[str], float | None] | None = None) -> "StepMatmuls":
        """A compiled step's; `part_runs`: a pipeline's tick parts' runs (`dot_products`)."""
        products = tuple((*shape, runs) for shape, runs in sorted(dot_products(hlo_text, part_runs).items()))
        return cls(products, _FUSED_ATTENTION in hlo_text)

    @classmethod
    def from_json(cls, record: dict[str, Any] | None) -> "StepMatmuls | None":
        """From `as_json`'s record (a plan cache entry); None for None."""
        if record is None:
            return None
        return cls(tuple(tuple(p) for p in record["products"]), record["fused_attention"])

    def as_json(self) -> dict[str, Any]:
        return {"products": [list(p) for p in self.products], "fused_attention": self.fused_attention}

    @property
    def flops(self) -> float:
        return float(sum(2 * m * k * n * runs for m, k, n, runs in self.products))
