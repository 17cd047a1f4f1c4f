"""A guard: chunked attention where cuDNN's fused attention does not compile.

On GPUs `train.attention=auto` is cuDNN's fused attention, which compiles in every layout family pjax ships
(`models.attention`: inside a data-parallel or pipeline region it runs in a region manual over every axis;
tests/test_gpu_target.py compiles each family for compile-only H100s). Should a layout, a shape or another jax
still fail in cuDNN's partitioner or kernel, only the compile shows it: `compile_step` compiles the step as
configured and, where that fails on a GPU with cuDNN's attention, rebuilds the trainer with `chunked` attention
(pure JAX, keeping for the backward what cuDNN keeps), compiles that, and returns one line naming the reason."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mesh.backend import target_backend
from mesh.errors import first_line
from pjax.config import TrainConfig


def compile_step(trainer: Any, rebuild: Callable[[TrainConfig], Any], seq_len: int | None = None
                 ) -> tuple[Any, Any, str | None]:
    """(trainer, its step compiled for `seq_len`, a warning or None); the trainer is `rebuild(tc)`'s with
    chunked attention where cuDNN's did not compile, else the one given. Any other failure is raised as it was."""
    try:
        return trainer, trainer.compile_step(batch=trainer.abstract_batch(seq_len)), None
    except Exception as error:  # noqa: BLE001 - XLA's and jax's partitioner errors have no common type
        if target_backend() != "gpu" or trainer.tc.attention not in ("auto", "cudnn"):
            raise
        try:
            chunked = rebuild(dataclasses.replace(trainer.tc, attention="chunked"))
            compiled = chunked.compile_step(batch=chunked.abstract_batch(seq_len))
        except Exception:  # noqa: BLE001 - not the attention's fault: the first error is the one to read
            raise error from None
        return chunked, compiled, (f"warning: cuDNN's attention did not compile for this layout "
                                   f"({first_line(error, 50)}); training with train.attention=chunked instead.")
