"""Checkpoints on Orbax: async saves of the whole run, exact resume, restore onto any mesh.

`<checkpoint.dir>/<step>/` holds params, opt_state (tensorstore), meta and the resolved config (JSON):
loading never unpickles. ARCHITECTURE.md's checkpoint sections give the reasons."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from mesh.errors import ConfigError, first_line, listed
from mesh.mesh import PP
from models import llama
from models.config import LlamaConfig, shape_keys
from models.hf import tensor_table
from pjax.checkpoint import replicas, save_faults
from pjax.config import Config
from pjax.config_io import config_from_dict, config_to_dict
from pjax.checkpoint.dirlock import take_run_lock
from pjax.parallel.pipeline.layout import layer_order
from pjax.step import TrainState, Trainer

T = TypeVar("T")
FORMAT = 1  # bump when the items or their meaning change
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


class Restored(NamedTuple):
    """A restored run: the state on the new mesh, and where the data stream and RNG continue."""

    state: TrainState
    data: dict[str, Any]  # DataIterator.state()
    rng: jax.Array
    config: Config


class Checkpointer:
    """One run's checkpoint directory: save every `every` steps (async), keep the last `keep`, restore."""

    def __init__(self, directory: str, *, every: int = 0, keep: int = 3, layer_rows: np.ndarray | None = None,
                 read_only: bool = False, quiet: bool = False) -> None:
        self.directory = os.path.abspath(directory)
        if read_only and not os.path.isdir(self.directory):
            raise ConfigError(f"checkpoint directory {directory} does not exist; pass the checkpoint.dir of a run.")
        self.every = every
        self.keep = keep
        identity = layer_rows is None or np.array_equal(layer_rows, np.arange(len(layer_rows)))
        self._rows = None if identity else np.asarray(layer_rows)
        # Before the manager: opening the directory for writing already deletes temporary directories.
        self._lock = None if read_only else take_run_lock(self.directory, directory)
        if not read_only:  # a save that fails has already printed its writes' failures when its wait raises
            save_faults.quiet_disk_full_logs()
            save_faults.quiet_abandoned_io()
        self._in_flight: tuple[int, int] | None = None  # (step, bytes) not yet waited for
        # Orbax's own read_only mode only adds warnings.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                               cleanup_tmp_directories=not read_only, create=not read_only)
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except BaseException:
            self._release()
            raise
        self.last_saved = self._manager.latest_step()
        self.unreadable: list[int] = []
        self.quiet = quiet  # a first look that a second, warning one will repeat

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def latest_step(self) -> int | None:
        """The newest complete step (a save still in flight or killed half-way does not count)."""
        return self._manager.latest_step()

    def resolve_step(self, step: int | None = None) -> int:
        """`step` if it was saved, else the latest; a ConfigError when there is none."""
        steps = self._manager.all_steps()
        if not steps:
            raise ConfigError(f"{self.directory} holds no complete checkpoint; pass the checkpoint.dir of a run "
                              f"that saved one.")
        if step is None:
            return max(steps)
        if step not in steps:
            raise ConfigError(f"{self.directory} has no checkpoint for step {step}; saved steps: "
                              f"{listed([str(s) for s in sorted(steps)])}.")
        return step

    def readable(self, read: Callable[[int], T], step: int | None = None) -> tuple[int, T]:
        """(step, read(step)) for `step`, or else the newest readable step; any error but a ConfigError (a
        mismatch with this run) makes a step unreadable, passed over with a warning."""
        if step is not None:
            step = self.resolve_step(step)
            try:
                return step, read(step)
            except ConfigError:
                raise
            except Exception as e:
                save_faults.quiet_abandoned_io()
                raise ConfigError(f"checkpoint {self.directory}/{step} cannot be read ({first_line(e, 40)}); choose "
                                  f"another step.") from None
        newest = self.resolve_step()
        for candidate in sorted(self._manager.all_steps(), reverse=True):
            try:
                return candidate, read(candidate)
            except ConfigError:
                raise
            except Exception as e:
                save_faults.quiet_abandoned_io()
                self.unreadable.append(candidate)
                self._warn(f"checkpoint {self.directory}/{candidate} cannot be read ({first_line(e, 40)}); trying "
                           f"the step before it.")
        raise ConfigError(f"no checkpoint step in {self.directory} can be read (newest: {newest}); restore them from a "
                          f"copy, or start afresh with a new checkpoint.dir.")

    def config(self, step: int | None = None) -> Config:
        """The config a checkpoint was written under (the model shape comes from here)."""
        return self.readable(self.read_config, step)[1]

    def read_config(self, step: int) -> Config:
        """The config stored with `step` (no fallback; see `config`)."""
        saved = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return config_from_dict(saved["config"], source=f"the config stored in {self.directory}/{step}")

    def restore_params(self, shardings: Callable[[LlamaConfig], Any],
                       step: int | None = None) -> tuple[int, Config, Any]:
        """(step, its config, its parameters in model layer order), placed by `shardings(model)`."""
        def read(s: int) -> tuple[Config, Any]:
            cfg = self.read_config(s)
            target = _abstract(_param_shapes(cfg.model), shardings(cfg.model))
            params = self._manager.restore(s, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
            return cfg, params["params"]

        step, (cfg, params) = self.readable(read, step)
        return step, cfg, params

    def restore(self, trainer: Trainer, cfg: Config, step: int | None = None) -> Restored:
        """The whole training state on `trainer`'s mesh, saved under any layout of the same model and optimizer."""
        step, restored = self.readable(lambda s: self._restore(trainer, cfg, s), step)
        self.last_saved = step
        return restored

    def _restore(self, trainer: Trainer, cfg: Config, step: int) -> Restored:
        saved_cfg = self.read_config(step)
        check_compatible(saved_cfg, cfg, f"step {step}")
        target = trainer.abstract_state()
        items = self._manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target.params), opt_state=ocp.args.StandardRestore(target.opt_state),
            meta=ocp.args.JsonRestore()))
        meta = items["meta"]
        if meta.get("format") != FORMAT:
            raise ConfigError(f"{self.directory}/{step} has checkpoint format {meta.get('format')}, this pjax reads "
                              f"{FORMAT}; start afresh with checkpoint.resume=false and a new checkpoint.dir.")
        residual, local, fresh = replicas.restore(self._manager, step, trainer, saved_cfg, cfg, meta,
                                                  items["params"], self._warn, self._rows)
        state = TrainState(jax.device_put(np.int32(meta["step"]), trainer.state_sharding.step),
                           items["params"], items["opt_state"], residual, local)
        if self._rows is not None:
            state = _permute_layers(state, self._rows)
            if fresh and "inflight" in state.local:  # cut from the stored rows, as the step cuts it
                recut = jax.jit(functools.partial(trainer.diloco.with_inflight, step=step),
                                out_shardings=trainer.state_sharding.local)
                state = state._replace(local=recut(state.local))
        rng = jax.random.wrap_key_data(np.asarray(meta["rng"]["key_data"], np.uint32), impl=meta["rng"]["impl"])
        return Restored(state, meta["data"], rng, saved_cfg)

    def set_aside_unreadable(self, after: int) -> None:
        """Rename the unreadable steps newer than `after` to `<step>.unreadable`, so their numbers can be saved again."""
        moved = [s for s in self.unreadable if s > after]
        if jax.process_index() == 0:
            for s in moved:
                target = Path(self.directory, f"{s}.unreadable")
                while target.exists():
                    target = target.with_name(target.name + "-again")
                os.rename(Path(self.directory, str(s)), target)
                self._warn(f"moved the unreadable checkpoint step {s} to {target}.")
        if moved:
            _sync("pjax_set_aside_unreadable")
            self._manager.reload()

    def _warn(self, text: str) -> None:
        if not self.quiet and jax.process_index() == 0:
            print(f"warning: {text}", file=sys.stderr, flush=True)

    def last_good(self) -> str | None:
        """The path of the newest step this run saved or resumed from (None before any)."""
        return None if self.last_saved is None else f"{self.directory}/{self.last_saved}"

    def due(self, step: int) -> bool:
        """Whether `checkpoint.every` asks for a save after `step`."""
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, state: TrainState, *, data: dict[str, Any], rng: jax.Array, config: Config) -> None:
        """Start an async save of everything needed to continue after `step` (once per step)."""
        if step == self.last_saved:
            return
        if self._rows is not None:
            state = _permute_layers(state, np.argsort(self._rows))
        meta = {"format": FORMAT, "step": step, "data": data,
                "rng": {"impl": str(jax.random.key_impl(rng)),
                        "key_data": np.asarray(jax.random.key_data(rng)).tolist()}}
        self._wait()  # the previous save's failure is reported as that step's
        self._in_flight = (step, sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state))))
        with self._disk_full_is_one_line():
            # force: pjax decides when to save, not Orbax's interval policy.
            per_replica = replicas.save_args(state, meta, self._rows)
            params = ocp.args.StandardSave(state.params, save_args=_per_piece(state.params, config.model))
            self._manager.save(step, force=True, args=ocp.args.Composite(
                params=params, opt_state=ocp.args.StandardSave(state.opt_state),
                meta=ocp.args.JsonSave(meta), config=ocp.args.JsonSave(config_to_dict(config)), **per_replica))
        self.last_saved = step

    def close(self) -> None:
        """Finish the save in flight, then release Orbax's threads and the directory's lock."""
        try:
            self._wait()
        finally:
            try:
                self._manager.close()
            finally:
                self._release()

    def _wait(self) -> None:
        with self._disk_full_is_one_line():
            self._manager.wait_until_finished()
        self._in_flight = None

    @contextlib.contextmanager
    def _disk_full_is_one_line(self) -> Iterator[None]:
        """A save that ran out of disk space -> one ConfigError (anything else goes on as it was)."""
        try:
            yield
        except Exception as e:
            if not save_faults.is_disk_full(e) or self._in_flight is None:
                raise
            step, size = self._in_flight
            self._in_flight = None
            raise save_faults.disk_full_error(self.directory, step, size) from None

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()


