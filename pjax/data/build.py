"""A run's data: the cached token stream and its held-out tail, or the streamed documents."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
from jax.sharding import Mesh

from pjax.config import DataConfig, TrainConfig
from pjax.data.batches import DataIterator, identity_layout
from pjax.data.stream import StreamIterator
from pjax.data.tasks import build_tasks
from pjax.data.text import documents, load_tokenizer, load_tokens, split_eval


def build_data(data_cfg: DataConfig, train_cfg: TrainConfig, mesh: Mesh | None, tasks: tuple[str, ...] = (),
               task_field: str | None = None, **iterator_kwargs: Any) -> tuple[Any, np.ndarray | None, Any]:
    """(train iterator, held-out tokens, tokenizer); extra kwargs go to the iterator (`sequence_layout`).
    With data.streaming the iterator is a StreamIterator, which reads the held-out documents (None here);
    with meta `tasks` (values of `task_field`, when given) a TaskIterator (`pjax.data.tasks`), which holds each
    task's held-out tail (None here)."""
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    if tasks:
        layout = iterator_kwargs.get("sequence_layout")
        return build_tasks(data_cfg, tasks, train_cfg, mesh, tokenizer, layout or identity_layout,
                           task_field), None, tokenizer
    if data_cfg.streaming:
        def open_documents(start: int) -> Iterator[str]:
            return documents(data_cfg.path, split=data_cfg.split, column=data_cfg.column, start=start, streaming=True)

        return StreamIterator(open_documents, tokenizer, train_cfg.seq_len, train_cfg.batch_size, train_cfg.grad_accum,
                              mesh, eval_stride=data_cfg.eval_stride, **iterator_kwargs), None, tokenizer
    train_tokens, eval_tokens = split_eval(load_tokens(data_cfg, tokenizer), data_cfg.eval_fraction)
    train_iter = DataIterator(train_tokens, train_cfg.seq_len, train_cfg.batch_size, train_cfg.grad_accum,
                              train_cfg.seed, mesh, eval_tokens=eval_tokens, **iterator_kwargs)
    return train_iter, eval_tokens, tokenizer
