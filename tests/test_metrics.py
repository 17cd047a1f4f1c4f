"""Model FLOPs counted by hand: dense LLaMA, top-k MoE with its router, and capacity routing's padding;
the trainer's MFU and the planner's compute time read the same count."""
import dataclasses

import pytest

from models.moe import MoeConfig
from pjax.config_io import load_config
from pjax.observe.metrics import model_flops_per_token, routing_group_tokens
from pjax.plan.estimate import per_device, predict
from pjax.plan.layouts import Layout
from pjax.plan.profiles import PROFILES


def test_mixtral_8x7b_counts_two_experts_and_the_router():
    """d 4096, f 14336, 32 layers, vocab 32000, 32 heads / 8 kv-heads of 128, 8 experts, top-2, T 4096."""
    attention_projections = 4096 * 128 * (2 * 32 + 2 * 8)  # q, o; k, v
    two_experts = 2 * 3 * 4096 * 14336
    router = 4096 * 8
    matmul_params = 32 * (attention_projections + two_experts + router) + 4096 * 32000
    attention = 3 * 32 * 2 * 4096 * 32 * 128  # causal, counted once, forward + backward
    expected = 6 * matmul_params + attention
    assert expected == 79_712_747_520
    assert model_flops_per_token(load_config("mixtral-8x7b").model, 4096) == expected


def test_mixtral_tiny_top_k_and_capacity_padding():
    """mixtral-tiny: d 128, f 192, 2 layers, vocab 4096, 4 heads / 2 kv-heads of 32, 8 experts, top-2.
    Capacity routing at factor 1.25 on dp=4: each device routes 8 rows x 128 tokens = 256 at a time,
    each expert takes ceil(1.25 * 256 * 2 / 8) = 80, so a token pays for 8 * 80 / 256 = 2.5 experts."""
    cfg = load_config("mixtral-tiny")
    per_layer = lambda experts: 128 * 32 * 12 + experts * 3 * 128 * 192 + 128 * 8
    attention = 3 * 2 * 2 * 128 * 4 * 32
    top2 = 6 * (2 * per_layer(2) + 128 * 4096) + attention
    assert top2 == 5_713_920
    assert model_flops_per_token(cfg.model, 128, cfg.moe) == top2  # dropless: the top-k
    group = routing_group_tokens(16, 2, 128, dp=4, cp=1)
    assert group == 256
    capacity = MoeConfig(routing="capacity", capacity_factor=1.25)
    assert model_flops_per_token(cfg.model, 128, capacity, group) == 6 * (2 * per_layer(2.5) + 128 * 4096) + attention
    assert routing_group_tokens(16, 2, 128, dp=1, cp=2) == 1024  # no expert parallelism: the whole micro-batch


def test_planner_compute_time_uses_the_same_count():
    cfg = load_config("mixtral-tiny", ["moe.routing=capacity"])
    layout = Layout(dp=4, tp=2, grad_accum=2)
    profile = PROFILES["h100"]
    pred = predict(cfg, layout, profile, {}, 2**30, 0.75)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    flops = model_flops_per_token(cfg.model, 128, cfg.moe, routing_group_tokens(16, 2, 128, 4, 1)) * tokens / 8
    peak = per_device(profile, 8)[0]
    assert pred.terms["compute"] == pytest.approx(flops / (peak * profile.efficiency(cfg.model.hidden_size)))
    dense = dataclasses.replace(cfg, moe=MoeConfig())
    assert predict(dense, layout, profile, {}, 2**30, 0.75).terms["compute"] < pred.terms["compute"]
