"""LLaMA in Flax, with logical axis names on every parameter, and HuggingFace import/export."""
from models.config import LlamaConfig

__all__ = ["LlamaConfig"]
