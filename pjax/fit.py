"""A run fitted to a model it did not define (`pjax.eval --hf/--checkpoint`, `train.init_from`): the shape
from the checkpoint, a mesh that splits it (ARCHITECTURE.md, "A mesh for a model the user did not define")."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax

from mesh.errors import ConfigError, listed
from mesh.mesh import KEYS, MeshConfig
from mesh.validate import fit_mesh
from models.config import LlamaConfig
from models.hf import read_hf_config
from pjax.config import Config


def names_a_mesh(named: set[str]) -> bool:
    """Whether the user chose any mesh.* key (`config_io.named_keys`)."""
    return any(f"mesh.{axis}" in named for axis in KEYS)


def adopt_hf_model(cfg: Config, named: set[str]) -> Config:
    """`cfg` with train.init_from's model keys and tokenizer.json (unless the user named one); a model key
    the user set that disagrees is a ConfigError."""
    try:
        hf = read_hf_config(cfg.train.init_from)
    except ConfigError as e:  # a line about its config.json starts with that file's path: it names the directory
        said = str(e)
        names_file = said.startswith(os.path.join(cfg.train.init_from, "config.json"))
        raise ConfigError(said if names_file else f"train.init_from: {said}") from None
    # The run's own: the vocabulary padding, and router-loss coefficients (training, not shape).
    own = {k: getattr(cfg.model, k) for k in ("router_aux_loss_coef", "router_z_loss_coef") if f"model.{k}" in named}
    hf = dataclasses.replace(hf, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by, **own)
    ours, theirs = dataclasses.asdict(cfg.model), dataclasses.asdict(hf)
    clash = [f"model.{k}={ours[k]} (config.json: {theirs[k]})" for k in theirs
             if f"model.{k}" in named and ours[k] != theirs[k]]
    if clash:
        raise ConfigError(f"train.init_from={cfg.train.init_from} has another shape than you set: "
                          f"{listed(clash, 40)}; leave those keys out (config.json sets them) or match them.")
    cfg = dataclasses.replace(cfg, model=hf)
    shipped = Path(cfg.train.init_from, "tokenizer.json")
    if "data.tokenizer" not in named and shipped.is_file():
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(shipped)))
    return cfg


def fitted_mesh(model: LlamaConfig) -> MeshConfig:
    """The mesh `fit_mesh` chooses for `model` over every device (after the backend started)."""
    mesh = fit_mesh(jax.device_count(), jax.local_device_count(), num_kv_heads=model.num_key_value_heads,
                    intermediate_size=model.intermediate_size, padded_vocab_size=model.padded_vocab_size,
                    num_experts=model.num_local_experts)
    return mesh


def describe(mesh: MeshConfig, model: LlamaConfig) -> str:
    """The line that tells the user which mesh was chosen, and why."""
    split = f" ep={mesh.ep}" if model.num_local_experts else ""
    experts = (f", ep the largest divisor of dp that its {model.num_local_experts} experts divide"
               if model.num_local_experts else "")
    return (f"mesh chosen for the model: dp={mesh.dp}{split} tp={mesh.tp} (tp: the largest divisor of its "
            f"{model.num_key_value_heads} kv-heads that fits {jax.local_device_count()} devices per host{experts}); "
            f"set mesh.* to choose another.")
