"""Sequence parallelism (`train.sequence_parallel`, models/sequence_parallel.py): the same loss and
gradients as one device, no activation all-reduce left in the HLO, and less activation memory."""
import dataclasses
import re

import jax
import numpy as np
import pytest

import proofs
from mesh import ConfigError, MeshConfig, make_mesh
from pjax.observe.hlo import collective_stats, collectives_by_axis, device_groups, shape_bytes
from pjax.step import build_trainer
from test_step import CFG, TC, assert_grads_close, loss_and_grads, make_batch


@proofs.cache
def sp_trainer(dp: int = 1, tp: int = 2, sequence_parallel: bool = True, cfg=CFG, **train):
    mesh = make_mesh(MeshConfig(dp=dp, tp=tp), jax.devices()[: dp * tp])
    return build_trainer(mesh, cfg, dataclasses.replace(TC, sequence_parallel=sequence_parallel, **train))


def sp_loss_and_grads(**layout):
    tr = sp_trainer(**layout)
    params = tr.init(jax.random.key(0)).params
    batch = jax.device_put(make_batch(TC.grad_accum, TC.batch_size), tr.batch_sharding)
    loss, grads = tr.grads(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


LAYOUTS = {
    "dp2_tp4": dict(dp=2, tp=4),
    "dp2_tp2_zero1": dict(dp=2, tp=2, zero=1),
    "dp4_tp2_zero3": dict(dp=4, tp=2, zero=3),
    "tp2_remat_dots_unrolled": dict(tp=2, remat="dots", scan_layers=False),
    "tp2_remat_full_tied": dict(tp=2, remat="full", cfg=dataclasses.replace(CFG, tie_word_embeddings=True)),
    "dp2_tp2_bf16": dict(dp=2, tp=2, dtype="bfloat16"),  # the GPU default: within bf16 rounding of fp32
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sequence_parallel_loss_and_grads_equal_one_device(layout):
    kw = LAYOUTS[layout]
    ref_loss, ref_grads = (loss_and_grads(dp=1) if "cfg" not in kw else
                           sp_loss_and_grads(tp=1, sequence_parallel=False, cfg=kw["cfg"]))
    loss, grads = sp_loss_and_grads(**kw)
    bf16 = kw.get("dtype") == "bfloat16"
    # bf16 against fp32: measured 7.2e-5 (loss) and 1.2e-2 (grads); a dropped micro-batch gives 3.9e-3 and 0.5-1.0
    assert abs(loss - ref_loss) <= (1e-3 * abs(ref_loss) if bf16 else 1e-6)
    assert_grads_close(grads, ref_grads, rtol=5e-2 if bf16 else 1e-5)


@pytest.mark.proves("sp+loss_chunk")
def test_a_chunked_loss_under_sequence_parallelism_equals_one_device_and_all_reduces_no_activation():
    """dp2 x tp2, loss_chunk=16 (4 blocks of a device's 64 tokens): the blocks read the tokens gathered over tp, as
    the unchunked output layer does; the input gradient leaves as the column-parallel one does, by reduce-scatter."""
    ref_loss, ref_grads = loss_and_grads(dp=1)
    loss, grads = sp_loss_and_grads(dp=2, tp=2, loss_chunk=16)
    assert abs(loss - ref_loss) <= 1e-6
    assert_grads_close(grads, ref_grads, rtol=1e-5)
    hlo = sp_trainer(dp=2, tp=2, loss_chunk=16).compile_step().as_text()
    tokens = TC.batch_size // TC.grad_accum // 2 * TC.seq_len

    def large_tp_all_reduce(kind, line):
        if kind != "all-reduce" or sorted(map(sorted, device_groups(line, 4))) != [[0, 1], [2, 3]]:
            return None
        result = line.split("=", 1)[1].split(kind)[0]
        sizes = [shape_bytes(array) for array in re.findall(r"\w+\[[\d,]*\]", result)]
        return "large" if max(sizes, default=0) > max(tokens, CFG.hidden_size) * 4 else None

    assert "large" not in collective_stats(hlo, large_tp_all_reduce), "an activation-sized all-reduce over tp"


def test_no_activation_is_all_reduced_over_tp():
    """Each TP all-reduce became a reduce-scatter and an all-gather. Per micro-batch (m = 2) with L
    layers: reduce-scatters 2L forward (o, down) + 2L backward (the q/k/v and gate/up input
    gradients) + the embedding's + the output layer's input gradient; all-gathers 2L forward, 2L
    backward (o's and down's output gradients), 2L + 1 again for the column-parallel weight
    gradients (Megatron's re-gather: the gathered input is not kept), the output layer's forward
    and the embedding's gradient.
    What tp still all-reduces is [D]-sized norm-scale gradients and [N]-sized softmax statistics."""
    m, layers = TC.grad_accum, CFG.num_hidden_layers
    hlo = sp_trainer(dp=2, tp=4).compile_step().as_text()
    rows = collectives_by_axis(hlo, dict(dp=2, pp=1, cp=1, tp=4))
    assert rows["tp"]["kinds"]["reduce-scatter"] == m * (4 * layers + 2), rows["tp"]
    assert rows["tp"]["kinds"]["all-gather"] == m * (6 * layers + 3), rows["tp"]
    tokens = TC.batch_size // m // 2 * TC.seq_len  # a micro-batch's tokens on one dp replica
    largest = max(tokens, CFG.hidden_size) * 4

    tp_groups = [[0, 1, 2, 3], [4, 5, 6, 7]]  # tp is the innermost mesh axis

    def classify(kind, line):  # by the largest array of the result (XLA may combine several in a tuple)
        if kind != "all-reduce" or sorted(map(sorted, device_groups(line, 8))) != tp_groups:
            return None
        result = line.split("=", 1)[1].split(kind)[0]
        size = max((shape_bytes(array) for array in re.findall(r"\w+\[[\d,]*\]", result)), default=0)
        return "large" if size > largest else None

    assert "large" not in collective_stats(hlo, classify), "an activation-sized all-reduce is left"


def test_activation_memory_between_tp_regions_divides_by_tp():
    """The backward keeps each layer's input, its mid-layer residual and both norm outputs: with
    the tokens split over tp these are 1/tp of what plain TP keeps. XLA's temporaries drop by at
    least those four [N, D] tensors per layer times (1 - 1/tp)."""
    tp, layers = 4, CFG.num_hidden_layers
    plain = sp_trainer(tp=tp, sequence_parallel=False, grad_accum=1).compile_step().memory_analysis()
    split = sp_trainer(tp=tp, grad_accum=1).compile_step().memory_analysis()
    act = TC.batch_size * TC.seq_len * CFG.hidden_size * 4
    saved = plain.temp_size_in_bytes - split.temp_size_in_bytes
    assert saved >= 4 * layers * act * (1 - 1 / tp), (saved, act)


def test_sequence_parallel_layouts_that_do_not_split_are_config_errors():
    mesh = make_mesh(MeshConfig(tp=4), jax.devices()[:4])
    odd = dataclasses.replace(TC, sequence_parallel=True, seq_len=6, batch_size=2, grad_accum=2)
    with pytest.raises(ConfigError, match=r"a device's 6 tokens per micro-batch over mesh.tp=4"):
        build_trainer(mesh, CFG, odd)

