"""A while loop's trip count where XLA's text gives none.

XLA annotates a loop with `known_trip_count` when its condition compares the induction variable with a constant
in plain sight. A loop that XLA:GPU's collective pipeliner rotated (an iteration peeled before or after it) has
its new condition fused (`compare(param, constant)` inside a fusion), and the annotation is lost: counted once, a
scan over micro-batches then reports a quarter of its kernels. Here the condition, the induction variable's start
and its step are read as affine expressions of the variable (constants, copies, adds and subtracts, through
fusions), which is what the pipeliner writes."""
from __future__ import annotations

import functools
import math
import re

from pjax.observe.hlo import _COMP_HEADER, _INSTR
_INDUCTION = re.compile(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}')
_CONDITION = re.compile(r"condition=%([\w.\-]+)")
_BODY = re.compile(r"body=%([\w.\-]+)")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")
_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE", "EQ": "EQ"}

Affine = tuple[int, int]  # value = a * induction variable + b


class _Instr:
    __slots__ = ("opcode", "operands", "rest")

    def __init__(self, opcode: str, rest: str):
        self.opcode, self.rest = opcode, rest
        depth, end = 1, len(rest)
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                end = i
                break
        self.operands = re.findall(r"%([\w.\-]+)", rest[:end])


class _Module:
    """Each computation's instructions by name, its root and its parameters by number."""

    def __init__(self, hlo_text: str):
        self.instrs: dict[str, dict[str, _Instr]] = {}
        self.roots: dict[str, str] = {}
        self.params: dict[str, dict[int, str]] = {}
        current = None
        for line in hlo_text.splitlines():
            header = _COMP_HEADER.match(line)
            if header:
                current = header.group(1)
                self.instrs[current], self.params[current] = {}, {}
                continue
            m = _INSTR.match(line) if current else None
            if not m:
                continue
            name, _, opcode, rest = m.groups()
            self.instrs[current][name] = _Instr(opcode, rest)
            if line.lstrip().startswith("ROOT "):
                self.roots[current] = name
            if opcode == "parameter":
                self.params[current][int(rest.split(")")[0])] = name

    def affine(self, comp: str, name: str, induction: tuple[str, int] | None, args: dict[str, Affine | None]
               ) -> Affine | None:
        """`name`'s value in `comp` as an affine function of the loop's induction variable (element `induction[1]`
        of `induction[0]`'s parameter), `args` the values of a fused computation's parameters; None if not."""
        instr = self.instrs[comp].get(name)
        if instr is None:
            return None
        op = instr.opcode
        if op == "constant":
            value = re.match(r"\s*(-?\d+)\)", instr.rest)
            return (0, int(value.group(1))) if value else None
        if op == "parameter":
            return args.get(name)
        if op == "get-tuple-element":
            index = int(re.search(r"index=(\d+)", instr.rest).group(1))
            source = self.instrs[comp].get(instr.operands[0])
            is_loop_state = induction is not None and comp == induction[0] and source is not None
            return (1, 0) if is_loop_state and source.opcode == "parameter" and index == induction[1] else None
        if op in _PASS_THROUGH:
            return self.affine(comp, instr.operands[0], induction, args)
        if op in ("add", "subtract"):
            a, b = (self.affine(comp, o, induction, args) for o in instr.operands[:2])
            if a is None or b is None:
                return None
            sign = 1 if op == "add" else -1
            return a[0] + sign * b[0], a[1] + sign * b[1]
        if op == "fusion":
            fused = _CALLS.search(instr.rest).group(1)
            bound = {self.params[fused][i]: self.affine(comp, o, induction, args)
                     for i, o in enumerate(instr.operands) if i in self.params[fused]}
            return self.affine(fused, self.roots[fused], None, bound)
        return None

    def condition(self, comp: str, name: str, induction: tuple[str, int], args: dict[str, Affine | None]
                  ) -> tuple[str, int] | None:
        """(direction, bound) of a condition that compares the induction variable with a constant: `v < bound`."""
        instr = self.instrs[comp][name]
        if instr.opcode == "fusion":
            fused = _CALLS.search(instr.rest).group(1)
            bound = {self.params[fused][i]: self.affine(comp, o, induction, args)
                     for i, o in enumerate(instr.operands) if i in self.params[fused]}
            return self.condition(fused, self.roots[fused], induction, bound)
        if instr.opcode != "compare":
            return None
        a, b = (self.affine(comp, o, induction if comp == induction[0] else None, args) for o in instr.operands[:2])
        direction = re.search(r"direction=(\w+)", instr.rest).group(1)
        if a == (1, 0) and b is not None and b[0] == 0:
            return direction, b[1]
        if b == (1, 0) and a is not None and a[0] == 0:
            return _FLIP[direction], a[1]
        return None


@functools.lru_cache(maxsize=4)
def _module(hlo_text: str) -> _Module:
    return _Module(hlo_text)


def trip_count(hlo_text: str, caller: str, while_rest: str) -> int | None:
    """How many times the while loop called from `caller` (the text after its opcode, `while_rest`) runs its body,
    read from its condition, the induction variable's start and its step; None where they are not affine."""
    induction = _INDUCTION.search(while_rest)
    if not induction:
        return None
    k, module = int(induction.group(1)), _module(hlo_text)
    cond, body = _CONDITION.search(while_rest).group(1), _BODY.search(while_rest).group(1)
    init_tuple = module.instrs[caller].get(_Instr("while", while_rest).operands[0])
    if init_tuple is None or init_tuple.opcode != "tuple" or k >= len(init_tuple.operands):
        return None
    start = module.affine(caller, init_tuple.operands[k], None, {})
    step_tuple = module.instrs[body][module.roots[body]]
    step = module.affine(body, step_tuple.operands[k], (body, k), {}) if step_tuple.opcode == "tuple" else None
    test = module.condition(cond, module.roots[cond], (cond, k), {})
    if start is None or start[0] != 0 or step is None or step[0] != 1 or test is None:
        return None
    (direction, bound), first, stride = test, start[1], step[1]
    if direction in ("LE", "GE"):
        bound += 1 if direction == "LE" else -1
        direction = "LT" if direction == "LE" else "GT"
    if direction == "LT" and stride > 0:
        return max(0, math.ceil((bound - first) / stride))
    if direction == "GT" and stride < 0:
        return max(0, math.ceil((first - bound) / -stride))
    return None
