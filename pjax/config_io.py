"""Reading and writing run configs: YAML files plus `section.key=value` command-line overrides, each value
checked against its dataclass field's type. `dump_config` writes the resolved config back, so a run
directory records exactly what ran and `load_config` can replay it."""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Sequence

import yaml

from mesh.errors import ConfigError, cut, first_line, listed, shown
from pjax import assets
from pjax.config import Config

CONFIG_DIR = assets.CONFIGS
DEFAULT_CONFIG = "debug"

# section name -> its dataclass, in the order the YAML is written.
SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, except that `3e-4` is a float (YAML 1.1 wants a '.'; YAML 1.2 and users don't)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def available_configs() -> list[str]:
    """Names of the configs shipped in `pjax/assets/configs/` (without `.yaml`)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config_path(path: str | None) -> Path:
    """A config file for `path`: a file here or among the shipped ones, or a shipped config's bare name."""
    if path is None:
        return CONFIG_DIR / f"{DEFAULT_CONFIG}.yaml"
    given = Path(path)
    found = assets.locate(path)
    if found is not None and found.is_file():
        return found
    if given.parent == Path("."):  # a bare name such as 'picotron-cpu' or 'picotron-cpu.yaml'
        for candidate in (CONFIG_DIR / given.name, CONFIG_DIR / f"{given.name}.yaml"):
            if candidate.is_file():
                return candidate
    room = max(60, 145 - len(str(path)))  # the names that fit the line
    raise ConfigError(f"config file '{path}' not found; available configs: {listed(available_configs(), room)}.")


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config (default: the shipped `debug`) and apply `section.key=value` overrides."""
    file = resolve_config_path(path)
    text = _read_text(file)
    try:
        document = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file '{file}' is not valid YAML: {problem}{where}.") from None
    except ValueError as e:  # PyYAML builds ints with int(): Python refuses over 4,300 digits
        raise ConfigError(f"config file '{file}' {_unreadable_number(e)}") from None
    return config_from_dict(document, overrides, source=f"config file '{file}'")


def _read_text(file: Path) -> str:
    """The config file's text, which YAML requires to be UTF-8 (whatever the machine's locale says)."""
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{file}' is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}); save it as UTF-8.") from None


def _unreadable_number(error: ValueError) -> str:
    """The end of a one-line error for a value PyYAML could not build (an integer of over 4,300 digits)."""
    if "digits" in str(error):
        return "holds an integer of over 4,300 digits; write a sensible number."
    return f"holds a value that cannot be read ({first_line(error)}); fix or quote it."


def config_from_dict(document: Any, overrides: Sequence[str] = (), source: str = "config") -> Config:
    """Build a Config from a nested dict (as in a YAML file), then apply overrides."""
    if document is None:  # an empty file: all defaults
        document = {}
    if not isinstance(document, dict):
        raise ConfigError(
            f"{source} must be a mapping of sections (train:, model:, ...), got {_show(document, 30)}."
        )
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for section, body in document.items():
        cls = _section(section, source)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"config section '{section}' in {source} must be a mapping of keys, got {_show(body)}.")
        for key, value in body.items():
            values[section][key] = _coerce(section, key, value, cls, source)
    for item in overrides:
        section, key, value = parse_override(item)
        where = f"override '{cut(item)}'"
        values[section][key] = _coerce(section, key, value, _section(section, where), where)
    return Config(**{name: cls(**values[name]) for name, cls in SECTIONS.items()})


def named_keys(path: str | None, overrides: Sequence[str] = ()) -> set[str]:
    """The 'section.key's the user chose (config file and overrides): `pjax.fit` adapts only the others."""
    keys = set()
    if path is not None:
        document = yaml.load(_read_text(resolve_config_path(path)), Loader=_Loader)  # valid: load_config read it
        for section, body in (document or {}).items():
            keys.update(f"{section}.{key}" for key in (body or {}))
    for item in overrides:
        section, key, _ = parse_override(item)
        keys.add(f"{section}.{key}")
    return keys


def parse_override(item: str) -> tuple[str, str, Any]:
    """Split 'train.lr=3e-4' into ('train', 'lr', 0.0003); the value is read as YAML."""
    dotted, sep, text = item.partition("=")
    dotted = dotted.strip()
    if not sep or not dotted:
        raise ConfigError(f"override '{cut(item)}' must look like key=value, e.g. train.steps=50.")
    section, dot, key = dotted.partition(".")
    if not dot or not key or "." in key:
        raise ConfigError(f"override key '{cut(dotted)}' must be section.key, e.g. train.steps; valid sections: "
                          f"{', '.join(sorted(SECTIONS))}.")
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        raise ConfigError(f"override '{cut(item)}' has a value that is not valid YAML; quote it or fix it.") from None
    except ValueError as e:
        raise ConfigError(f"override '{cut(item)}' {_unreadable_number(e)}") from None
    return section, key, value


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config as nested plain dicts, every field resolved, tuples as lists (YAML's safe dumper and JSON)."""
    return {section: {key: list(value) if isinstance(value, tuple) else value for key, value in body.items()}
            for section, body in dataclasses.asdict(cfg).items()}


