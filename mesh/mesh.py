"""The 4D device mesh, axes outermost to innermost: tp talks every layer (fastest links), dp once per step (slowest).
Data parallelism is three physical axes: `ep`, the devices that split an MoE's experts among them, inside `dp`, the
replicas of such a group, inside `rp`, the replicas of a ZeRO shard group (hierarchical data parallelism,
`train.zero_shard`: ZeRO shards over dp x ep and copies over rp; rp is 1 without it). ARCHITECTURE.md, "Experts
over ep, a split of dp" and "HSDP: ZeRO within a shard group, copies across"."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from mesh.errors import ConfigError

RP = "rp"  # the copies of a ZeRO shard group under train.zero_shard (1 without it)
DP = "dp"  # the replicas of an expert group (all of data parallelism for a dense model), within a shard group
EP = "ep"  # the devices of an expert group: they hold different tokens and different experts
PP = "pp"
CP = "cp"
TP = "tp"
AXES: tuple[str, ...] = (RP, DP, EP, PP, CP, TP)  # the physical axes
KEYS: tuple[str, ...] = (DP, EP, PP, CP, TP)  # the mesh section's sizes (mesh.dp is all of data parallelism)
DATA: tuple[str, ...] = (RP, DP, EP)  # data parallelism spans all three
ZERO: tuple[str, ...] = (DP, EP)  # ZeRO shards over these, and copies over rp


def data_size(mesh) -> int:
    """How many data-parallel replicas a mesh (or abstract mesh) has: rp x dp x ep."""
    return 1 if mesh.empty else math.prod(mesh.shape.get(a, 1) for a in DATA)


def current() -> jax.sharding.AbstractMesh:
    """The ambient mesh (`jax.set_mesh`): the one way code under jit learns the layout, manual axes
    included (host code holds a `Mesh` to place arrays; validation sees a `MeshConfig`'s sizes)."""
    return jax.sharding.get_abstract_mesh()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the four mesh axes, and `ep`, how many of the dp devices split the experts (it divides dp).
    `dp=-1` means "every device the other axes leave"; `ep=0`, "as many as the model's experts allow"
    (`with_experts`)."""

    dp: int = -1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 0
    tp_across_hosts: bool = False  # accept a tp that crosses hosts (`mesh.hosts.check_tp`)

    def __post_init__(self) -> None:
        if not isinstance(self.tp_across_hosts, bool):
            raise ConfigError(f"mesh.tp_across_hosts={self.tp_across_hosts!r} is invalid: use true or false.")
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 0:
            raise ConfigError(f"mesh.ep={self.ep!r} is invalid: use a positive integer that divides mesh.dp, "
                              f"or 0 (as many as the experts allow).")
        for name in (DP, PP, CP, TP):
            size = getattr(self, name)
            if not isinstance(size, int) or size == 0 or size < -1 or (size == -1 and name != DP):
                allowed = "a positive integer or -1 (fill the remaining devices)" if name == DP else "a positive integer"
                raise ConfigError(f"mesh.{name}={size!r} is invalid: use {allowed}.")

    def resolve(self, num_devices: int) -> "MeshConfig":
        """A copy with `dp` filled in, the sizes checked against `num_devices`."""
        rest = self.pp * self.cp * self.tp
        if self.dp == -1:
            if num_devices % rest:
                raise ConfigError(
                    f"mesh.pp*mesh.cp*mesh.tp = {self.pp}*{self.cp}*{self.tp} = {rest} does not divide the "
                    f"{num_devices} available devices; choose sizes whose product divides {num_devices}."
                )
            return dataclasses.replace(self, dp=num_devices // rest).resolve(num_devices)
        if self.dp * rest != num_devices:
            raise ConfigError(
                f"mesh dp*pp*cp*tp = {self.dp}*{self.pp}*{self.cp}*{self.tp} = {self.dp * rest} but "
                f"{num_devices} devices are available; make the product equal {num_devices} (or set mesh.dp=-1)."
            )
        if self.ep and self.dp % self.ep:
            raise ConfigError(f"mesh.ep={self.ep} does not divide mesh.dp={self.dp}: the experts are split over ep "
                              f"of the dp devices and copied over the rest; choose an ep that divides dp.")
        return self

    def with_experts(self, num_experts: int, copies: int = 1, zero_shard: int = 0) -> "MeshConfig":
        """A copy with an unset `ep` (0) filled in: the largest divisor of dp that the experts divide, that leaves
        at least `copies` whole copies of them (dp / ep; DiLoCo's groups need 2) and that divides ZeRO's shard
        groups of `zero_shard` replicas (0: all of dp): all of dp where the experts divide it and nothing else
        asks. A dense model's stays 0, which builds an ep axis of 1."""
        if self.ep or self.dp < 1 or not num_experts:
            return self
        group = zero_shard or self.dp
        fits = [d for d in range(1, self.dp + 1)
                if not self.dp % d and not num_experts % d and self.dp // d >= copies and not group % d]
        return dataclasses.replace(self, ep=max(fits, default=1))

    def model_copies(self, num_experts: int = 0, copies: int = 1) -> int:
        """How many data replicas hold a whole model each: dp / ep (an expert group is one), dp for a dense model;
        an unset ep as `with_experts(num_experts, copies)` fills it in. DiLoCo's groups and meta-learning's tasks
        are made of these."""
        return self.dp // (self.with_experts(num_experts, copies).ep or 1)

    @classmethod
    def of(cls, mesh: Mesh) -> "MeshConfig":
        """The sizes of a built mesh."""
        return cls(dp=data_size(mesh), ep=mesh.shape[EP], **{name: mesh.shape[name] for name in (PP, CP, TP)})

    @property
    def shape(self) -> tuple[int, ...]:
        """The physical axes' sizes, in `AXES` order (an unset ep counts as 1; ZeRO over all of dp: rp 1)."""
        return self.split(0)

    def split(self, zero_shard: int) -> tuple[int, ...]:
        """`shape` with ZeRO's state sharded over groups of `zero_shard` consecutive data replicas (0: all of
        them) and copied over the dp / zero_shard groups: rp = dp / zero_shard, dp = zero_shard / ep."""
        ep = self.ep or 1
        self.check_zero_shard(zero_shard)
        shard = zero_shard or self.dp
        return (self.dp // shard, shard // ep, ep, self.pp, self.cp, self.tp)

    def check_zero_shard(self, zero_shard: int) -> None:
        """One line unless ZeRO's shard groups of `zero_shard` consecutive replicas split dp, each holding whole
        expert groups of ep."""
        if not zero_shard or zero_shard == self.dp:
            return
        head, ep = f"train.zero_shard={zero_shard}", self.ep or 1
        if self.dp % zero_shard:
            raise ConfigError(f"{head} groups consecutive data replicas for ZeRO, and mesh.dp={self.dp} does not "
                              f"split into groups of {zero_shard}; use a divisor of {self.dp}, or 0 for all of dp.")
        if zero_shard % ep:
            raise ConfigError(f"{head} would cut the expert groups of mesh.ep={ep}: set mesh.ep to a divisor of "
                              f"{zero_shard}, or train.zero_shard to a multiple of {ep} dividing mesh.dp={self.dp} (a "
                              f"ZeRO group holds whole ones).")

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None, num_experts: int = 0,
              copies: int = 1, zero_shard: int = 0) -> Mesh:
    """The mesh over `devices` (default: all), every axis Auto (ARCHITECTURE.md, "Auto mesh axes, not Explicit");
    an unset ep is filled in for a model of `num_experts` experts, `copies` of them at least
    (`MeshConfig.with_experts`); ZeRO's shard groups of `zero_shard` data replicas (0: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    cfg = cfg.resolve(len(devices)).with_experts(num_experts, copies, zero_shard)
    return jax.make_mesh(cfg.split(zero_shard), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def mesh_summary(mesh: Mesh) -> str:
    """One line such as 'mesh dp=2 pp=1 cp=1 tp=4 over 8 cpu devices' (dp all data replicas; ep, and ZeRO's shard
    groups, shown when they split it)."""
    parts = ([f"ep={mesh.shape[EP]}"] if mesh.shape[EP] > 1 else []) + (
        [f"ZeRO over {mesh.shape[DP] * mesh.shape[EP]}, {mesh.shape[RP]} copies"] if mesh.shape[RP] > 1 else [])
    split = f" ({'; '.join(parts)})" if parts else ""
    sizes = f"dp={data_size(mesh)}{split} " + " ".join(f"{name}={mesh.shape[name]}" for name in (PP, CP, TP))
    platform = mesh.devices.flat[0].platform
    return f"mesh {sizes} over {mesh.devices.size} {platform} devices"
