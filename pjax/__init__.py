"""pjax: 4D-parallel (dp, pp, cp, tp) LLaMA training in JAX/XLA."""
from mesh.errors import ConfigError

__all__ = ["ConfigError"]
