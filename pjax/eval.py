"""Evaluate a LLaMA checkpoint on a text (loss and perplexity), or continue a prompt greedily.

Every prediction counts once, in training's windows; padding carries weight 0, so one compiled function
serves every batch. With no mesh.* key the mesh is fitted to the model (`pjax.fit`). There is no pipelined
or ring-attention forward: with pp > 1 or cp > 1 XLA gathers the weights or keys and values it needs."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh import watchdog
from mesh.distributed import force_cpu_devices, init_distributed, pipeline_cpu_threads
from mesh.errors import ConfigError
from mesh.mesh import CP, DATA, MeshConfig, data_size, make_mesh
from mesh.rules import flatten_tokens
from mesh.validate import validate_batch
from models import llama
from models.attention import select_attention
from models.config import LlamaConfig
from models.hf import load_hf, read_hf_config
from models.precision import Precision
from pjax import assets
from pjax.checkpoint.checkpointer import Checkpointer
from pjax.cli import ArgumentParser, run_main
from pjax.config import Config
from pjax.config_io import load_config, named_keys
from pjax.data.text import documents, load_tokenizer, tokenize
from pjax.fit import describe, fitted_mesh, names_a_mesh
from pjax.generate import generate, put_rows
from pjax.parallel.data_parallel import param_shardings
from pjax.parallel.tensor_parallel import vocab_parallel_cross_entropy
from pjax.spec import StepSpec
from pjax.validate import validate_layout

Params = dict[str, Any]


# --- Model and text ---

def load_hf_on_mesh(path: str, mesh: Mesh, zero: int = 0) -> tuple[LlamaConfig, Params]:
    """A HuggingFace checkpoint's config and parameters, each device reading only its slice."""
    cfg = read_hf_config(path)
    validate_layout(MeshConfig.of(mesh), cfg, zero)
    return load_hf(path, param_shardings(mesh, cfg, zero))


def read_checkpoint_config(path: str) -> Config:
    """The config stored in a pjax checkpoint directory's newest readable step."""
    if (Path(path) / "config.json").is_file():
        raise ConfigError(f"--checkpoint {path} is a HuggingFace checkpoint (config.json), not a pjax one; "
                          f"pass it as --hf {path}.")
    with Checkpointer(path, read_only=True, quiet=True) as ckpt:
        return ckpt.config()


def load_checkpoint_on_mesh(path: str, mesh: Mesh, zero: int = 0) -> tuple[LlamaConfig, Params]:
    """A pjax checkpoint's model config and parameters (newest readable step), each device reading its slice."""
    def shardings(model: LlamaConfig) -> Params:
        validate_layout(MeshConfig.of(mesh), model, zero)
        return param_shardings(mesh, model, zero)

    with Checkpointer(path, read_only=True) as ckpt:
        _, cfg, params = ckpt.restore_params(shardings)
        return cfg.model, params


def model_config(args: argparse.Namespace) -> tuple[LlamaConfig, str | None]:
    """The model shape of --hf or --checkpoint, and the tokenizer it comes with (None: none known)."""
    if args.checkpoint is not None:
        saved = read_checkpoint_config(args.checkpoint)
        return saved.model, saved.data.tokenizer
    return read_hf_config(args.hf), (args.hf if (Path(args.hf) / "tokenizer.json").is_file() else None)


def check_vocab(tokenizer: Any, cfg: LlamaConfig) -> None:
    """Ids past the embedding table would be silently clamped by XLA's gather: refuse them up front."""
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
                          f"{cfg.vocab_size}; pass the tokenizer the model was trained with (--tokenizer).")


def read_tokens(text: str, tokenizer: Any, split: str = "train", column: str = "text") -> np.ndarray:
    """All token ids of a text source (a file, a folder, or a hub data set), documents joined by EOS."""
    chunks = list(tokenize(documents(text, split=split, column=column), tokenizer))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    if len(tokens) < 2:
        raise ConfigError(f"--text {text} holds fewer than 2 tokens; evaluation needs at least one prediction.")
    return tokens.astype(np.int32)


