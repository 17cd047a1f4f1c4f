"""How a training run takes up its checkpoint directory before any work: open it, refuse one it cannot
continue, keep the saved schedule's length ("train 5 steps, then continue to 10" is one run)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import NamedTuple

import jax

from mesh.errors import ConfigError
from pjax.checkpoint.checkpointer import Checkpointer, check_compatible
from pjax.config import Config
from pjax.config_io import dump_config
from pjax.parallel.pipeline.layout import layer_order


class RunCheckpoints(NamedTuple):
    ckpt: Checkpointer | None
    cfg: Config  # train.schedule_steps resolved
    note: str | None  # when the schedule is not train.steps long, or the moments change dtype


def open_run(cfg: Config) -> RunCheckpoints:
    """The run's Checkpointer and its config, checked against what checkpoint.dir holds."""
    ckpt = open_for_run(cfg)
    try:
        saved = None
        if ckpt is not None and ckpt.latest_step() is not None:
            step, saved = ckpt.readable(ckpt.read_config)
            check_compatible(saved, cfg, f"step {step}")
        cfg, note = continue_schedule(cfg, saved)
        note = "\n".join(n for n in (note, moments_note(cfg, saved)) if n) or None
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
    return RunCheckpoints(ckpt, cfg, note)


def open_for_run(cfg: Config) -> Checkpointer | None:
    """The training run's Checkpointer (None without checkpoint.dir)."""
    cc = cfg.checkpoint
    if cc.dir is None:
        return None
    pp, v, layers = cfg.mesh.pp, cfg.pipeline.virtual_stages, cfg.model.num_hidden_layers
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
    """`cfg` with train.schedule_steps resolved (the user's, else the checkpoint's, else train.steps), and a
    line when it differs from train.steps (ARCHITECTURE.md, "The schedule's length is saved")."""
    tc = cfg.train
    length = tc.schedule_steps or (saved.train.schedule_steps or saved.train.steps if saved else tc.steps)
    note = None
    if tc.schedule_steps is None and length != tc.steps:
        after = f"; steps past {length} run at its final learning rate" if tc.steps > length else ""
        note = (f"train.steps={tc.steps}, but the checkpoint's learning-rate schedule spans {length} steps: keeping "
                f"it{after}. Set train.schedule_steps to choose another.")
    return dataclasses.replace(cfg, train=dataclasses.replace(tc, schedule_steps=length)), note


def moments_note(cfg: Config, saved: Config | None) -> str | None:
    """A line when the checkpoint's AdamW moments are in another dtype than precision.optimizer_state:
    the restore converts them (to bf16: rounded to nearest)."""
    if saved is None:
        return None
    ours = cfg.precision.resolve(cfg.train.dtype).optimizer_state
    theirs = saved.precision.resolve(saved.train.dtype).optimizer_state
    if ours == theirs:
        return None
    return (f"the checkpoint keeps the optimizer moments in {theirs.name} and this run in {ours.name} "
            f"(precision.optimizer_state): converting them as they are restored.")


def write_config(cfg: Config, directory: str) -> None:
    """`directory`/config.yaml: the resolved config, which `load_config` reads back."""
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        Path(directory, "config.yaml").write_text(dump_config(cfg))
