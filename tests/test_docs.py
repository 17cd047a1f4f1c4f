"""The docs are checked cheaply (no JAX compile, seconds): every relative link and image resolves (an
anchor into a .md file names one of its headings, by GitHub's rule); every `python -m pjax.X ...` command
shown in a fenced block of README.md and docs/ parses with that module's own argument parser (its options
exist, its `section.key=value` overrides name config keys and read as their types, a bare `--config NAME`
is a shipped config); every config key shown in backticks (`section.key`, `section.key=value`) exists.
Each test reports all its failures at once, as file:line."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import re
import shlex
import urllib.parse
from pathlib import Path
from typing import Iterator

import pytest

from mesh.errors import ConfigError
from pjax.config_io import SECTIONS, _coerce, available_configs, parse_override

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted({REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "benchmarks" / "README.md",
               REPO / "notebooks" / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("benchmarks/log/*.md")})
COMMAND_DOCS = sorted({REPO / "README.md", *REPO.glob("docs/*.md")})
KEYS = {section: {f.name for f in dataclasses.fields(cls)} for section, cls in SECTIONS.items()}


# --- Reading markdown ---

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def lines_outside_fences(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the prose: fenced code blocks left out."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None and match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
            fence = None
        elif fence is None:
            yield number, line


def fenced_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) inside fenced code blocks, a line ending in `\\` joined to the next (at the first's number)."""
    fence, pending, start = None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
            continue
        if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) and not line.strip(fence[0]).strip():
            fence = None
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def without_code_spans(line: str) -> str:
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]+(?:\([^\s()]*\)[^\s()]*)*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every inline link and image, reference definition and HTML a/img, outside code."""
    for number, line in lines_outside_fences(text):
        prose = without_code_spans(line)
        for pattern in (LINK, REFERENCE, HTML_LINK):
            for match in pattern.finditer(prose):
                yield number, match.group(1).strip("<>")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered, lowercased, punctuation but `-` and `_` dropped,
    each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags render as nothing
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors GitHub makes for a markdown file: a slug per heading (the second of a name `-1`, the next
    `-2`), and the HTML ids and names the file sets itself."""
    seen: dict[str, int] = {}
    found = set()
    previous = ""
    for _, line in lines_outside_fences(text):
        heading = None
        atx = re.match(r"^ {0,3}#{1,6}(?:\s+(.*?))?(?:\s+#+)?\s*$", line)
        if atx:
            heading = atx.group(1) or ""
        elif re.match(r"^ {0,3}(=+|-+)\s*$", line) and previous.strip() and not previous.lstrip().startswith(("|", "-", "*", ">")):
            heading = previous  # a setext heading: the line above underlined
        if heading is not None:
            base = slug(heading)
            name = base if base not in seen else f"{base}-{seen[base]}"
            seen[base] = seen.get(base, 0) + 1
            found.add(name)
        for match in re.finditer(r"\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", line):
            found.add(match.group(1))
        previous = line
    return found


