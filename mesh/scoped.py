"""A setting that holds while a block is traced: a ContextVar set for the block and restored after it (the target
backend, fp8's replica groups, a streaming landing's anchor)."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """`var` is `value` inside the block, and what it was before after it."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
