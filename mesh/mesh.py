"""The 4D device mesh, axes outermost to innermost: tp talks every layer (fastest links), dp once per step (slowest)."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from mesh.errors import ConfigError

DP = "dp"  # and ZeRO / FSDP
PP = "pp"
CP = "cp"
TP = "tp"
AXES: tuple[str, ...] = (DP, PP, CP, TP)


def current() -> jax.sharding.AbstractMesh:
    """The ambient mesh (`jax.set_mesh`): the one way code under jit learns the layout, manual axes
    included (host code holds a `Mesh` to place arrays; validation sees a `MeshConfig`'s sizes)."""
    return jax.sharding.get_abstract_mesh()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the four mesh axes. `dp=-1` means "every device the other axes leave"."""

    dp: int = -1
    pp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
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
            return dataclasses.replace(self, dp=num_devices // rest)
        if self.dp * rest != num_devices:
            raise ConfigError(
                f"mesh dp*pp*cp*tp = {self.dp}*{self.pp}*{self.cp}*{self.tp} = {self.dp * rest} but "
                f"{num_devices} devices are available; make the product equal {num_devices} (or set mesh.dp=-1)."
            )
        return self

    @classmethod
    def of(cls, mesh: Mesh) -> "MeshConfig":
        """The sizes of a built mesh."""
        return cls(**{name: mesh.shape[name] for name in AXES})

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp, self.pp, self.cp, self.tp)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh over `devices` (default: all), every axis Auto (ARCHITECTURE.md, "Auto mesh axes, not Explicit")."""
    devices = list(jax.devices() if devices is None else devices)
    cfg = cfg.resolve(len(devices))
    return jax.make_mesh(cfg.shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def mesh_summary(mesh: Mesh) -> str:
    """One line such as 'mesh dp=2 pp=1 cp=1 tp=4 over 8 cpu devices'."""
    sizes = " ".join(f"{name}={mesh.shape[name]}" for name in AXES)
    platform = mesh.devices.flat[0].platform
    return f"mesh {sizes} over {mesh.devices.size} {platform} devices"