def dump_config(cfg: Config) -> str:
    """The config as YAML that `load_config` reads back into an equal Config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def _section(name: Any, source: str) -> type:
    if name in SECTIONS:
        return SECTIONS[name]
    guess = _did_you_mean(str(name), SECTIONS)  # else the sections: one or the other fits a line
    raise ConfigError(f"unknown config section '{name}' in {source}" +
                      (f"{guess}." if guess else f"; valid sections: {', '.join(sorted(SECTIONS))}."))


def _coerce(section: str, key: Any, value: Any, cls: type, source: str) -> Any:
    """`value` checked against, and converted to (`_scalar`), the type of field `cls.key`."""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    if key not in fields:
        candidates = {f"{section}.{name}": name for name in fields}
        raise ConfigError(f"unknown key '{section}.{key}' in {source}{_did_you_mean(f'{section}.{key}', candidates)}; "
                          f"every {section} key: docs/training.md#every-config-key.")
    name = f"{section}.{key}"
    kind = hints[key]
    optional = type(None) in typing.get_args(kind) if isinstance(kind, types.UnionType) else False
    base = next(t for t in typing.get_args(kind) if t is not type(None)) if optional else kind
    if value is None and optional:
        return None
    if typing.get_origin(base) is tuple:  # a YAML list: `profile_steps: [3, 5]`, `remat_names: [q_proj, k_proj]`
        items = typing.get_args(base)
        any_length = items[-1] is Ellipsis
        if isinstance(value, (list, tuple)) and (any_length or len(value) == len(items)):
            kinds = [items[0]] * len(value) if any_length else items
            converted = tuple(_scalar(name, kind, item, source) for kind, item in zip(kinds, value))
            if _WRONG not in converted:
                return converted
        wanted = (f"a list of {_PLURAL[items[0]]} such as [a, b]" if any_length
                  else f"a list of {len(items)} {_PLURAL[items[0]]}")
        raise ConfigError(f"{name} must be {wanted}{' or null' if optional else ''}, got {_show(value)} (in {source}).")
    converted = _scalar(name, base, value, source)
    if converted is not _WRONG:
        return converted
    wanted = {bool: "true or false", int: "an integer", float: "a finite number",
              str: "a string (quote it if YAML reads it as something else)"}[base]
    raise ConfigError(f"{name} must be {wanted}{' or null' if optional else ''}, got {_show(value)} (in {source}).")


_WRONG = object()  # _scalar's answer for a value of another type
_PLURAL = {bool: "booleans", int: "integers", float: "finite numbers", str: "strings"}


def _scalar(name: str, base: type, value: Any, source: str) -> Any:
    """`value` as a `base` (int->float and integral float->int converted), or `_WRONG`."""
    if base is bool and isinstance(value, bool):
        return value
    if base is int and not isinstance(value, bool):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int):
            if abs(value) >= 2**63:  # every integer setting is a count, size or seed that numpy/JAX holds in 64 bits
                raise ConfigError(f"{name} is too large ({shown(value)}); use an integer below 2**63 (in {source}).")
            return value
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if base is str and isinstance(value, str):
        return value
    return _WRONG


def _did_you_mean(word: str, choices: Any) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _show(value: Any, limit: int = 80) -> str:
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__} {shown(value, limit)}"
    return shown(value, limit)
