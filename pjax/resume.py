"""How a training run takes up its checkpoint directory: open it, find where to continue, keep the plan.

`open_run(cfg)` runs before any work: it opens checkpoint.dir, refuses a directory that this run
cannot continue (another model, or checkpoint.resume=false over old steps), reads the config of
the newest readable step (a corrupt one is passed over with a warning, `Checkpointer.readable`),
and resolves the learning-rate schedule's length (`continue_schedule`): a resumed run keeps the
schedule it was saved with, so "train 5 steps, then continue to 10" is one run.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import NamedTuple

import jax

from mesh.errors import ConfigError
from pjax.checkpoint import Checkpointer, check_compatible
from pjax.config import Config
from pjax.config_io import dump_config
from pjax.parallel.pipeline.layout import layer_order


class RunCheckpoints(NamedTuple):
    ckpt: Checkpointer | None  # None without checkpoint.dir
    cfg: Config  # the run's config, train.schedule_steps resolved
    note: str | None  # a line for the user when the schedule is not train.steps long


def open_run(cfg: Config) -> RunCheckpoints:
    """The run's Checkpointer and its config, checked against what checkpoint.dir holds."""
    ckpt = open_for_run(cfg)
    try:
        saved = None
        if ckpt is not None and ckpt.latest_step() is not None:
            step, saved = ckpt.readable(ckpt.read_config)
            check_compatible(saved, cfg, f"{ckpt.directory}/{step}")
        cfg, note = continue_schedule(cfg, saved)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
    return RunCheckpoints(ckpt, cfg, note)


def open_for_run(cfg: Config) -> Checkpointer | None:
    """The training run's Checkpointer (None without checkpoint.dir), checked against the run: a
    directory that cannot be continued (another model, or checkpoint.resume=false over old steps)
    is a one-line error before any work."""
    cc = cfg.checkpoint
    if cc.dir is None:
        return None
    pp, v, layers = cfg.mesh.pp, cfg.pipeline.virtual_stages, cfg.model.num_hidden_layers
    # A pipeline with v chunks keeps its layer stack in pipeline order (checkpoints hold model order).
    rows = layer_order(layers, pp, v, cfg.pipeline.vshape) if pp > 1 and layers % (pp * v) == 0 else None
    ckpt = Checkpointer(cc.dir, every=cc.every, keep=cc.keep, layer_rows=rows)
    try:
        latest = ckpt.latest_step()
        if latest is not None and not cc.resume:  # two runs' checkpoints in one directory would mix
            raise ConfigError(f"checkpoint.dir={cc.dir} already holds checkpoints (latest step {latest}) and "
                              f"checkpoint.resume=false; point checkpoint.dir at a new directory or resume.")
    except ConfigError:
        ckpt.close()
        raise
    return ckpt


def continue_schedule(cfg: Config, saved: Config | None) -> tuple[Config, str | None]:
    """`cfg` with train.schedule_steps resolved, and a line to tell the user when it differs from
    train.steps: set by the user, it stands; else a resumed run keeps the schedule it was saved
    with (its warm-up and cosine are functions of that length, so changing train.steps alone
    must not bend the steps already planned); else it is train.steps."""
    tc = cfg.train
    length = tc.schedule_steps or (saved.train.schedule_steps or saved.train.steps if saved else tc.steps)
    note = None
    if tc.schedule_steps is None and length != tc.steps:
        after = f"; steps past {length} run at its final learning rate" if tc.steps > length else ""
        note = (f"train.steps={tc.steps}, but the checkpoint's learning-rate schedule spans {length} steps: keeping "
                f"it{after}. Set train.schedule_steps to choose another.")
    return dataclasses.replace(cfg, train=dataclasses.replace(tc, schedule_steps=length)), note


def write_config(cfg: Config, directory: str) -> None:
    """`directory`/config.yaml: the resolved config, which `load_config` reads back (process 0 writes)."""
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        Path(directory, "config.yaml").write_text(dump_config(cfg))
