"""models/remat.py: `train.remat=names` keeps exactly the named activations, whichever form computes
the layer (plain projections, sequence parallelism's and the zero-bubble taps' custom_vjps, layers
unrolled or as a pipeline stage's list). The step under the layer scan is in tests/test_step.py.
"""
import re

import jax
import jax.numpy as jnp
import pytest

from mesh import MeshConfig, make_mesh
from models import deferred_grads, llama
from models.config import LlamaConfig
from models.precision import Precision
from models.remat import NAMES, policy

CFG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)
B, T = 2, 8


def saved_names(capsys, fn, *args) -> list[str]:
    """The names of the residuals `fn`'s backward keeps (jax.ad_checkpoint.print_saved_residuals)."""
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return re.findall(r"named '(\w+)'", capsys.readouterr().out)


@pytest.mark.parametrize("path", ["unrolled", "stage_list", "sequence_parallel", "deferred_taps"])
def test_names_policy_keeps_exactly_the_named_activations(capsys, path):
    """Unrolled layers (a pipeline stage passes them as a list), tp=2 sequence parallelism and the
    taps all keep the chosen names, once per layer, and nothing else named."""
    names = ("attn_norm", "k_proj", "attn_out", "o_proj", "up_proj")
    params = llama.init_params(CFG, jax.random.key(0))["layers"]
    x = jax.random.normal(jax.random.key(1), (B * T, CFG.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    layers = [jax.tree.map(lambda a: a[i], params) for i in range(2)] if path == "stage_list" else params
    taps = deferred_grads.layer_taps(CFG, 2, B * T, Precision()) if path == "deferred_taps" else None
    sp = path == "sequence_parallel"

    def loss(layers, x):
        y, _ = llama.run_layers(layers, x, positions, CFG, remat="names", remat_names=names, scan=False,
                                sequence_parallel=sp, taps=taps)
        return jnp.sum(y)

    with jax.set_mesh(make_mesh(MeshConfig(dp=1, tp=2 if sp else 1), jax.devices()[:2 if sp else 1])):
        found = saved_names(capsys, loss, layers, x)
    assert sorted(found) == sorted(names * 2), found


def test_every_name_is_tagged_by_the_layer(capsys):
    params = llama.init_params(CFG, jax.random.key(0))["layers"]
    x = jnp.ones((B * T, CFG.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    loss = lambda p, x: jnp.sum(llama.run_layers(p, x, positions, CFG, remat="names", remat_names=tuple(NAMES),
                                                 scan=False)[0])
    assert sorted(saved_names(capsys, loss, params, x)) == sorted(list(NAMES) * 2)


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown remat names"):
        policy("names", ["q"])
