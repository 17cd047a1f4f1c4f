"""Meta-learning's data (`meta.tasks`): global batches in which each dp group's rows come from one task.

Each task is a data source read like `data.path` (its own token cache and held-out tail) with its own
`DataIterator` over its windows (seeded by `train.seed` + the task's index). At step s, group g trains on
task (g + G*s) mod T of the T tasks (G groups, T a multiple of G): every group cycles through its own T/G
tasks, and every task is seen once per T/G steps. The state is each task's position and the step."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import numpy as np
from jax.sharding import Mesh

from mesh.errors import ConfigError
from mesh.mesh import DP
from pjax.data.batches import Batch, BatchLayout, DataIterator, SequenceLayout, identity_layout, read_windows
from pjax.data.text import load_tokens, split_eval


class TaskIterator:
    """Endless, resumable global batches [grad_accum, batch_size / grad_accum, seq_len], one task per dp group."""

    def __init__(self, tasks: list[tuple[np.ndarray, np.ndarray]], seq_len: int, batch_size: int, grad_accum: int,
                 seed: int, mesh: Mesh | None, sequence_layout: SequenceLayout = identity_layout) -> None:
        self.groups = 1 if mesh is None else mesh.shape[DP]
        self.layout = BatchLayout(seq_len, batch_size, grad_accum, mesh, sequence_layout)
        self.batch_size, self.seq_len = batch_size, seq_len
        rows = batch_size // self.groups  # each group's rows per step
        self.tasks = [DataIterator(train, seq_len, rows, grad_accum, seed + i, eval_tokens=held_out)
                      for i, (train, held_out) in enumerate(tasks)]
        self.step = 0

    def assignment(self, step: int) -> list[int]:
        """The task each group trains on at `step`."""
        return [(g + self.groups * step) % len(self.tasks) for g in range(self.groups)]

    def __iter__(self) -> "TaskIterator":
        return self

    def __next__(self) -> Batch:
        parts = [read_windows(self.tasks[t].tokens, self.tasks[t].next_ids(), self.seq_len)
                 for t in self.assignment(self.step)]
        self.step += 1
        return self._place(parts)

    def _place(self, parts: list[np.ndarray]) -> Batch:
        # [grad_accum, rows, seq_len + 1] per group, side by side: group g's block of the dp-split rows.
        return self.layout.place(self.layout.local(np.concatenate(parts, axis=1)))

    def num_eval_batches(self, limit: int | None = None) -> int:
        """Whole held-out batches every task can give (at most `limit`)."""
        return min(t.num_eval_batches(limit) for t in self.tasks)

    def eval_batches(self, n: int) -> Iterator[Batch]:
        """Held-out batches, group g's rows from task (g + G*k) mod T in the k-th: the tasks in turn."""
        for k in range(self.num_eval_batches(n)):
            parts = []
            for t in self.assignment(k):
                task = self.tasks[t]
                ids = np.arange(k * task.batch_size, (k + 1) * task.batch_size).reshape(task.grad_accum, -1)
                parts.append(read_windows(task.eval_tokens, ids, self.seq_len))
            yield self._place(parts)

    def state(self) -> dict[str, Any]:
        return {"meta_step": self.step, "tasks": [t.state() for t in self.tasks]}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue where `state()` was taken; a ConfigError if it came from other tasks."""
        if "tasks" not in state or len(state["tasks"]) != len(self.tasks):
            raise ConfigError(f"the checkpoint's data position is not one of {len(self.tasks)} meta.tasks; resume "
                              f"with the tasks it was saved with, or start afresh.")
        for task, saved in zip(self.tasks, state["tasks"]):
            task.restore(saved)
        self.step = int(state["meta_step"])


def check_reads(data_cfg: Any) -> None:
    """One line unless the tasks can be read as meta-learning reads them: whole, in windows of train.seq_len."""
    if data_cfg.streaming or data_cfg.curriculum:
        raise ConfigError("meta.tasks are read whole, in windows of train.seq_len: set data.streaming=false and "
                          "data.curriculum=null.")


def build_tasks(data_cfg: Any, tasks: tuple[str, ...], train_cfg: Any, mesh: Mesh | None, tokenizer: Any,
                sequence_layout: SequenceLayout = identity_layout, field: str | None = None) -> TaskIterator:
    """A TaskIterator over `tasks`, each tokenized (and cached) like data.path, its held-out tail split off; with
    a `field` (meta.task_field) the tasks are that field's values in data.path's records, each one the records
    that hold it."""
    check_reads(data_cfg)

    def tokens(task: str) -> np.ndarray:
        if field is None:
            return load_tokens(dataclasses.replace(data_cfg, path=task), tokenizer)
        return load_tokens(data_cfg, tokenizer, where=(field, task))

    split = [split_eval(tokens(task), data_cfg.eval_fraction) for task in tasks]
    return TaskIterator(split, train_cfg.seq_len, train_cfg.batch_size, train_cfg.grad_accum, train_cfg.seed, mesh,
                        sequence_layout)
