"""`python -m pjax.plan --config NAME|FILE --devices N [--device-kind h100] [--hosts H] [key=value ...]`

Prints the layouts `search.plan` ranks (a table, or `--json`) and the winner as `pjax.train` overrides;
`--explain LAYOUT` shows one layout's parameters, shardings, memory and collectives instead."""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiling for fake CPU devices: never touch an accelerator
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's partitioner warnings would bury the table

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from mesh.errors import ConfigError, first_line  # noqa: E402
from pjax.cli import ArgumentParser, run_main  # noqa: E402
from pjax.plan.profiles import PROFILES, of_kind  # noqa: E402


def parser() -> ArgumentParser:
    """The command line's parser (tests/test_docs.py parses the commands the docs show with it)."""
    ap = ArgumentParser(prog="python -m pjax.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="debug", help="a shipped config name (pjax/assets/configs/) or a YAML file")
    ap.add_argument("--devices", type=int, required=True, help="how many devices (GPUs) in all")
    ap.add_argument("--device-kind", dest="device_kind", default="h100", choices=list(PROFILES))
    ap.add_argument("--xla", default="auto", choices=("auto", "cpu", "gpu"),
                    help="the compiler whose memory plan and collectives are read: gpu compiles for the device "
                         "kind on compile-only GPUs (pip install 'pjax[gpu-plan]'), cpu on fake CPU devices; auto: "
                         "gpu for a GPU kind where it can")
    ap.add_argument("--hosts", type=int, default=None, help="hosts the devices are on (default: 8 devices per host)")
    ap.add_argument("--mem-fraction", dest="mem_fraction", type=float, default=None,
                    help="share of a device's memory the allocator may use (default: JAX's .75 on GPUs, 1 on CPU)")
    ap.add_argument("--max-candidates", dest="max_candidates", type=int, default=12,
                    help="how many layouts to compile (the best-scored ones)")
    ap.add_argument("--workers", type=int, default=2, help="compile processes (0: compile in this process)")
    ap.add_argument("--cache", default=None, help="directory of compiled results (default ~/.cache/pjax/plan)")
    ap.add_argument("--no-cache", dest="no_cache", action="store_true")
    ap.add_argument("--top", type=int, default=10, help="rows of the table")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--calibration", default=None, metavar="JSON",
                    help="a `python -m pjax.plan.calibrate` record of this device kind: its measured matmul and "
                         "attention rates replace the profile's single efficiency")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure this machine's rates first (python -m pjax.plan.calibrate, kept in the cache "
                         "directory per machine) and plan with them: for --device-kind cpu, or on a host with "
                         "GPUs of the kind planned for")
    ap.add_argument("--explain", metavar="LAYOUT", default=None,
                    help="inspect one layout (e.g. dp2-tp4-zero1-m4) instead of searching")
    ap.add_argument("overrides", nargs="*", help="config overrides applied before planning, e.g. train.batch_size=64")
    return ap


def parse_args(argv: Sequence[str] | None) -> Any:
    return parser().parse_args(argv)


def _curves(path: str, kind: str) -> Any:
    """The record at `path` as curves, refused in one line where it is unreadable or was measured on devices
    that are not `kind` (its rates would be another machine's)."""
    from pjax.plan.curves import Curves

    try:
        curves = Curves.load(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--calibration {path} is unreadable ({first_line(e, 30)}); run "
                          f"`python -m pjax.plan.calibrate --out FILE` on that device kind.") from None
    if not of_kind(kind, curves.device_kind):
        measured = next((k for k in PROFILES if of_kind(k, curves.device_kind)), None)
        instead = f"plan with --device-kind {measured}" if measured else "plan for the kind it measured"
        raise ConfigError(f"--calibration {path} was measured on {curves.device_kind}, not on {kind}: {instead}, "
                          f"or run pjax.plan.calibrate on {kind}.")
    return curves


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: _run(args))


