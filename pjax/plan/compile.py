"""Compile candidate layouts' training steps ahead of time, in a process pool, with a cache: on fake CPU devices,
or for the planned GPU kind on compile-only devices of XLA:GPU (`pjax.plan.gpu_target`).

Nothing is allocated: each step (the program `pjax.train` runs, in the profile's dtype and attention) is lowered
from `ShapeDtypeStruct`s, and XLA's memory per device and collectives per set of mesh axes are read back. A
result is cached under a key of config, layout, profile, device count, JAX version and pjax's source, so a
repeated plan compiles only what it has not seen."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import pathlib
import time
from typing import Any, Callable, Iterable

from pjax.config import Config
from pjax.plan.inspect import step_collectives, step_matmuls
from pjax.plan.layouts import Layout, planned_config
from pjax.plan.profiles import Profile

_SOURCE_DIRS = ("pjax", "models", "mesh")


def compile_planned(config: Config, layout: Layout, profile: Profile, devices_per_host: int, backend: str
                    ) -> tuple[Config, Any, Any]:
    """(planned config, trainer, compiled step) of one layout, on fake CPU devices of this process or on
    compile-only GPUs of the profile's kind (`backend` 'cpu' or 'gpu', `pjax.plan.gpu_target`)."""
    from mesh.backend import building_for
    from pjax.cudnn_fallback import compile_step
    from pjax.plan.gpu_target import compile_devices, persistent_cache
    from pjax.step import mesh_for, trainer_for

    cfg = planned_config(config, layout, profile)
    count = layout.dp * layout.pp * layout.cp * layout.tp
    mesh = mesh_for(cfg, compile_devices(backend, profile.name, count, min(count, devices_per_host)))
    build = lambda tc: trainer_for(mesh, cfg, tc)  # every section: precision, meta, DiLoCo, compression
    with building_for(backend, mesh.devices.flat[0]), persistent_cache(backend == "cpu"):
        trainer, compiled, _ = compile_step(build(cfg.train), build)  # chunked where cuDNN's does not compile
    return dataclasses.replace(cfg, train=trainer.tc), trainer, compiled


def compile_layout(config: Config, layout: Layout, profile: Profile, devices_per_host: int, backend: str = "cpu"
                   ) -> dict[str, Any]:
    """Compile one layout's step in this process: {memory, comm, matmuls, attention, compile_s}
    (`compile_planned`)."""
    from pjax.observe.memory import step_memory_bytes

    start = time.perf_counter()
    cfg, trainer, compiled = compile_planned(config, layout, profile, devices_per_host, backend)
    mesh = trainer.mesh
    m = compiled.memory_analysis()
    memory = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "alias": m.alias_size_in_bytes,
              "temp": m.temp_size_in_bytes, "total": step_memory_bytes(compiled)}
    hlo = compiled.as_text()
    comm = step_collectives(cfg, dict(mesh.shape), hlo, devices_per_host)
    return {"memory": memory, "comm": comm, "matmuls": step_matmuls(cfg, dict(mesh.shape), hlo).as_json(),
            "attention": cfg.train.attention, "compile_s": round(time.perf_counter() - start, 2)}


def _guarded(config: Config, layout: Layout, profile: Profile, devices_per_host: int, backend: str
             ) -> dict[str, Any]:
    """compile_layout, with a failure reported as {'error': one line} instead of ending the plan."""
    try:
        return compile_layout(config, layout, profile, devices_per_host, backend)
    except Exception as e:  # noqa: BLE001 - an XLA failure on one layout must not lose the others
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return {"error": f"{type(e).__name__}: {first}"}


def _init_worker(devices: int) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)


@dataclasses.dataclass
class Compiler:
    """Compiles layouts on `devices` devices through a cache directory and `workers` processes (0: in this one)."""

    profile: Profile
    devices: int
    devices_per_host: int
    cache_dir: str | None
    workers: int = 2
    backend: str = "cpu"  # or "gpu": XLA:GPU on compile-only devices of the profile's kind

    def key(self, config: Config, layout: Layout) -> str:
        blob = json.dumps([dataclasses.asdict(config), dataclasses.asdict(layout), dataclasses.asdict(self.profile),
                           self.devices, self.devices_per_host, self.backend, _versions()], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def run(self, config: Config, layouts: Iterable[Layout], on_done: Callable[[], None] = lambda: None
            ) -> dict[Layout, dict[str, Any]]:
        """Compile every layout not in the cache; returns each layout's result (cached ones included)."""
        results, todo = {}, []
        for layout in layouts:
            cached = self._load(config, layout)
            if cached is not None:
                results[layout] = {**cached, "cached": True}
                on_done()
            else:
                todo.append(layout)
        args = lambda layout: (config, layout, self.profile, self.devices_per_host, self.backend)
        if not todo:
            return results
        if self.workers == 0:
            for layout in todo:
                results[layout] = self._store(config, layout, _guarded(*args(layout)))
                on_done()
            return results
        ctx = multiprocessing.get_context("spawn")  # a fresh backend per worker, with its own device count
        with cf.ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                    initargs=(self.devices,)) as pool:
            futures = {pool.submit(_guarded, *args(layout)): layout for layout in todo}
            for future in cf.as_completed(futures):
                results[futures[future]] = self._store(config, futures[future], future.result())
                on_done()
        return results

    def _path(self, config: Config, layout: Layout) -> pathlib.Path | None:
        return None if self.cache_dir is None else pathlib.Path(self.cache_dir) / f"{self.key(config, layout)}.json"

    def _load(self, config: Config, layout: Layout) -> dict[str, Any] | None:
        path = self._path(config, layout)
        try:
            return json.loads(path.read_text()) if path is not None and path.exists() else None
        except (OSError, ValueError):  # a torn or unreadable entry is compiled again
            return None

    def _store(self, config: Config, layout: Layout, result: dict[str, Any]) -> dict[str, Any]:
        path = self._path(config, layout)
        if path is not None and "error" not in result:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(result))
            tmp.replace(path)
        return result


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/pjax/plan (~/.cache/pjax/plan)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pjax", "plan")


@functools.cache
def _versions() -> tuple[str, str]:
    """JAX's version and a hash of this checkout's Python source: a code change is a new cache key."""
    import jax

    root = pathlib.Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for directory in _SOURCE_DIRS:
        for path in sorted((root / directory).rglob("*.py")):
            digest.update(path.read_bytes())
    return jax.__version__, digest.hexdigest()[:16]