def layer_rows(trainer: Trainer) -> np.ndarray | None:
    """The model layer held by each row of `trainer`'s layer stack; None when that is model order."""
    if trainer.pipeline is None:
        return None
    return layer_order(trainer.cfg.num_hidden_layers, trainer.mesh.shape[PP], trainer.pipeline.virtual_stages,
                       trainer.pipeline.vshape)


def saving_in_progress(directory: str | Path) -> list[Path]:
    """The temporary directories of saves not yet committed (in flight, or killed half-way)."""
    return sorted(p for p in Path(directory).glob(f"*{_TMP_SUFFIX}*") if p.is_dir())


def check_compatible(saved: Config, cfg: Config, where: str) -> None:
    """A ConfigError unless `cfg` can continue a run saved under `saved` (any mesh; same model and optimizer)."""
    ours, theirs = config_to_dict(cfg), config_to_dict(saved)
    keys = (*shape_keys(cfg.model.num_local_experts), "make_vocab_size_divisible_by")
    diff = [f"model.{k}={ours['model'][k]} (checkpoint: {theirs['model'][k]})"
            for k in keys if ours["model"][k] != theirs["model"][k]]
    ours_tree, theirs_tree = _optimizer_tree(cfg), _optimizer_tree(saved)
    value = lambda c, key: getattr(getattr(c, key.split(".")[0]), key.split(".")[1])  # noqa: E731
    diff += [f"{key}={value(cfg, key)} (checkpoint: {value(saved, key)})" for key in ours_tree
             if ours_tree[key] != theirs_tree[key]]
    if diff:
        raise ConfigError(f"checkpoint {where} does not match this run: {listed(diff, 80)}; use the checkpoint's "
                          f"values, or a new checkpoint.dir.")