def link_problem(doc: Path, target: str) -> str | None:
    """Why `target`, linked from `doc`, does not resolve (None where it does, or is not a relative link)."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
        return None  # http(s), mailto and the like
    path, _, anchor = target.partition("#")
    path = urllib.parse.unquote(path.split("?")[0])
    file = doc if not path else Path(os.path.normpath(REPO / path.lstrip("/") if path.startswith("/") else doc.parent / path))
    if not file.exists():
        return f"links {target}, but {file.relative_to(REPO) if file.is_relative_to(REPO) else file} does not exist"
    if anchor and file.suffix == ".md" and file.is_file():
        if urllib.parse.unquote(anchor) not in anchors(file.read_text(encoding="utf-8")):
            return f"links {target}, but {file.name} has no heading whose anchor is #{anchor}"
    return None


# --- Commands ---

STOP = {"|", "||", "&&", ";", "&", ";;", "(", ")"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"^(?:.*/)?python(?:\d+(?:\.\d+)?)?$")


def pjax_commands(line: str) -> list[tuple[str, list[str]]]:
    """Each `python -m pjax.X args` in one shell line, as (module, argv): split as the shell would, each
    command ending at a pipe, `&&`, `;`, a redirection or a comment, `$VAR`s read as 1."""
    lexer = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: not a shell line
        return []
    commands, current = [], []
    for token in tokens + [";"]:
        if token in STOP:
            commands.append(current)
            current = []
        else:
            current.append(token)
    found = []
    for command in commands:
        for i in range(len(command) - 2):
            if PYTHON.match(command[i]) and command[i + 1] == "-m" and re.match(r"^pjax(\.|$)", command[i + 2]):
                argv = []
                for token in command[i + 3:]:
                    if re.match(r"^\d*[<>]", token):  # a redirection ends the arguments
                        if argv and argv[-1].isdigit():
                            argv.pop()
                        break
                    argv.append(re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "1", token))
                found.append((command[i + 2], argv))
                break
    return found


def cli_parser(module: str):
    """The argument parser of `python -m module`: its `parser()` (a package's, in its __main__)."""
    mod = importlib.import_module(module)
    if hasattr(mod, "__path__"):
        mod = importlib.import_module(f"{module}.__main__")
    if not hasattr(mod, "parser"):
        raise LookupError(f"{module} has no parser() to check its command line with")
    return mod.parser()


def override_problem(item: str) -> str | None:
    """Why a `section.key=value` override would be refused (None where pjax.train takes it)."""
    try:
        section, key, value = parse_override(item)
        if section not in SECTIONS:
            return f"{item}: no config section {section!r}"
        _coerce(section, key, value, SECTIONS[section], f"override '{item}'")
    except ConfigError as e:
        return str(e)
    return None


def command_problems(module: str, argv: list[str]) -> list[str]:
    """Why `python -m module argv` would not start: its parser's error, an override no config key takes, or a
    bare --config name that is no shipped config."""
    try:
        parser = cli_parser(module)
    except (ImportError, LookupError) as e:
        return [f"python -m {module}: {e}"]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_intermixed_args(argv) if module == "pjax.train" else parser.parse_args(argv)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            return []
        return [f"python -m {module} {shlex.join(argv)}: {stderr.getvalue().strip().splitlines()[-1]}"]
    problems = [f"python -m {module}: {problem}" for item in getattr(args, "overrides", None) or []
                if (problem := override_problem(item))]
    config = getattr(args, "config", None)
    if isinstance(config, str) and "/" not in config and "." not in config and config not in available_configs():
        problems.append(f"python -m {module}: --config {config} is no shipped config ({', '.join(available_configs())})")
    return problems


# --- Config keys in prose ---

KEY = re.compile(r"^([a-z]+)\.([a-z][a-z0-9_]*)(?:=(.*))?$")  # keys are lower-case: `moe.Gemms` and `moe._x` are code
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "txt", "toml", "sh", "ipynb", "png", "svg", "csv", "parquet",
                 "safetensors", "bin", "pt", "npz", "npy", "log", "html", "zip", "tar", "gz"}  # `model.safetensors`: a file


def config_keys(line: str) -> Iterator[str]:
    """The `section.key` of each code span (or word of one) naming a config section: `mesh.tp=2`, `train.zero`."""
    for match in CODE_SPAN.finditer(line):
        for word in match.group(2).split():
            key = KEY.match(word.strip(",;"))
            if key and key.group(1) in KEYS and key.group(2) not in FILE_SUFFIXES and not _is_module(*key.group(1, 2)):
                yield f"{key.group(1)}.{key.group(2)}"


def _is_module(package: str, name: str) -> bool:
    """`mesh.errors` is a module of the mesh package, not a key of the mesh section."""
    return (REPO / package / f"{name}.py").exists() or (REPO / package / name).is_dir()


def key_problem(dotted: str) -> str | None:
    section, key = dotted.split(".")
    return None if key in KEYS[section] else f"`{dotted}`: {section} has no key {key}"


# --- The checks on the docs ---

def _where(doc: Path, number: int) -> str:
    return f"{doc.relative_to(REPO)}:{number}"


def test_every_relative_link_resolves():
    failures = [f"{_where(doc, number)}: {problem}" for doc in DOCS
                for number, target in links(doc.read_text(encoding="utf-8"))
                if (problem := link_problem(doc, target))]
    assert not failures, f"{len(failures)} links do not resolve:\n" + "\n".join(failures)


def test_every_pjax_command_shown_parses():
    failures, checked = [], 0
    for doc in COMMAND_DOCS:
        for number, line in fenced_lines(doc.read_text(encoding="utf-8")):
            for module, argv in pjax_commands(line):
                checked += 1
                failures += [f"{_where(doc, number)}: {problem}" for problem in command_problems(module, argv)]
    assert not failures, f"{len(failures)} of {checked} commands do not parse:\n" + "\n".join(failures)


def test_every_config_key_shown_exists():
    failures = [f"{_where(doc, number)}: {problem}" for doc in DOCS
                for number, line in lines_outside_fences(doc.read_text(encoding="utf-8"))
                for dotted in config_keys(line) if (problem := key_problem(dotted))]
    assert not failures, f"{len(failures)} config keys do not exist:\n" + "\n".join(failures)


