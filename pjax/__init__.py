"""pjax: 4D-parallel (dp, pp, cp, tp) LLaMA training in JAX/XLA."""
from __future__ import annotations

from typing import Any

__all__ = ["ConfigError"]


def __getattr__(name: str) -> Any:
    # Lazy: `python -m pjax.train` imports this package before its own first line, and that line
    # may restart the process (pjax.malloc) before JAX is imported.
    if name == "ConfigError":
        from mesh.errors import ConfigError

        return ConfigError
    raise AttributeError(f"module 'pjax' has no attribute {name!r}")