def _run(args: Any) -> None:
    from pjax.config_io import load_config

    if args.devices < 1:
        raise ConfigError(f"--devices {args.devices}: give the number of devices, a positive integer.")
    if args.calibrate and args.calibration:
        raise ConfigError("--calibrate measures this machine and --calibration reads a record: give one of them.")
    config = load_config(args.config, args.overrides)
    profile = PROFILES[args.device_kind]
    if args.calibration:
        profile = dataclasses.replace(profile, curves=_curves(args.calibration, args.device_kind))
    layout = _layout(args.explain, config) if args.explain else None
    hosts = args.hosts or math.ceil(args.devices / profile.devices_per_host)
    if hosts < 1 or args.devices % hosts:
        raise ConfigError(f"--hosts {hosts} does not divide --devices {args.devices}; every host has the same devices.")
    per_host = args.devices // hosts
    fraction = args.mem_fraction or (1.0 if profile.shares_host else 0.75)
    if not 0 < fraction <= 1:
        raise ConfigError(f"--mem-fraction {fraction} is not in (0, 1]; use e.g. .75 (JAX's default) or .95.")
    import jax

    from pjax.plan.gpu_target import planned_profile, resolve_backend

    backend = resolve_backend(args.xla, args.device_kind)
    profile = planned_profile(profile, backend)
    try:
        jax.config.update("jax_num_cpu_devices", args.devices)
    except RuntimeError:  # JAX already started in this process (a notebook, a test): use its devices
        pass
    if args.calibrate:
        profile = dataclasses.replace(profile, curves=_this_machine(args))
    in_process = args.workers == 0 or args.explain
    if backend == "cpu" and in_process and len(jax.devices("cpu")) < args.devices:
        raise ConfigError(f"this process has {len(jax.devices('cpu'))} CPU devices and the layouts need {args.devices}; "
                          f"compile in worker processes (--workers 1 or more), or start JAX with more CPU devices.")
    if args.explain:
        from pjax.plan.explain import explain

        print(explain(config, layout, profile, per_host, backend))
        return
    from pjax.plan.compile import Compiler, default_cache_dir
    from pjax.plan.search import plan

    cache = None if args.no_cache else (args.cache or default_cache_dir())
    compiler = Compiler(profile, args.devices, per_host, cache, args.workers, backend)
    result = plan(config, profile, args.devices, per_host, compiler, args.max_candidates, fraction,
                  progress=None if args.json else _progress)
    if args.json:
        print(json.dumps({**_as_json(result, args), "compiler": f"xla:{backend}"}, indent=1))
    else:
        print(_report(result, args, backend))
    if not any(c.prediction and c.prediction.fits for c in result.compiled):
        sys.exit(1)


def _this_machine(args: Any) -> Any:
    """This machine's calibration as curves (`calibrate.this_machine`), and one line on stderr saying whence."""
    from pjax.plan.calibrate import this_machine
    from pjax.plan.compile import default_cache_dir
    from pjax.plan.curves import Curves

    directory = None if args.no_cache else os.path.join(args.cache or default_cache_dir(), "calibration")
    try:
        record, path, fresh = this_machine(args.device_kind, directory, args.config, args.overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    where = f" ({path})" if path else ""
    print(f"calibrated this machine{where}" if fresh else f"this machine's calibration{where}", file=sys.stderr)
    return Curves(record)


def _layout(name: str, config: Any) -> Any:
    """The layout `name` spells; one that names no HSDP group under ZeRO takes an override's train.zero_shard."""
    from pjax.plan.layouts import Layout, with_config_shard

    try:
        return with_config_shard(Layout.parse(name), config)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _progress(total: int):
    from tqdm import tqdm

    bar = tqdm(total=total, desc="compile", unit="layout", file=sys.stderr, dynamic_ncols=True)

    def step() -> None:
        bar.update(1)
        if bar.n >= bar.total:
            bar.close()
    return step


def _report(result: Any, args: Any, backend: str) -> str:
    from pjax.plan.gpu_target import SPECS, unavailable_reason
    from pjax.plan.report import table, verdict

    source = f"memory and collectives compiled by XLA:{backend.upper()}, attention {result.profile.attention}"
    other = {c.layout: c.compiled["attention"] for c in result.compiled
             if (c.compiled or {}).get("attention") not in (None, result.profile.attention)}
    if other:  # cp strategies with their own kernel, or cuDNN's failing to compile (pjax.cudnn_fallback)
        source += f" ({len(other)} of {len(result.compiled)} with {', '.join(sorted(set(other.values())))})"
    if backend == "cpu" and args.device_kind in SPECS:
        why = unavailable_reason() or "as --xla cpu asks"
        source += f" on fake CPU devices, not {args.device_kind}'s compiler: {why}"
    return "\n".join([source, table(result, args.top), "", verdict(result, args.config)])


def _as_json(result: Any, args: Any) -> dict:
    from pjax.plan.report import as_json

    return as_json(result, args.config)


if __name__ == "__main__":
    sys.exit(main())