# --- The checks can fail: their pieces on small strings ---

def test_slugs_follow_githubs_rule():
    assert slug("Pick a layout (`pjax.plan`)") == "pick-a-layout-pjaxplan"
    assert slug("[0 · The mesh](00_mesh.ipynb)") == "0--the-mesh"
    assert slug("train.grad_accum & ZeRO-3!") == "traingrad_accum--zero-3"
    text = "# Title\n\n## Data\n\n```\n# not a heading\n```\n\n## Data\n\nData\n----\n<a id=\"here\"></a>\n"
    assert anchors(text) == {"title", "data", "data-1", "data-2", "here"}


def test_links_are_found_outside_code_and_checked(tmp_path, monkeypatch):
    text = ("See [the guide](docs/x.md#data) and ![a plot](plots/a.png \"title\"), [web](https://x.org),\n"
            "`[not](a_link.md)`\n```\n[nor](this.md)\n```\n[ref]: <other file.md>\n<img src=\"fig.png\">\n")
    assert list(links(text)) == [(1, "docs/x.md#data"), (1, "plots/a.png"), (1, "https://x.org"),
                                 (6, "other file.md"), (7, "fig.png")]
    doc = REPO / "README.md"
    assert link_problem(doc, "https://example.org/missing") is None
    assert link_problem(doc, "ARCHITECTURE.md") is None
    assert "does not exist" in link_problem(doc, "no_such_file.md")
    assert "no heading" in link_problem(doc, "#no-such-heading-anywhere")
    assert link_problem(doc, "pyproject.toml#L1") is None  # anchors into other files: the file only


def test_commands_are_split_like_the_shell_and_parsed():
    line = 'XLA_FLAGS="--a --b" python -m pjax.train --config debug mesh.tp=2 2>&1 | tee log  # a comment'
    assert pjax_commands(line) == [("pjax.train", ["--config", "debug", "mesh.tp=2"])]
    assert pjax_commands("pip install -e . && python3 -m pjax.plot runs/debug; python -m pytest -q") == \
        [("pjax.plot", ["runs/debug"])]
    assert pjax_commands("srun python -m pjax.train --process_id $SLURM_PROCID") == \
        [("pjax.train", ["--process_id", "1"])]
    text = "```bash\npython -m pjax.eval --hf DIR \\\n  --text t.txt\n```\npython -m pjax.train outside\n"
    assert list(fenced_lines(text)) == [(2, "python -m pjax.eval --hf DIR    --text t.txt")]
    assert command_problems("pjax.train", ["mesh.tp=2", "--no_progress"]) == []
    assert command_problems("pjax.plan", ["--config", "debug", "--devices", "8", "--device-kind", "cpu"]) == []
    assert command_problems("pjax.export", ["--checkpoint", "a", "--out", "b"]) == []
    assert command_problems("pjax.train", ["--help"]) == []
    assert "--no_such_flag" in command_problems("pjax.train", ["--no_such_flag"])[0]
    assert "required" in command_problems("pjax.plan", ["--config", "debug"])[0]
    assert "no_such_key" in command_problems("pjax.train", ["train.no_such_key=1"])[0]
    assert command_problems("pjax.train", ["train.steps=many"])  # the value is not the key's type
    assert "no shipped config" in command_problems("pjax.eval", ["--hf", "x", "--config", "nosuchconfig"])[0]
    assert command_problems("pjax.train", ["--config", "my/own.yaml"]) == []
    assert "no parser()" in command_problems("pjax.config", [])[0]
    assert "No module" in command_problems("pjax.no_such_module", [])[0]


@pytest.mark.parametrize("module", ["pjax.train", "pjax.plan", "pjax.plan.calibrate", "pjax.plan.step_pairs",
                                    "pjax.eval", "pjax.export", "pjax.plot", "pjax.compose", "pjax.assets.train_bpe"])
def test_every_command_line_has_a_parser_to_check(module):
    assert cli_parser(module).prog == f"python -m {module}"


def test_config_keys_in_code_spans():
    line = ("set `mesh.tp=2`, `train.zero`, `mesh.errors`, `jax.jit`, `model.nonsense` and `cfg.train.lr`; "
            "`mesh.dp=2 train.nope=1`, `train.py`, `moe.Gemms`, `model.safetensors`")
    assert list(config_keys(line)) == ["mesh.tp", "train.zero", "model.nonsense", "mesh.dp", "train.nope"]
    assert key_problem("train.zero") is None and key_problem("model.num_hidden_layers") is None
    assert "no key nonsense" in key_problem("model.nonsense")
