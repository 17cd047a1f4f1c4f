"""The planner's search space: the layouts a model and batch divide into on N devices (tp inside one host;
ZeRO flat or in HSDP groups of a host's replicas), kept only when pjax's own validators accept them, and the
exact training state each holds per device, from shard shapes on an `AbstractMesh` (no devices needed)."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from typing import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

from mesh.errors import ConfigError
from mesh.mesh import AXES, KEYS, MeshConfig
from models import llama
from models.precision import Precision, bytes_per
from pjax import compose
from pjax.config import Config
from pjax.parallel.context.strategy import STRATEGIES as CONTEXT_STRATEGIES
from pjax.parallel.pipeline.table import SCHEDULE_NAMES as SCHEDULES
from pjax.parallel import data_parallel
from pjax.plan.profiles import Profile

ZEROS = (0, 1, 3)
REMATS = ("none", "full")
REMAT_RECOMPUTE = {"full": 4 / 3}  # the forward again: 8 instead of 6 FLOPs per parameter and token
# AFAB and lockstep 1F1B beat 1F1B only by holding more micro-batches, so the search leaves them out.
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("zb_v", 2))


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a config: the mesh and the train/pipeline/context keys the search varies."""

    dp: int
    pp: int = 1
    cp: int = 1
    tp: int = 1
    zero: int = 0
    remat: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    grad_accum: int = 1
    sequence_parallel: bool = False
    context: str = "ring"
    ep: int = 0  # of dp's devices, how many split the experts (0: `MeshConfig.with_experts`'s default)
    zero_shard: int = 0  # HSDP: ZeRO within groups of this many data replicas, copied across them (0: all of dp)

    @property
    def mesh(self) -> MeshConfig:
        return MeshConfig(dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp, ep=self.ep)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes of `KEYS` as this layout names them: dp all data replicas, ep those that split experts."""
        return (self.dp, self.ep, self.pp, self.cp, self.tp)

    @property
    def name(self) -> str:
        """E.g. 'dp2-pp2-tp2-zero1-remat-interleaved2-m8' or 'dp64-zero3-shard8-m4': the mesh, what differs from
        plain, the micro-batches."""
        parts = [f"{axis}{size}" for axis, size in zip(KEYS, self.sizes) if size > 1]
        parts += [f"zero{self.zero}"] if self.zero else []
        parts += [f"shard{self.zero_shard}"] if self.zero_shard else []
        parts += [] if self.remat == "none" else ["remat" if self.remat == "full" else f"remat_{self.remat}"]
        parts += ["sp"] if self.sequence_parallel else []
        parts += [self.context] if self.cp > 1 and self.context != "ring" else []
        if self.pp > 1 and self.schedule != "1f1b":
            parts += [self.schedule + (str(self.virtual_stages) if self.schedule == "interleaved" else "")]
        return "-".join((parts or ["1"]) + [f"m{self.grad_accum}"])

    @classmethod
    def parse(cls, name: str) -> "Layout":
        """The layout a `name` spells; ValueError otherwise."""
        fields: dict = {}
        for part in name.split("-"):
            key = next((k for k in (*KEYS, "zero", "shard", "m", "interleaved") if re.fullmatch(rf"{k}\d+", part)),
                       None)
            if key == "interleaved":
                fields.update(schedule="interleaved", virtual_stages=int(part[len(key):]))
            elif key is not None:
                fields[{"m": "grad_accum", "shard": "zero_shard"}.get(key, key)] = int(part[len(key):])
            elif part in CONTEXT_STRATEGIES:
                fields["context"] = part
            elif part.startswith("remat_"):
                fields["remat"] = part[len("remat_"):]
            elif part in SCHEDULES and part != "interleaved":
                fields.update(schedule=part, virtual_stages=2 if part == "zb_v" else 1)
            elif part in ("remat", "sp", "1"):
                fields.update({"remat": {"remat": "full"}, "sp": {"sequence_parallel": True}, "1": {}}[part])
            else:
                raise ValueError(f"cannot read {part!r} in layout {name!r}; write it like dp2-pp2-tp2-zero1-remat-m4")
        return cls(**{"dp": 1, **fields})

    def overrides(self) -> list[str]:
        """The `key=value` overrides that give `pjax.train` this layout."""
        keys = [f"mesh.{axis}={size}" for axis, size in zip(KEYS, self.sizes) if axis != "ep" or size]
        # under ZeRO its group always: a config's own train.zero_shard must not survive a flat layout
        keys += [f"train.zero={self.zero}"] + ([f"train.zero_shard={self.zero_shard}"] if self.zero else [])
        keys += [f"train.remat={self.remat}", f"train.grad_accum={self.grad_accum}",
                 f"train.sequence_parallel={str(self.sequence_parallel).lower()}"]
        keys += ["train.scan_layers=true"] if self.remat == "full" else []
        if self.pp > 1:
            keys += [f"pipeline.schedule={self.schedule}", f"pipeline.virtual_stages={self.virtual_stages}"]
        return keys + ([f"context.strategy={self.context}"] if self.cp > 1 else [])


def with_config_shard(layout: Layout, config: Config) -> Layout:
    """`layout` with the config's train.zero_shard where it runs ZeRO and its name gives no HSDP group (a name the
    user wrote, with an override for the group)."""
    return dataclasses.replace(layout, zero_shard=config.train.zero_shard) if layout.zero and not layout.zero_shard \
        else layout


def mesh_shapes(devices: int, devices_per_host: int) -> Iterator[tuple[int, int, int, int]]:
    """Every (dp, pp, cp, tp) with dp * pp * cp * tp = devices and tp <= devices_per_host."""
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    for tp in (d for d in divisors if d <= devices_per_host):
        for cp in (d for d in divisors if (devices // tp) % d == 0):
            for pp in (d for d in divisors if (devices // (tp * cp)) % d == 0):
                yield devices // (tp * cp * pp), pp, cp, tp


def apply(config: Config, layout: Layout) -> Config:
    """`config` run on `layout`; remat=full also scans the layers: unrolled, XLA merges each layer's
    recomputation with its forward and saves no memory."""
    scan = config.train.scan_layers or layout.remat == "full"
    names = config.train.remat_names if layout.remat == "names" else None
    train = dataclasses.replace(config.train, zero=layout.zero, zero_shard=layout.zero_shard, remat=layout.remat,
                                remat_names=names,
                                grad_accum=layout.grad_accum, scan_layers=scan,
                                sequence_parallel=layout.sequence_parallel)
    pipeline = dataclasses.replace(config.pipeline, schedule=layout.schedule, virtual_stages=layout.virtual_stages)
    context = dataclasses.replace(config.context, strategy=layout.context)
    return dataclasses.replace(config, mesh=layout.mesh, train=train, pipeline=pipeline, context=context)


def planned_config(config: Config, layout: Layout, profile: Profile) -> Config:
    """The config the planner compiles for `layout` on `profile`: its attention (but where a cp strategy
    attends with its own kernel), and its compute dtype unless `precision.preset` names one."""
    config = apply(config, layout)
    dtype = profile.compute_dtype if config.precision.preset == "auto" else "auto"
    own_kernel = layout.cp > 1 and config.context.strategy != "ulysses"  # ring, all_gather: attention stays auto
    train = dataclasses.replace(config.train, dtype=dtype, attention="auto" if own_kernel else profile.attention)
    return dataclasses.replace(config, train=train)


def policy(config: Config, profile: Profile) -> Precision:
    """The precision policy a run of `config` has on `profile`."""
    dtype = profile.compute_dtype if config.precision.preset == "auto" else "auto"
    return config.precision.resolve(dtype)


def check(config: Config, layout: Layout) -> None:
    """A ConfigError, the one `pjax.train` would raise, unless `config` runs on `layout`."""
    compose.check(apply(config, layout))  # a curriculum's shorter lengths must split too; memory is train.seq_len's


def micro_batch_counts(config: Config, dp: int) -> list[int]:
    """train.grad_accum values to try: the config's and the powers of two that leave whole rows per dp device."""
    batch = config.train.batch_size
    counts = {config.train.grad_accum} | {2 ** i for i in range(batch.bit_length()) if batch % 2 ** i == 0}
    return sorted(g for g in counts if batch % g == 0 and (batch // g) % dp == 0)


def expert_splits(config: Config, dp: int) -> list[int]:
    """mesh.ep values to try: the config's if it sets one, else every divisor of dp that the experts divide
    (fewer experts per device against all-to-alls over fewer devices); [0] for a dense model."""
    experts = config.model.num_local_experts
    if not experts:
        return [0]
    if config.mesh.ep:
        return [config.mesh.ep]
    return [e for e in range(1, dp + 1) if not dp % e and not experts % e]


def shard_groups(config: Config, dp: int, inner: int, devices_per_host: int) -> list[int]:
    """train.zero_shard values to try under ZeRO: 0 (all of dp), the config's, and the group whose replicas of
    `inner` devices each fill one host, so that its ZeRO collectives stay on the host's links and only the
    copies' all-reduce crosses hosts (what the validators refuse, e.g. a group that splits an expert group, goes)."""
    groups = {0, config.train.zero_shard} | ({devices_per_host // inner} if devices_per_host % inner == 0 else set())
    return sorted(g for g in groups if g == 0 or 2 <= g < dp and dp % g == 0)


def layouts(config: Config, devices: int, devices_per_host: int, zeros: tuple[int, ...] = ZEROS,
            remats: tuple[str, ...] = REMATS) -> list[Layout]:
    """Every layout of `config` on `devices` devices that pjax accepts. cp > 1 keeps context.strategy: the
    rough memory estimate cannot tell strategies apart and would rank layouts that do not fit first."""
    remats = tuple(dict.fromkeys((*remats, config.train.remat)))
    found = []
    for dp, pp, cp, tp in mesh_shapes(devices, devices_per_host):
        schedules = PIPELINE_SCHEDULES if pp > 1 else [("1f1b", 1)]
        sequence_parallel = (False, True) if tp > 1 else (False,)
        for zero, remat, (schedule, v), accum, sp, ep in itertools.product(
                zeros, remats, schedules, micro_batch_counts(config, dp), sequence_parallel,
                expert_splits(config, dp)):
            if zero and dp == 1:  # the same program as zero=0
                continue
            for shard in shard_groups(config, dp, pp * cp * tp, devices_per_host) if zero else [0]:
                layout = Layout(dp, pp, cp, tp, zero, remat, schedule, v, accum, sp, config.context.strategy, ep,
                                shard)
                try:
                    check(config, layout)
                except ConfigError:
                    continue
                found.append(layout)
    return found


def abstract_mesh(layout: Layout) -> AbstractMesh:
    """The layout's mesh without devices."""
    return AbstractMesh(layout.mesh.split(layout.zero_shard), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def state_bytes(config: Config, layout: Layout) -> dict[str, int]:
    """Bytes per device of the fp32 parameters, the gradient accumulator and the AdamW moments in the
    dtypes `precision.*` gives them."""
    p = config.precision.resolve(config.train.dtype)
    ep = layout.mesh.with_experts(config.model.num_local_experts).ep
    return dict(_state_bytes(config.model, layout.dp, layout.pp, layout.cp, layout.tp, layout.zero,
                             bytes_per(p.grad_accum), bytes_per(p.optimizer_state), ep, layout.zero_shard))


@functools.lru_cache(maxsize=4096)
def _state_bytes(cfg, dp: int, pp: int, cp: int, tp: int, zero: int, grad_bytes: int = 4, moment_bytes: int = 4,
                 ep: int = 0, zero_shard: int = 0) -> tuple:
    layout = Layout(dp, pp, cp, tp, zero, ep=ep, zero_shard=zero_shard)
    mesh = abstract_mesh(layout)
    shapes = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))
    per_device = lambda shardings: sum(
        math.prod(sharding.shard_shape(s.shape)) * jnp.dtype(jnp.float32).itemsize
        for s, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)))
    params = per_device(data_parallel.param_shardings(mesh, cfg, layout.zero))
    grads = per_device(data_parallel.grad_shardings(mesh, cfg, layout.zero))
    held, moments = grads * grad_bytes // 4, 2 * grads * moment_bytes // 4
    return (("params", params), ("grads", held), ("opt_state", moments), ("total", params + held + moments))
