"""Checks that a model and a batch fit a mesh, each failing with one sentence that says what to change. Run them before
anything is traced: an indivisible shape otherwise surfaces deep in XLA's partitioner, or as silently uneven padding."""
from __future__ import annotations

from mesh.errors import ConfigError
from mesh.mesh import MeshConfig


def validate_model(mesh: MeshConfig, *, num_layers: int, num_heads: int, num_kv_heads: int,
                   hidden_size: int, intermediate_size: int, vocab_size: int, zero: int = 0,
                   vocab_multiple: int = 1, num_experts: int = 0, zero_shard: int = 0) -> None:
    """Check the tp split (heads, kv-heads, MLP, vocabulary padded to `vocab_multiple`), pp (layers), ep (experts),
    ZeRO's (the hidden size over dp, or over its shard groups of `zero_shard` replicas)."""
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"model.num_attention_heads={num_heads} is not divisible by model.num_key_value_heads="
            f"{num_kv_heads}; grouped-query attention needs whole groups."
        )
    for key, value in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads),
                       ("intermediate_size", intermediate_size)):
        if value % mesh.tp:
            raise ConfigError(f"model.{key}={value} is not divisible by mesh.tp={mesh.tp}; choose a tp that divides it.")
    padded = -(-vocab_size // vocab_multiple) * vocab_multiple
    if padded % mesh.tp:
        held = f"padded to {padded} by" if padded != vocab_size else "with"
        raise ConfigError(f"model.vocab_size={vocab_size} ({held} model.make_vocab_size_divisible_by={vocab_multiple}) "
                          f"does not split over mesh.tp={mesh.tp}: make that key a multiple of {mesh.tp}, or use a tp "
                          f"that divides {padded}.")
    if num_layers % mesh.pp:
        raise ConfigError(
            f"model.num_hidden_layers={num_layers} is not divisible by mesh.pp={mesh.pp}; "
            f"choose a pp that divides the number of layers."
        )
    if mesh.ep > 1 and not num_experts:
        raise ConfigError(f"mesh.ep={mesh.ep} splits a mixture of experts, but this model has none; "
                          f"remove mesh.ep (or set it to 1).")
    if num_experts and mesh.ep and num_experts % mesh.ep:
        raise ConfigError(f"model.num_local_experts={num_experts} is not divisible by mesh.ep={mesh.ep}; expert "
                          f"parallelism gives each ep device the same number of experts: choose an ep that divides "
                          f"both {num_experts} and mesh.dp={mesh.dp}.")
    if zero not in (0, 1, 3):
        raise ConfigError(f"train.zero={zero} is invalid; choose 0 (replicated), 1 (shard optimizer state) or 3 (FSDP).")
    shard = zero_shard or mesh.dp
    if zero and shard > 1 and hidden_size % shard:
        over = f"train.zero_shard={zero_shard}" if zero_shard else f"mesh.dp={mesh.dp}"
        raise ConfigError(
            f"train.zero={zero} shards the hidden dimension over dp, but model.hidden_size={hidden_size} is not "
            f"divisible by {over}; change {over.split('=')[0]} or use train.zero=0."
        )


def validate_batch(mesh: MeshConfig, *, batch_size: int, grad_accum: int, seq_len: int) -> None:
    """Check that the global batch splits into micro-batches over dp and the sequence over 2*cp."""
    if grad_accum < 1 or batch_size < 1 or seq_len < 1:
        raise ConfigError(
            f"train.batch_size={batch_size}, train.grad_accum={grad_accum} and train.seq_len={seq_len} must all be positive."
        )
    if batch_size % (grad_accum * mesh.dp):
        raise ConfigError(
            f"train.batch_size={batch_size} is not divisible by train.grad_accum*mesh.dp = {grad_accum}*{mesh.dp}; "
            f"each data-parallel replica needs a whole number of rows per micro-batch."
        )
    if mesh.cp > 1 and seq_len % (2 * mesh.cp):
        raise ConfigError(
            f"train.seq_len={seq_len} is not divisible by 2*mesh.cp = {2 * mesh.cp}: zigzag context parallelism "
            f"cuts a sequence into 2*cp equal chunks."
        )


def fit_mesh(num_devices: int, devices_per_host: int, *, num_kv_heads: int, intermediate_size: int,
             padded_vocab_size: int, num_experts: int = 0) -> MeshConfig:
    """The mesh for a model given none: tp the largest divisor of the kv-heads (so the heads), MLP, padded vocabulary
    and one host's devices (the fastest links), dp every device left; experts split over the largest ep that
    divides both them and dp (6 experts, 2 kv-heads, 8 devices: tp=2, dp=4, ep=2)."""
    def splits(t: int) -> bool:
        return not (num_kv_heads % t or devices_per_host % t or num_devices % t or intermediate_size % t
                    or padded_vocab_size % t)

    tp = max(t for t in range(1, min(num_kv_heads, devices_per_host) + 1) if splits(t))
    return MeshConfig(dp=num_devices // tp, tp=tp).with_experts(num_experts)