def windows(tokens: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """inputs/labels/weights [n, seq_len] covering every prediction once; the last window padded."""
    n_pred = len(tokens) - 1
    n = -(-n_pred // seq_len)
    padded = np.zeros(n * seq_len + 1, np.int32)
    padded[:len(tokens)] = tokens
    weights = (np.arange(n * seq_len) < n_pred).astype(np.float32)
    return {"inputs": padded[:-1].reshape(n, seq_len), "labels": padded[1:].reshape(n, seq_len),
            "weights": weights.reshape(n, seq_len)}


# --- Loss ---

@functools.partial(jax.jit, static_argnames="spec")
def _batch_loss(params: Params, batch: dict[str, jax.Array], *, spec: StepSpec) -> jax.Array:
    """The weighted sum of the batch's next-token cross-entropies: the training step's loss
    (`tensor_parallel.vocab_parallel_cross_entropy`), padding weighted 0."""
    b, t = batch["inputs"].shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden = spec.hidden(params, batch["inputs"], positions)
    return vocab_parallel_cross_entropy(hidden, llama.output_kernel(params, spec.cfg), flatten_tokens(batch["labels"]),
                                        vocab_size=spec.cfg.vocab_size, weights=flatten_tokens(batch["weights"]))[0]


def evaluate(params: Params, cfg: LlamaConfig, tokens: np.ndarray, mesh: Mesh, *, seq_len: int,
             batch_size: int = 8, precision: Precision = Precision(), scan: bool = True,
             attention: str = "auto") -> dict[str, float]:
    """{loss, tokens, perplexity} of the model over the token stream (mean nats per predicted token)."""
    data = windows(tokens, seq_len)
    n = len(data["inputs"])
    dp = data_size(mesh)
    rows = -(-min(batch_size, n) // dp) * dp
    validate_batch(MeshConfig.of(mesh), batch_size=rows, grad_accum=1, seq_len=seq_len)
    total = -(-n // rows) * rows
    data = {k: np.pad(v, ((0, total - n), (0, 0))) for k, v in data.items()}  # padded rows: weight 0
    sharding = NamedSharding(mesh, P(DATA, CP))
    step = functools.partial(_batch_loss, spec=StepSpec(cfg, precision, select_attention(attention), scan=scan))
    sums = []
    with jax.set_mesh(mesh):
        for start in range(0, total, rows):
            batch = {k: put_rows(v[start:start + rows], sharding) for k, v in data.items()}
            sums.append(step(params, batch))
            # One batch in flight at a time: a long queue of executions deadlocks XLA:CPU's collectives on few cores.
            sums[-1].block_until_ready()
    n_pred = len(tokens) - 1
    loss = math.fsum(float(s) for s in sums) / n_pred
    return {"loss": loss, "tokens": n_pred, "perplexity": math.exp(loss)}


# --- Command line ---

def parser() -> ArgumentParser:
    """The command line's parser (tests/test_docs.py parses the commands the docs show with it)."""
    parser = ArgumentParser(prog="python -m pjax.eval", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR", help="a HuggingFace LLaMA checkpoint directory")
    source.add_argument("--checkpoint", metavar="DIR", help="a pjax (Orbax) checkpoint directory")
    parser.add_argument("--config", default=None, help="config name or YAML file for mesh, seq_len and data "
                        "defaults (default: debug)")
    parser.add_argument("--text", default=None, help="text to evaluate (default: the config's data.path)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer (default: the checkpoint's tokenizer.json, "
                        "else the config's data.tokenizer)")
    parser.add_argument("--batch_size", type=int, default=8, help="windows per forward pass (default 8)")
    parser.add_argument("--generate", metavar="PROMPT", default=None, help="continue this prompt greedily instead "
                        "of evaluating")
    parser.add_argument("--max_new_tokens", type=int, default=50, help="tokens to generate (default 50)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. mesh.tp=2")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def run(args: argparse.Namespace, cfg: Config, mesh: Mesh) -> dict[str, float] | str:
    """Evaluate (returns and prints the metrics) or generate (returns and prints the text) on `mesh`."""
    if args.batch_size < 1:
        raise ConfigError(f"--batch_size={args.batch_size} is invalid; use an integer >= 1.")
    if args.text is not None and assets.locate(args.text) is None:
        raise ConfigError(f"--text {args.text} does not exist; pass a .txt, .jsonl or .parquet file or a folder.")
    model_cfg, default_tokenizer = model_config(args)
    if args.checkpoint is not None:
        load = functools.partial(load_checkpoint_on_mesh, args.checkpoint, mesh, cfg.train.zero)
    else:
        load = functools.partial(load_hf_on_mesh, args.hf, mesh, cfg.train.zero)
    tokenizer = load_tokenizer(args.tokenizer or default_tokenizer or cfg.data.tokenizer)
    check_vocab(tokenizer, model_cfg)
    opts = dict(precision=cfg.precision.resolve(cfg.train.dtype), scan=cfg.train.scan_layers, attention=cfg.train.attention)
    is_main = jax.process_index() == 0

    if args.generate is not None:
        prompt = tokenizer.encode(args.generate, add_special_tokens=False).ids
        _, params = load()
        new = generate(params, model_cfg, prompt, mesh, max_new_tokens=args.max_new_tokens, **opts)
        text = tokenizer.decode(prompt + new)
        if is_main:
            print(text)
        return text

    # Tokenize before reading the weights: a wrong text fails fast.
    tokens = read_tokens(args.text, tokenizer) if args.text is not None else \
        read_tokens(cfg.data.path, tokenizer, cfg.data.split, cfg.data.column)
    _, params = load()
    result = evaluate(params, model_cfg, tokens, mesh, seq_len=cfg.train.seq_len, batch_size=args.batch_size, **opts)
    if is_main:
        print(json.dumps(result))
    return result


def _devices(n: int) -> list[jax.Device]:
    # A single CPU process uses exactly the forced count (XLA_FLAGS may have forced more).
    devices = jax.devices()
    return devices[:n] if devices[0].platform == "cpu" and jax.process_count() == 1 else devices


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: _main(args))


def _main(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides)
    init_distributed()
    with watchdog.guarding():  # a lost process ends this one in one line (mesh/watchdog.py)
        _evaluate_joined(args, cfg)


def _evaluate_joined(args: argparse.Namespace, cfg: Any) -> None:
    if names_a_mesh(named_keys(args.config, args.overrides)):
        n = force_cpu_devices(cfg.mesh)
        pipeline_cpu_threads(cfg.mesh, n)
    else:  # the config's mesh was made for its own model: fit one to this model instead
        n = force_cpu_devices(MeshConfig())
        model, _ = model_config(args)
        cfg = dataclasses.replace(cfg, mesh=fitted_mesh(model))
        if jax.process_index() == 0:
            print(describe(cfg.mesh, model))
    devices = _devices(n)
    run(args, cfg, make_mesh(cfg.mesh, devices[:cfg.mesh.size] if cfg.mesh.dp > 0 else devices,
                        cfg.model.num_local_experts))


if __name__ == "__main__":
    sys.exit(main())
