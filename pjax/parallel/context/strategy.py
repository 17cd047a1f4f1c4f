"""`context.strategy`: how attention spans the cp split (ARCHITECTURE.md, "Three context-parallel strategies
on one layout"). The strategies import nothing of it."""
from __future__ import annotations

import dataclasses
from typing import Any

from mesh.errors import ConfigError, require_choice
from models.attention import AttentionFn
from pjax.parallel.context.all_gather import all_gather_attention
from pjax.parallel.context.ring import ring_attention
from pjax.parallel.context.ulysses import ulysses_attention, validate_heads


STRATEGIES = ("ring", "all_gather", "ulysses")


@dataclasses.dataclass(frozen=True)
class ContextConfig:
    """The config's `context.*` keys: how attention spans a sequence split over mesh.cp."""

    strategy: str = "ring"

    def __post_init__(self) -> None:
        require_choice("context.strategy", self.strategy, STRATEGIES)


def check_run(run) -> None:
    """The `context.*` keys against the mesh, model and attention kernel of `run` (a `pjax.validate.Run`)."""
    mc, strategy, attention = run.mesh, run.context.strategy, run.train.attention
    if mc.cp == 1:
        return
    validate_strategy(strategy, mc, run.model.num_attention_heads, run.model.num_key_value_heads)
    if strategy != "ulysses" and attention != "auto":
        raise ConfigError(f"train.attention={attention} has no effect with mesh.cp={mc.cp} and context.strategy="
                          f"{strategy} (its own online softmax); leave train.attention=auto, or use "
                          f"context.strategy=ulysses.")


def validate_strategy(strategy: str, mc: Any, num_heads: int, kv_heads: int) -> None:
    """A one-line ConfigError unless `strategy` works on mesh `mc` (a MeshConfig) with these heads."""
    if strategy == "ulysses":
        validate_heads(num_heads, kv_heads, mc.cp, mc.tp)


def context_attention(strategy: str, local: AttentionFn) -> AttentionFn:
    """The `AttentionFn` of `strategy` for zigzag cp-split sequences; 'ulysses' runs `local` on its heads."""
    if strategy == "ring":
        return ring_attention()
    if strategy == "all_gather":
        return all_gather_attention()
    if strategy == "ulysses":
        return ulysses_attention(local)
    raise ConfigError(f"context.strategy={strategy!r} is unknown; choose ring, all_gather or ulysses.")
