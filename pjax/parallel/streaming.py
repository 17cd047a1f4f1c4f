"""Streaming DiLoCo (Douillard et al., 2025): DiLoCo whose groups synchronise one fragment of the model at a time,
in turn, each fragment's average landing `train.diloco_overlap` (tau) inner steps after it was sent.

A fragment is every P-th slice (P = `train.diloco_fragments`) along each parameter's leading axis: of the layer
stack [layers, ...], the model's layers f, f + P, f + 2P, ... (the paper's strided fragments; where a pipeline
stores its layers in another order, each run of P stored rows holds one of each fragment, `layer_columns`); of the
embedding, rows f, f + P, ...; so each fragment holds 1/P of every parameter, and an outer step moves 1/P of
DiLoCo's bytes, the same layers on every layout. With H = `train.local_steps` and K = H / P, fragment f is sent
after step n when n % K = 0 and f = (n / K - 1) mod P, so each fragment is sent once every H steps, the last one
at DiLoCo's steps.

A send snapshots the groups' copies of the fragment (`TrainState.local['inflight']`, [groups, ...] of 1/P of the
model) and goes on training. tau steps later the snapshot arrives: its mean over the groups is averaged (the
all-reduce over dp, in the fragment's payload with `train.grad_compression`; PowerSGD keeps a warm-start Q per
fragment, `feedback`), the outer Nesterov step moves the global fragment along (global - mean), and every group
takes the result, keeping `train.diloco_mix` (alpha) of its own: fragment <- alpha * own + (1 - alpha) * global.
The arrival step's branch holds both that step's inner step and the reduction of the snapshot, which depends on
nothing the inner step computes; kept apart from the inner step's own sums (`overlap`), it runs during the inner
step on XLA:GPU (tests/test_gpu_target.py). With tau = 0 the fragment is averaged right after the step that sends
it, as DiLoCo does; with P = 1, tau = 0 and alpha = 0 this is DiLoCo, bit for bit (tests/test_streaming_diloco.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from mesh.errors import ConfigError
from pjax.parallel import outer, overlap
from pjax.parallel.pipeline.layout import layer_order


def layer_columns(num_layers: int, parts: int, pp: int = 1, v: int = 1, vshape: bool = False) -> np.ndarray | None:
    """[parts, layers / parts]: in each run of `parts` stored rows of the layer stack, the column holding the
    model's layer of fragment f (layers f, f + parts, ...); None where that is column f (the model's order, and
    every one-chunk pipeline). Raises ValueError where a run of rows holds two layers of one fragment."""
    residues = layer_order(num_layers, pp, v, vshape).reshape(-1, parts) % parts
    if (residues == np.arange(parts)).all():
        return None
    if (np.sort(residues, axis=1) != np.arange(parts)).any():
        raise ValueError("a run of stored rows holds two layers of one fragment")
    return np.argsort(residues, axis=1).T


def check_run(run: Any) -> None:
    """One line where streaming DiLoCo's fragments or overlap do not fit the run."""
    tc, mesh, cfg = run.train, run.mesh, run.model
    if not tc.local_steps or (tc.diloco_fragments, tc.diloco_overlap) == (1, 0):
        return  # train.diloco_mix alone: DiLoCo with the groups' copies mixed at each synchronisation
    parts, tau, h = tc.diloco_fragments, tc.diloco_overlap, tc.local_steps
    head = f"train.diloco_fragments={parts} (streaming DiLoCo)"
    if h % parts:
        raise ConfigError(f"{head} needs train.local_steps={h} to divide by {parts}: use a divisor of {h} (one "
                          f"fragment is sent every local_steps / fragments steps).")
    if tau >= h // parts:
        raise ConfigError(f"train.diloco_overlap={tau} must land before the next fragment is sent, "
                          f"{h // parts} steps later: use an overlap below {h // parts}.")
    sizes = {"model.num_hidden_layers": (cfg.num_hidden_layers, parts * mesh.pp),
             "the padded vocabulary": (cfg.padded_vocab_size, parts * mesh.tp),
             "model.hidden_size": (cfg.hidden_size, parts)}
    for what, (size, by) in sizes.items():
        if size % by:
            raise ConfigError(f"{head}: {what} ({size}) does not divide by {by} (fragments x the mesh axis that "
                              f"splits it); change train.diloco_fragments.")
    try:
        layer_columns(cfg.num_hidden_layers, parts, mesh.pp, run.pipeline.virtual_stages, run.pipeline.vshape)
    except ValueError:
        chunk = cfg.num_hidden_layers // (mesh.pp * run.pipeline.virtual_stages)
        raise ConfigError(f"{head} with pipeline.schedule={run.pipeline.schedule}: use fragments that divide the "
                          f"{chunk} layer(s) of a stage chunk, or more layers (docs/outer_loops.md).") from None
    if tc.steps < h + tau:
        raise ConfigError(f"{head} first lands its last fragment at step {h + tau}, after train.steps={tc.steps}: "
                          f"set train.steps >= {h + tau}, or the export holds initial parameters.")


