"""How a plan reads: the ranked table, the verdict (the winning overrides, or why nothing fits), and its JSON."""
from __future__ import annotations

from typing import Any

from pjax.plan.search import Candidate, Plan


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _row(rank: int, c: Candidate, width: int) -> str:
    if c.prediction is None:
        return f"{rank:>3}  {c.layout.name:<{width}} compile failed: {c.compiled.get('error', '?')}"
    p = c.prediction
    fit = f"{_gib(p.memory_bytes):>6}  {'yes' if p.fits else 'NO':>4} {_gib(p.usable_bytes - p.memory_bytes):>7}"
    return (f"{rank:>3}  {c.layout.name:<{width}}{fit}  {p.step_s * 1e3:>10,.1f}  {p.tokens_per_s:>12,.0f}"
            f"  {100 * p.mfu:>5.1f}%  {p.limit}")


def table(plan: Plan, top: int) -> str:
    """The compiled layouts, fitting ones first by predicted step time, with the counts of the search."""
    head = (f"{plan.config.model.num_params / 1e9:.2f}B parameters, {plan.config.train.batch_size} x "
            f"{plan.config.train.seq_len} tokens per step on {plan.devices} {plan.profile.name} "
            f"({plan.devices // plan.devices_per_host} host(s) of {plan.devices_per_host}); "
            f"{_gib(plan.usable_bytes)} GiB usable per device ({plan.mem_fraction:g} of its memory)")
    counts = (f"{plan.listed} layouts pjax accepts; {len(plan.too_big)} need more than that for their state alone; "
              f"{len(plan.compiled)} compiled ({sum(bool(c.compiled and c.compiled.get('cached')) for c in plan.compiled)}"
              f" from the cache) out of {len(plan.candidates)} scored")
    shown = plan.compiled[:top]
    width = max([34, *(len(c.layout.name) + 1 for c in shown)])
    cols = (f"{'#':>3}  {'layout':<{width}}{'GiB':>6}  {'fits':>4} {'spare':>7}  {'step ms':>10}  {'tokens/s':>12}"
            f"  {'MFU':>6}  limit")
    rows = [_row(i + 1, c, width) for i, c in enumerate(shown)]
    return "\n".join([head, counts, "", cols, *rows])


def run_overrides(c: Candidate, plan: Plan) -> list[str]:
    """The layout's overrides, and chunked attention where cuDNN's would not compile for it (`pjax.cudnn_fallback`,
    a guard no shipped layout family needs): the command runs what was compiled."""
    fell_back = plan.profile.attention == "cudnn" and (c.compiled or {}).get("attention") == "chunked"
    return c.layout.overrides() + (["train.attention=chunked"] if fell_back else [])


def _fastest(plan: Plan) -> Candidate | None:
    return next((c for c in plan.compiled if c.prediction is not None and c.prediction.fits), None)


def verdict(plan: Plan, config_name: str) -> str:
    """The winning layout as a `pjax.train` command, or why no layout fits."""
    best = _fastest(plan)
    if best is not None:
        p = best.prediction
        return (f"fastest: {best.layout.name}, predicted {p.step_s * 1e3:,.1f} ms per step, {p.tokens_per_s:,.0f} "
                f"tokens/s, {100 * p.mfu:.1f}% MFU, limited by {p.limit}; run it with\n"
                f"  python -m pjax.train --config {config_name} {' '.join(run_overrides(best, plan))}")
    usable = _gib(plan.usable_bytes)
    if not plan.candidates and plan.too_big:
        layout, state = min(plan.too_big, key=lambda t: t[1]["total"])
        return (f"does not fit: the training state alone needs {_gib(state['total'])} GiB per device even split the "
                f"most ({layout.name}: fp32 parameters {_gib(state['params'])}, gradient {_gib(state['grads'])}, "
                f"AdamW moments {_gib(state['opt_state'])} GiB), and a {plan.profile.name} has {usable} GiB usable; "
                f"use more devices, a smaller model, or a larger --mem-fraction.")
    if not plan.candidates:
        return (f"no layout: this config does not divide over {plan.devices} devices (its heads, kv-heads, layers "
                f"and batch rows); choose a device count they divide, or change train.batch_size.")
    done = [c for c in plan.compiled if c.prediction is not None]
    if not done:
        return "no layout compiled; the errors are in the table above."
    least = min(done, key=lambda c: c.prediction.memory_bytes)
    m = least.compiled["memory"]
    return (f"does not fit: the compiled layouts need at least {_gib(m['total'])} GiB per device ({least.layout.name}: "
            f"{_gib(m['total'] - m['temp'])} GiB state and batch, {_gib(m['temp'])} GiB temporaries) and a "
            f"{plan.profile.name} has {usable} GiB usable; try train.remat=full, fewer rows per micro-batch "
            f"(train.batch_size), more devices, or a larger --max-candidates.")


def _candidate_json(c: Candidate, plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {"layout": c.layout.name, "overrides": run_overrides(c, plan)}
    if c.compiled is not None:
        keys = ("error", "memory", "comm", "attention", "compile_s", "cached")
        out.update({k: c.compiled[k] for k in keys if k in c.compiled})
    if c.prediction is not None:
        p = c.prediction
        out.update(fits=p.fits, memory_bytes=p.memory_bytes, usable_bytes=p.usable_bytes, step_s=p.step_s,
                   tokens_per_s=p.tokens_per_s, mfu=p.mfu, limit=p.limit, terms=p.terms)
    out["analytic"] = {"step_s": c.estimate.step_s, "memory_bytes": c.estimate.memory_bytes, "terms": c.estimate.terms}
    return out


def as_json(plan: Plan, config_name: str) -> dict[str, Any]:
    best = _fastest(plan)
    return {"config": config_name, "device_kind": plan.profile.name, "devices": plan.devices,
            "devices_per_host": plan.devices_per_host, "usable_bytes": plan.usable_bytes, "listed": plan.listed,
            "state_too_big": len(plan.too_big), "scored": len(plan.candidates),
            "compiled": [_candidate_json(c, plan) for c in plan.compiled],
            "best": None if best is None else _candidate_json(best, plan), "verdict": verdict(plan, config_name)}
