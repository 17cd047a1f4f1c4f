"""The state kept per data replica, saved with a checkpoint: error feedback's residuals
(`train.grad_compression`) and DiLoCo's groups (`train.local_steps`). Their values belong to the replicas
that kept them: a resume with the same replicas restores them exactly, one with other replicas starts them
afresh with a warning (residuals at zero; every group at the global parameters)."""
from __future__ import annotations

from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from pjax.config import Config


def save_args(state: Any, meta: dict, rows: Any = None) -> dict[str, Any]:
    """The Orbax items for `state`'s per-replica parts; their replica counts go into `meta`, and with streaming
    DiLoCo's fragment in flight the stored layer order `rows` it was cut from (None: model order)."""
    items = {}
    if state.residual is not None:
        items["residual"] = ocp.args.StandardSave(state.residual)
        meta["residual_replicas"] = _replicas(state.residual["error"])
    if state.local is not None:
        items["local"] = ocp.args.StandardSave(state.local)
        meta["local_groups"] = _replicas(state.local["params"])  # the replicas' copies: one per dp replica
        if "inflight" in state.local:
            meta["inflight_rows"] = None if rows is None else [int(r) for r in rows]
    return items


def restore(manager: Any, step: int, trainer: Any, saved: Config, cfg: Config, meta: dict, params: Any,
            warn: Callable[[str], None], rows: Any = None) -> tuple[Any, Any, bool]:
    """(residual, local) for `trainer`'s state: as saved, or afresh where the run saved none or other replicas
    (or, with streaming DiLoCo, other fragments, or its fragment in flight in another stored layer order `rows`);
    third, whether the groups started afresh (their fragment in flight is then cut in model order)."""
    from pjax.parallel import group_zero
    from pjax.step import fresh_local, fresh_residual

    target = trainer.abstract_state()
    residual = local = None
    fresh = False
    if target.residual is not None:
        # PowerSGD's Qs of the embedding and the head are per streaming DiLoCo fragment (`feedback`).
        layout = lambda c: (c.train.grad_compression, c.train.compression_rank, c.train.zero,  # noqa: E731
                            c.train.diloco_fragments if c.train.grad_compression == "powersgd" else 1)
        same = (layout(saved), meta.get("residual_replicas")) == (layout(cfg), _replicas(target.residual["error"]))
        if same:
            residual = _read(manager, step, "residual", target.residual)
        else:
            warn(f"train.grad_compression={cfg.train.grad_compression}: the error-feedback residual starts at zero "
                 f"(step {step} was saved without one, or with other data replicas or fragments).")
            residual = fresh_residual(trainer)
    if target.local is not None:
        replicas = _replicas(target.local["params"])
        saved_groups = saved.train.diloco_groups or meta.get("local_groups")  # null: one group per replica
        streams = lambda c: (c.train.diloco_fragments, c.train.diloco_overlap)  # noqa: E731
        layout = lambda c: c.train.zero if group_zero.sharded(c.train, replicas) else 0  # noqa: E731 (chunks)
        order = None if rows is None else [int(r) for r in rows]
        same = ((meta.get("local_groups"), saved_groups) == (replicas, cfg.train.diloco_groups or replicas)
                and streams(saved) == streams(cfg) and layout(saved) == layout(cfg)
                and ("inflight" not in target.local or meta.get("inflight_rows") == order))
        if same:
            local = _read(manager, step, "local", target.local)
        else:
            warn(f"train.local_steps={cfg.train.local_steps}: every DiLoCo group starts from the global parameters "
                 f"(step {step} was saved without groups, or with other replicas, groups, fragments or ZeRO).")
            local, fresh = fresh_local(trainer, params, step), True
    return residual, local, fresh


def _read(manager: Any, step: int, item: str, target: Any) -> Any:
    return manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(target)}))[item]


def _replicas(tree: Any) -> int:
    return int(jax.tree.leaves(tree)[0].shape[0])
