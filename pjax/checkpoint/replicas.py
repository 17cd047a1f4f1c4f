"""The state kept per data replica, saved with a checkpoint: error feedback's residuals
(`train.grad_compression`) and DiLoCo's groups (`train.local_steps`). Their values belong to the replicas
that kept them: a resume with the same replicas restores them exactly, one with other replicas starts them
afresh with a warning (residuals at zero; every group at the global parameters)."""
from __future__ import annotations

from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from pjax.config import Config


def save_args(state: Any, meta: dict) -> dict[str, Any]:
    """The Orbax items for `state`'s per-replica parts; their replica counts go into `meta`."""
    items = {}
    if state.residual is not None:
        items["residual"] = ocp.args.StandardSave(state.residual)
        meta["residual_replicas"] = _replicas(state.residual["error"])
    if state.local is not None:
        items["local"] = ocp.args.StandardSave(state.local)
        meta["local_groups"] = _replicas(state.local["params"])  # the replicas' copies: one per dp replica
    return items


def restore(manager: Any, step: int, trainer: Any, saved: Config, cfg: Config, meta: dict, params: Any,
            warn: Callable[[str], None]) -> tuple[Any, Any]:
    """(residual, local) for `trainer`'s state: as saved, or afresh where the run saved none or other replicas."""
    from pjax.step import fresh_local, fresh_residual

    target = trainer.abstract_state()
    residual = local = None
    if target.residual is not None:
        same = (saved.train.grad_compression, saved.train.compression_rank, saved.train.zero,
                meta.get("residual_replicas")) == (cfg.train.grad_compression, cfg.train.compression_rank,
                                                   cfg.train.zero, _replicas(target.residual["error"]))
        if same:
            residual = _read(manager, step, "residual", target.residual)
        else:
            warn(f"train.grad_compression={cfg.train.grad_compression}: the error-feedback residual starts at zero "
                 f"(step {step} was saved without one, or with other data replicas).")
            residual = fresh_residual(trainer)
    if target.local is not None:
        replicas = _replicas(target.local["params"])
        saved_groups = saved.train.diloco_groups or meta.get("local_groups")  # null: one group per replica
        if (meta.get("local_groups"), saved_groups) == (replicas, cfg.train.diloco_groups or replicas):
            local = _read(manager, step, "local", target.local)
        else:
            warn(f"train.local_steps={cfg.train.local_steps}: every DiLoCo group starts from the global parameters "
                 f"(step {step} was saved without groups, or with other replicas or groups).")
            local = fresh_local(trainer, params)
    return residual, local


def _read(manager: Any, step: int, item: str, target: Any) -> Any:
    return manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(target)}))[item]


def _replicas(tree: Any) -> int:
    return int(jax.tree.leaves(tree)[0].shape[0])
