"""The matmuls a compiled program executes per device: every `dot` (fused or not) and cuBLAS GEMM call, by shape,
each counted as often as the loops around it run (`hlo.walk`: a while loop's `known_trip_count`), and their FLOPs.

Model FLOPs count what the model needs; this counts what XLA runs: a remat policy's recomputed forward, a
Mixture of Experts whose grouped matmuls run every expert over a padded buffer, a masked block of attention.
A conditional's branches are each counted once per call (an upper bound), and kernels that are not dots
(cuDNN's fused attention) are not counted."""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

from pjax.observe.hlo import _SHAPE, walk

_DOT_DIMS = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DOT_BATCH = re.compile(r"lhs_batch_dims=\{([\d,]*)\}")
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_GEMM_BATCH = re.compile(r'"lhs_batch_dimensions":\[([^\]]*)\]')
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)')
_FUSED_ATTENTION = 'custom_call_target="__cudnn$fmha'  # cuDNN's fused attention: its FLOPs are in no dot

Product = tuple[int, int, int]  # (rows, contraction, columns); a batched product's batch is in its rows


def _dims(shape: str) -> list[int]:
    """The first array shape's dimensions in an HLO shape (a tuple's first element)."""
    m = _SHAPE.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _indices(match: re.Match | None) -> list[int]:
    return [int(i.strip('" ')) for i in match.group(1).split(",") if i.strip('" ')] if match else []


def _product(result: str, opcode: str, rest: str, shapes: dict[str, str]) -> Product | None:
    """A dot's or a cuBLAS GEMM call's (rows, contraction, columns); None for anything else."""
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


def dot_products(hlo_text: str) -> dict[Product, int]:
    """How many times per run of the program `hlo_text` (`compiled.as_text()`) each matmul shape runs."""
    shapes: dict[str, str] = {}  # every instruction's result shape (parameters included): a dot's operand shapes
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def matmul(comp: str, name: str, result: str, opcode: str, rest: str, line: str) -> None:
        shapes[name] = result
        product = _product(result, opcode, rest, shapes)
        if product:
            own[comp][product] += 1

    total: collections.Counter = collections.Counter()
    for comp, runs in walk(hlo_text, matmul).items():
        for product, count in own.get(comp, {}).items():
            total[product] += count * runs
    return dict(total)


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

    products: tuple[tuple[int, int, int, int], ...]
    fused_attention: bool = False

    @classmethod
    def from_hlo(cls, hlo_text: str) -> "StepMatmuls":
        products = tuple((*shape, runs) for shape, runs in sorted(dot_products(hlo_text).items()))
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
