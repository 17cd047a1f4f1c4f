"""A run fitted to a model it did not define: the shape from the checkpoint, a mesh that splits it.

`pjax.eval --hf/--checkpoint` and `pjax.train train.init_from=DIR` run a model whose shape comes
from a checkpoint, not from the config. The config still has a model and a mesh (the default
config's tiny LLaMA on tp=2), and neither was the user's choice. So:

* `adopt_hf_model`: with train.init_from, every model key comes from the HF config.json (and the
  tokenizer from its tokenizer.json, when there is one); a model key the user set (in a config
  file they named, or as an override) that disagrees with it is a one-line error, never silently
  overridden.
* `fitted_mesh`: when the user named no mesh.* key, the mesh is chosen for the model
  (`mesh.validate.fit_mesh`: tp the largest divisor of the kv-heads that fits one host's devices,
  dp the rest, or for an MoE model the largest divisor of its experts) and printed. A mesh the user did name is used as given, and one the model does not
  split over stays a one-line error.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from mesh.errors import ConfigError
from mesh.mesh import AXES, MeshConfig
from mesh.validate import fit_mesh
from models.config import LlamaConfig
from models.hf import read_hf_config
from pjax.config import Config


def names_a_mesh(named: set[str]) -> bool:
    """Whether the user chose any mesh.* key (`config_io.named_keys`)."""
    return any(f"mesh.{axis}" in named for axis in AXES)


def adopt_hf_model(cfg: Config, named: set[str]) -> Config:
    """`cfg` with its model keys from train.init_from's config.json (the vocabulary padding stays the
    run's), and its tokenizer.json when it ships one and the user named no data.tokenizer; a
    ConfigError if a model key the user set disagrees."""
    try:
        hf = read_hf_config(cfg.train.init_from)
    except ConfigError as e:
        raise ConfigError(f"train.init_from: {e}") from None
    # The run's own: the vocabulary padding, and the router-loss coefficients the user set (training
    # hyper-parameters, not the checkpoint's shape).
    own = {k: getattr(cfg.model, k) for k in ("router_aux_loss_coef", "router_z_loss_coef") if f"model.{k}" in named}
    hf = dataclasses.replace(hf, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by, **own)
    ours, theirs = dataclasses.asdict(cfg.model), dataclasses.asdict(hf)
    clash = [f"model.{k}={ours[k]} (config.json: {theirs[k]})" for k in theirs
             if f"model.{k}" in named and ours[k] != theirs[k]]
    if clash:
        raise ConfigError(f"train.init_from={cfg.train.init_from} has another shape than you set: {', '.join(clash)}; "
                          f"leave those model keys out (the model comes from config.json) or fix them.")
    cfg = dataclasses.replace(cfg, model=hf)
    shipped = Path(cfg.train.init_from, "tokenizer.json")
    if "data.tokenizer" not in named and shipped.is_file():  # the model's own tokenizer, not the default one
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(shipped)))
    return cfg


def fitted_mesh(model: LlamaConfig) -> MeshConfig:
    """The mesh `fit_mesh` chooses for `model` over every device (call after the backend started).
    One that leaves devices idle (an MoE model's experts limit dp) runs on one host only."""
    mesh = fit_mesh(jax.device_count(), jax.local_device_count(), num_kv_heads=model.num_key_value_heads,
                    intermediate_size=model.intermediate_size, padded_vocab_size=model.padded_vocab_size,
                    num_experts=model.num_local_experts)
    if mesh.size < jax.device_count() and jax.process_count() > 1:
        raise ConfigError(f"no dp x tp mesh over all {jax.device_count()} devices splits this model's "
                          f"{model.num_local_experts} experts over dp; set mesh.* keys (dp a divisor of the experts).")
    return mesh


def describe(mesh: MeshConfig, model: LlamaConfig) -> str:
    """The line that tells the user which mesh was chosen for them, and why."""
    experts = f", dp a divisor of its {model.num_local_experts} experts" if model.num_local_experts else ""
    idle = f" on {mesh.size} of {jax.device_count()} devices" if mesh.size < jax.device_count() else ""
    return (f"mesh chosen for the model: dp={mesh.dp} tp={mesh.tp}{idle} (tp: the largest divisor of its "
            f"{model.num_key_value_heads} kv-heads that fits {jax.local_device_count()} devices per host{experts}); "
            f"set mesh.* to choose another.")
