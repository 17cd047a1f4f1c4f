"""One layout in full (`python -m pjax.plan --explain LAYOUT`): the inspector's tables (`inspect`) of the step
`compile` builds, with the roofline's prediction (`estimate`) and each of its terms' sources (`breakdown`)."""
from __future__ import annotations

from typing import Any

from models.llama import param_logical_axes
from pjax.config import Config
from pjax.observe.memory import step_memory_bytes
from pjax.plan.breakdown import breakdown
from pjax.plan.compile import compile_planned
from pjax.plan.estimate import predict
from pjax.plan.inspect import (kernel_report, parameter_table, readable_bytes, step_collectives, step_matmuls,
                               step_report)
from pjax.plan.layouts import Layout, check


def explain(config: Config, layout: Layout, profile: Any, devices_per_host: int, backend: str = "cpu") -> str:
    """One layout in full: parameter shardings, the compiled step's memory and collectives (XLA:CPU's, or
    XLA:GPU's with `backend` 'gpu'), its prediction and why (`breakdown`: each term and what it came from)."""
    check(config, layout)
    cfg, trainer, compiled = compile_planned(config, layout, profile, devices_per_host, backend)
    mesh, devices = trainer.mesh, trainer.mesh.devices.size
    hlo = compiled.as_text()
    comm = step_collectives(cfg, dict(mesh.shape), hlo, devices_per_host)
    matmuls = step_matmuls(cfg, dict(mesh.shape), hlo)
    p = predict(cfg, layout, profile, comm, step_memory_bytes(compiled), 1.0 if profile.shares_host else 0.75,
                matmuls)
    terms = ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in p.terms.items() if v)
    head = (f"{layout.name} on {devices} {profile.name}, compiled by XLA:{backend.upper()} "
            f"({cfg.precision.preset_name(cfg.train.dtype)} precision, attention {cfg.train.attention}); "
            f"overrides: {' '.join(layout.overrides())}")
    verdict = (f"predicted {p.step_s * 1e3:,.1f} ms per step ({terms}), {p.tokens_per_s:,.0f} tokens/s, "
               f"{100 * p.mfu:.1f}% MFU; {readable_bytes(p.memory_bytes)} of {readable_bytes(p.usable_bytes)} "
               f"usable: {'fits' if p.fits else 'does NOT fit'}")
    return "\n\n".join([head, parameter_table(trainer.abstract_state().params, param_logical_axes(cfg.model)),
                        step_report(cfg, mesh, compiled, devices_per_host, comm), kernel_report(cfg, hlo), verdict,
                        breakdown(cfg, layout, profile, comm, p, matmuls)])