def _picked(x: jax.Array, f: jax.Array, parts: int, axis: int, columns: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """x viewed as [..., rows, parts, ...] along `axis`, and the mask of fragment f's column in each row (local to
    each device's rows: no gather along a split axis)."""
    shape = x.shape
    view = x.reshape(*shape[:axis], shape[axis] // parts, parts, *shape[axis + 1:])
    column = jnp.asarray(columns, jnp.int32)[f]  # [rows]
    hit = column[:, None] == jnp.arange(parts, dtype=jnp.int32)[None, :]
    return view, hit.reshape(*(1,) * axis, *hit.shape, *(1,) * (x.ndim - axis - 1))


def fragment(x: jax.Array, f: jax.Array, parts: int, axis: int = 0, columns: np.ndarray | None = None) -> jax.Array:
    """Slices f, f + parts, ... of `x` along `axis`; with `columns` (`layer_columns`), row r's column columns[f, r]."""
    if columns is not None:
        view, hit = _picked(x, f, parts, axis, columns)
        return jnp.sum(jnp.where(hit, view, jnp.zeros((), x.dtype)), axis=axis + 1)  # one term per row: exact
    shape = x.shape
    view = x.reshape(*shape[:axis], shape[axis] // parts, parts, *shape[axis + 1:])
    return lax.dynamic_index_in_dim(view, f, axis + 1, keepdims=False)


def with_fragment(x: jax.Array, part: jax.Array, f: jax.Array, parts: int, axis: int = 0,
                  columns: np.ndarray | None = None) -> jax.Array:
    """`x` with its fragment f (`fragment`) replaced by `part`."""
    shape = x.shape
    if columns is not None:
        view, hit = _picked(x, f, parts, axis, columns)
        return jnp.where(hit, jnp.expand_dims(part.astype(x.dtype), axis + 1), view).reshape(shape)
    view = x.reshape(*shape[:axis], shape[axis] // parts, parts, *shape[axis + 1:])
    return lax.dynamic_update_index_in_dim(view, part.astype(x.dtype), f, axis + 1).reshape(shape)


@dataclasses.dataclass(frozen=True)
class StreamingDiLoCo(outer.DiLoCo):
    """DiLoCo's step with fragments (`train.diloco_fragments`), overlap and mixing."""

    columns: tuple | None = None  # `layer_columns` of the stored layer stack, as nested tuples

    @property
    def parts(self) -> int:
        return self.tc.diloco_fragments

    def _cut(self, tree: Any) -> Any:
        """A tree shaped like `tree` (the parameters, or their [groups, ...] stack): 1 at the layer stack's
        leaves (cut by `columns`), 0 elsewhere (strided)."""
        return jax.tree_util.tree_map_with_path(lambda path, _: int(getattr(path[0], "key", None) == "layers"), tree)

    def _columns(self, kind: int) -> np.ndarray | None:
        """The column table a leaf of `kind` (`_cut`) is cut by: the layer stack's, or None (strided)."""
        return np.asarray(self.columns) if kind == 1 and self.columns is not None else None

    @property
    def period(self) -> int:
        """K: steps from one fragment's send to the next's."""
        return self.tc.local_steps // self.parts

    def sent(self, n: jax.Array) -> jax.Array:
        """The fragment sent after step n (meaningful where n % K == 0)."""
        return (n // self.period - 1) % self.parts

    def fresh(self, params: Any, groups: int, step: int = 0) -> Any:
        """Every group at `params`, a fresh inner state, and (with an overlap) the fragment last sent by `step`
        cut from them: a landing before the next send then moves the global fragment by its momentum alone."""
        local = super().fresh(params, groups)
        return self.with_inflight(local, step) if self.tc.diloco_overlap else local

    def with_inflight(self, local: Any, step: int) -> Any:
        """`local` with the fragment last sent by `step` cut afresh from the groups' copies."""
        last = jnp.asarray(step) // self.period * self.period
        return {**local, "inflight": self.slices(self.whole(local["params"]), self.sent(last))}

    def step(self, state: Any, batch: Any) -> tuple[Any, dict]:
        """One inner step in every group; a fragment sent after every K-th, landing tau steps later."""
        n = state.step + 1
        if not self.tc.diloco_overlap:
            local, metrics = self.inner_round(state, batch)
            arrive = lambda p, o, lc, r: self.arrive(p, o, lc, r, self.sent(n), None)  # noqa: E731
            params, opt_state, local, residual = lax.cond(n % self.period == 0, arrive, lambda *a: a, state.params,
                                                          state.opt_state, local, state.residual)
        else:
            lands = (n % self.period == self.tc.diloco_overlap) & (n > self.period)
            params, opt_state, local, residual, metrics = lax.cond(lands, self._landing_step, self._plain_step,
                                                                   state, batch)
            sending = lambda lc: {**lc, "inflight": self.slices(self.whole(lc["params"]), self.sent(n))}  # noqa: E731
            local = lax.cond(n % self.period == 0, sending, lambda lc: lc, local)
        return state._replace(step=n, params=params, opt_state=opt_state, local=local, residual=residual), metrics

    def _plain_step(self, state: Any, batch: Any) -> tuple[Any, ...]:
        local, metrics = self.inner_round(state, batch)
        return state.params, state.opt_state, local, state.residual, metrics

    def _landing_step(self, state: Any, batch: Any) -> tuple[Any, ...]:
        """The inner step and, alongside it, the outer step of the fragment sent tau steps ago."""
        f = self.sent(state.step + 1 - self.tc.diloco_overlap)
        params, opt_state, residual, landed = self.outer_fragment(state.params, state.opt_state, state.residual,
                                                                  state.local["inflight"], f)
        with overlap.after(overlap.anchor_of(landed)):  # its reductions apart from the inner step's
            local, metrics = self.inner_round(state, batch)
        return params, opt_state, self.merge(local, landed, f), residual, metrics

    def slices(self, stacked: Any, f: jax.Array) -> Any:
        """Fragment f of every group's copy ([groups, ...] leaves)."""
        return jax.tree.map(lambda x, k: fragment(x, f, self.parts, 1, self._columns(k)), stacked, self._cut(stacked))

    def arrive(self, params: Any, opt_state: Any, local: Any, residual: Any, f: jax.Array, sent: Any
               ) -> tuple[Any, ...]:
        """Fragment f's outer step from `sent` (None: the groups' copies now) and every group's copy merged."""
        sent = self.slices(self.whole(local["params"]), f) if sent is None else sent
        params, opt_state, residual, landed = self.outer_fragment(params, opt_state, residual, sent, f)
        return params, opt_state, self.merge(local, landed, f), residual

    def outer_fragment(self, params: Any, opt_state: Any, residual: Any, sent: Any, f: jax.Array
                       ) -> tuple[Any, ...]:
        """The outer step of fragment f of the global parameters from the groups' copies `sent`: (params,
        opt_state, residual, the new global fragment)."""
        kinds, parts = self._cut(params), self.parts
        part = lambda x, k: fragment(x, f, parts, 0, self._columns(k))  # noqa: E731
        mine = jax.tree.map(part, params, kinds)
        state = optax.tree_map_params(self.outer, part, opt_state, kinds)
        if residual is None:
            average = jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32), axis=0), sent)
            mine, state = outer.outer_step(self.outer, mine, state, average)
        else:
            delta, r = self.compressed_delta(mine, sent, self._feedback(residual, f, kinds))
            mine, state = outer.outer_update(self.outer, mine, state, delta)
            residual = self._feedback(residual, f, kinds, r)
        put = lambda x, y, k: with_fragment(x, y, f, parts, 0, self._columns(k))  # noqa: E731
        params = jax.tree.map(put, params, mine, kinds)
        # Each leaf of the outer state: its parameter's kind, or -1 where it is none (a step count).
        state_kinds = optax.tree_map_params(self.outer, lambda _, k: k, opt_state, kinds,
                                            transform_non_params=lambda _: -1)
        opt_state = jax.tree.map(lambda x, y, k: put(x, y, k) if k >= 0 else y, opt_state, state, state_kinds)
        return params, opt_state, residual, mine

    def _feedback(self, residual: Any, f: jax.Array, kinds: Any, new: Any = None) -> Any:
        """Fragment f's error feedback (`feedback`): its slices of every replica's residual and, with PowerSGD,
        its warm-start Qs; with `new`, `residual` with fragment f's replaced by it."""
        def error(x: jax.Array, kind: int, y: jax.Array | None = None, axis: int = 1) -> jax.Array:
            if kind == 1 and x.ndim == 2:  # an expert's placeholder [replicas, 1]: its average travels exact
                return x if y is None else y
            if y is None:
                return fragment(x, f, self.parts, axis, self._columns(kind))
            return with_fragment(x, y, f, self.parts, axis, self._columns(kind))

        def q(x: jax.Array, kind: int, y: jax.Array | None = None) -> jax.Array:
            if x.ndim == 2 or (kind == 0 and self.parts == 1):  # a vector's placeholder; one fragment's whole Q
                return x if y is None else y
            if kind == 1:  # [replicas, tp, layers, ...]: a layer's Q goes with its layer
                return error(x, kind, y, axis=2)
            # The embedding's and the head's [replicas, tp, P, ...]: every fragment keeps its own.
            if y is None:
                return lax.dynamic_index_in_dim(x, f, 2, keepdims=False)
            return lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), f, 2)

        parts = {"error": error, "q": q}
        if new is None:
            return {k: jax.tree.map(parts[k], v, kinds) for k, v in residual.items()}
        return {k: jax.tree.map(parts[k], v, kinds, new[k]) for k, v in residual.items()}

    def merge(self, local: Any, landed: Any, f: jax.Array) -> Any:
        """Every group's fragment f <- alpha * its own + (1 - alpha) * the landed global fragment."""
        alpha = self.tc.diloco_mix

        def one(stacked: jax.Array, new: jax.Array, kind: int) -> jax.Array:
            own = fragment(stacked, f, self.parts, 1, self._columns(kind))
            mixed = jnp.broadcast_to(new, own.shape) if not alpha else alpha * own + (1 - alpha) * new[None]
            return with_fragment(stacked, mixed, f, self.parts, 1, self._columns(kind))

        whole = jax.tree.map(one, self.whole(local["params"]), landed, self._cut(landed))
        return {**local, "params": self.chunks(whole)}


def diloco_for(strategy: Any, inner: optax.GradientTransformation, outer_opt: optax.GradientTransformation,
               tc: Any, pp: int = 1) -> outer.DiLoCo:
    """DiLoCo, or its streaming form where `train.diloco_fragments` > 1, `train.diloco_overlap` > 0 or
    `train.diloco_mix` > 0 (its fragments cut from the layer stack a pipeline of `pp` stages stores)."""
    if (tc.diloco_fragments, tc.diloco_overlap, tc.diloco_mix) == (1, 0, 0):
        return outer.DiLoCo(strategy, inner, outer_opt, tc)
    pipeline = getattr(strategy, "pipeline", None)
    v, vshape = (pipeline.virtual_stages, pipeline.vshape) if pipeline is not None and pp > 1 else (1, False)
    columns = layer_columns(strategy.spec.cfg.num_hidden_layers, tc.diloco_fragments, pp, v, vshape)
    return StreamingDiLoCo(strategy, inner, outer_opt, tc,
                           None if columns is None else tuple(map(tuple, columns.tolist())))
