"""AdamW with linear warmup and cosine decay, global-norm clipping, no decay on norm scales."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from pjax.config import TrainConfig

# Decaying norm scales shrinks the signal, not the complexity (LLaMA/GPT recipes decay matrices only).
_NO_DECAY = {"attn_norm", "mlp_norm", "q_norm", "k_norm", "scale", "bq", "bk", "bv", "router_bias"}


def schedule_length(tc: TrainConfig) -> int:
    """The schedule's length in steps: train.schedule_steps, else train.steps."""
    return tc.schedule_steps or tc.steps


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine to `lr * min_lr_ratio` at the schedule's end, flat after it."""
    steps = schedule_length(tc)
    warmup = min(tc.warmup_steps, max(steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.lr, warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1), end_value=tc.lr * tc.min_lr_ratio)


def schedule_count(opt_state: Any) -> jax.Array:
    """Updates the optimizer has applied (a skipped step leaves it unchanged): where the schedule stands."""
    is_count = lambda x: isinstance(x, optax.ScaleByScheduleState)
    return next(x.count for x in jax.tree.leaves(opt_state, is_leaf=is_count) if is_count(x))


def _decay_mask(params):
    def keep(path, _):
        return getattr(path[-1], "key", None) not in _NO_DECAY
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(tc: TrainConfig, state_dtype: Any = jnp.float32, clipped_before: bool = False
                   ) -> optax.GradientTransformation:
    """Clip (if `grad_clip` > 0), then AdamW on the schedule, moments in `state_dtype` (`precision.optimizer_state`).
    `clipped_before`: the caller clips by a norm the update cannot see (DiLoCo under ZeRO: its group's, of which
    it updates a chunk), and the clip node is an identity, keeping the state's tree."""
    adamw = optax.adamw(lr_schedule(tc), b1=tc.beta1, b2=tc.beta2, eps=tc.eps,
                        weight_decay=tc.weight_decay, mask=_decay_mask)
    if tc.grad_clip > 0:
        adamw = optax.chain(optax.identity() if clipped_before else optax.clip_by_global_norm(tc.grad_clip), adamw)
    return stored_in(adamw, state_dtype)


def stored_in(inner: optax.GradientTransformation, dtype: Any) -> optax.GradientTransformation:
    """`inner` with its floating-point state kept in `dtype` between steps, updated in fp32 and rounded to
    nearest once per step (ARCHITECTURE.md, "Precision as a policy", says what that loses)."""
    if jnp.dtype(dtype) == jnp.float32:
        return inner

    def cast(tree: Any, to: Any) -> Any:
        return jax.tree.map(lambda a: a.astype(to) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)