def _optimizer_tree(cfg: Config) -> dict[str, bool]:
    """The settings that shape the optimizer state's tree, as they shape it: DiLoCo's and Reptile's outer SGD
    replaces AdamW's state (momentum adds a trace); clipping adds a node to AdamW's, DiLoCo's inner one included."""
    reptile = cfg.meta.algorithm == "reptile"
    outer = bool(cfg.train.local_steps) or reptile
    return {"train.grad_clip": not reptile and cfg.train.grad_clip > 0, "train.local_steps": bool(cfg.train.local_steps),
            "meta.algorithm": reptile, "train.outer_momentum": outer and cfg.train.outer_momentum > 0}


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _param_shapes(cfg: LlamaConfig) -> Any:
    return jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))


def _per_piece(params: Any, model: LlamaConfig) -> Any:
    """Orbax's save args for `params`: a stacked parameter in one chunk per layer (and expert), which
    `param_reader.ParamReader` reads alone."""
    lead = {t.path: t.lead for t in tensor_table(model)}
    return jax.tree_util.tree_map_with_path(
        lambda path, _: ocp.SaveArgs(shard_axes=tuple(range(lead.get(tuple(k.key for k in path), 0)))), params)


def _abstract(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def _reorder_layers(tree: Any, rows: np.ndarray, axis: int = 0) -> Any:
    """out[i] = in[rows[i]] along `axis` of every leaf under a 'layers' key, optimizer moments included."""
    def reorder(path, x):
        return jnp.take(x, rows, axis=axis) if any(getattr(k, "key", None) == "layers" for k in path) else x
    return jax.tree_util.tree_map_with_path(reorder, tree)


def _permute_layers(state: TrainState, rows: np.ndarray) -> TrainState:
    # A gather across pp stages: jit it, keeping every leaf where it was. The feedback state's layers are axis 1
    # of its residuals ([replicas, layers, ...]) and axis 2 of PowerSGD's Q ([replicas, tp, layers, ...]);
    # DiLoCo's groups' are axis 1 ([groups, layers, ...]).
    def permute(state):
        residual = None if state.residual is None else {
            k: _reorder_layers(v, rows, axis=1 if k == "error" else 2) for k, v in state.residual.items()}
        local = None
        if state.local is not None:  # streaming DiLoCo's fragment in flight stays in its stored order (`replicas`)
            copies = {k: v for k, v in state.local.items() if k != "inflight"}
            local = {**state.local, **_reorder_layers(copies, rows, axis=1)}
        return _reorder_layers(state._replace(residual=None, local=None), rows)._replace(residual=residual,
                                                                                       local=local)

    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(permute, out_shardings=shardings)(state)
