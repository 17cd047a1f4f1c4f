"""The planner's search: every layout scored analytically, the most promising compiled, XLA's figures deciding.

Layouts whose exact state alone exceeds a device are dropped, the rest scored by the roofline. Layouts that
differ only in micro-batch count form a family: three quarters of the budget compiles each best family's best
count that fits, then a family whose compile does not fit retries at `_count_that_fits`, and the rest goes to
the next families. The compiled candidates are scored again with XLA's collectives and memory."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from models.precision import bytes_per
from pjax.config import Config
from pjax.observe.hlo_flops import StepMatmuls
from pjax.plan.compile import Compiler
from pjax.plan.estimate import WORK, Prediction, analytic_comm, analytic_memory, predict, usable_bytes
from pjax.plan.layouts import Layout, layouts, planned_config, policy, state_bytes
from pjax.plan.profiles import Profile


@dataclasses.dataclass
class Candidate:
    layout: Layout
    estimate: Prediction  # analytic
    compiled: dict[str, Any] | None = None  # or {'error': ...}
    prediction: Prediction | None = None  # from XLA's figures

    @property
    def family(self) -> Layout:
        return dataclasses.replace(self.layout, grad_accum=1)


@dataclasses.dataclass
class Plan:
    config: Config
    profile: Profile
    devices: int
    devices_per_host: int
    mem_fraction: float
    listed: int
    too_big: list[tuple[Layout, dict[str, int]]]  # the state alone does not fit
    candidates: list[Candidate]  # scored analytically, best first
    compiled: list[Candidate]  # fitting by predicted step time, then the rest by memory

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.profile, self.devices, self.mem_fraction)


def score(config: Config, layout: Layout, profile: Profile, per_host: int, mem_fraction: float) -> Prediction:
    """The analytic roofline prediction of one layout (collectives and memory from formulas)."""
    act_bytes = bytes_per(policy(config, profile).embedding)
    comm = analytic_comm(config, layout, act_bytes, per_host)
    memory = analytic_memory(config, layout, act_bytes, profile.attention)
    return predict(config, layout, profile, comm, memory, mem_fraction)


def _rank_key(c: Candidate) -> tuple:
    p = c.prediction
    if p is None:
        return (2, 0.0)
    # Equal times (dp traffic hidden under compute) go to less traffic, then more spare memory.
    traffic = sum(t for a, t in p.terms.items() if a not in WORK)
    return (0, round(p.step_s, 9), traffic, p.memory_bytes) if p.fits else (1, p.memory_bytes)


def plan(config: Config, profile: Profile, devices: int, devices_per_host: int, compiler: Compiler,
         max_candidates: int, mem_fraction: float, progress: Callable[[int], Callable[[], None]] | None = None
         ) -> Plan:
    """Search the layouts of `config` on `devices` devices of `profile`."""
    listed = layouts(config, devices, devices_per_host)
    usable = usable_bytes(profile, devices, mem_fraction)
    too_big, scored = [], []
    for layout in listed:
        state = state_bytes(config, layout)
        if state["total"] > usable:
            too_big.append((layout, state))
            continue
        scored.append(Candidate(layout, score(config, layout, profile, devices_per_host, mem_fraction)))
    scored.sort(key=lambda c: (not c.estimate.fits, c.estimate.step_s, c.layout.grad_accum))
    families: dict[Layout, list[Candidate]] = {}
    for c in scored:
        families.setdefault(c.family, []).append(c)
    queue = [members[0] for members in families.values()]
    first, queue = queue[:math.ceil(max_candidates * 3 / 4)], queue[math.ceil(max_candidates * 3 / 4):]
    on_done = progress(min(max_candidates, len(first) + len(queue))) if progress else (lambda: None)
    _compile(config, profile, compiler, first, on_done, mem_fraction)
    second = [retry for c in first if c.prediction is not None and not c.prediction.fits
              for retry in [_count_that_fits(c, families[c.family], usable)] if retry is not None]
    second = second[:max_candidates - len(first)]
    second += queue[:max_candidates - len(first) - len(second)]
    _compile(config, profile, compiler, second, on_done, mem_fraction)
    done = first + second
    ranked = sorted(done, key=_rank_key)
    return Plan(config, profile, devices, devices_per_host, mem_fraction, len(listed), too_big, scored, ranked)


def _compile(config: Config, profile: Profile, compiler: Compiler, batch: list[Candidate],
             on_done: Callable[[], None], mem_fraction: float) -> None:
    results = compiler.run(config, [c.layout for c in batch], on_done)
    for c in batch:
        c.compiled = results[c.layout]
        if "error" not in c.compiled:
            c.prediction = predict(planned_config(config, c.layout, profile), c.layout, profile,
                                   c.compiled["comm"], c.compiled["memory"]["total"], mem_fraction,
                                   StepMatmuls.from_json(c.compiled.get("matmuls")))


def _count_that_fits(c: Candidate, family: list[Candidate], usable: int) -> Candidate | None:
    """The family's fewest micro-batches above c's whose temporaries, scaled by the micro-batch size, fit."""
    memory = c.compiled["memory"]
    resident = memory["total"] - memory["temp"]
    for other in sorted(family, key=lambda o: o.layout.grad_accum):
        m = other.layout.grad_accum
        if m > c.layout.grad_accum and resident + memory["temp"] * c.layout.grad_accum / m <= usable:
            return other
    return None
