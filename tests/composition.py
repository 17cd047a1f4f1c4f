"""The composition matrix from the rules (`pjax.compose`) and the tests: which test proves each composing pair.

A test names the pairs it proves with `@pytest.mark.proves("zb_h1+sp", ...)` (on the function, or on a
`pytest.param`); `tests/test_composition.py`'s runs prove the pairs inside each of its feature sets. Both are read
from the source (no import, no collection); a mark holds only where the test's own runs exercise both features
(`tests/proofs.py` fails the test otherwise). `python tests/composition.py` writes the matrix into README.md and
docs/composition.md, and draws a new sample of triples for the suite to run (TRIPLES_FILE);
`tests/test_composition.py` fails when either file differs from what this module renders."""
from __future__ import annotations

import ast
import itertools
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pjax import compose  # noqa: E402

TESTS = Path(__file__).resolve().parent
README, GUIDE = ROOT / "README.md", ROOT / "docs" / "composition.md"
BEGIN, END = "<!-- composition matrix: python tests/composition.py writes it -->", "<!-- end of composition matrix -->"
# Pairs the rules accept and no test proves yet: shown as such, and test_composition.py fails when this list is
# not exactly those (a new proof drops a pair from it; a lifted refusal must add a proof or a pair here).
UNPROVEN: frozenset[tuple[str, str]] = frozenset()
RUNS_TEST = "tests/test_composition.py::test_features_together_equal_their_reference"
TRIPLES_FILE = TESTS / "triples.json"  # the triples the suite runs, drawn anew by each `python tests/composition.py`
TRIPLES = 3


def pair(a: str, b: str) -> tuple[str, str]:
    """The pair in FEATURES' order."""
    order = list(compose.BY_NAME)
    return tuple(sorted((a, b), key=order.index))  # type: ignore[return-value]


def marked_proofs() -> dict[tuple[str, str], list[str]]:
    """Pair -> the tests (file::function) whose `proves` marks name it, read from every tests/test_*.py."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
                continue
            for mark in (n for d in node.decorator_list for n in ast.walk(d) if _is_proves(n)):
                for arg in (a for a in mark.args if isinstance(a, ast.Constant)):
                    a, _, b = arg.value.partition("+")
                    found.setdefault(pair(a, b), []).append(f"tests/{path.name}::{node.name}")
    return found


def _is_proves(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "proves"


def recorded_triples() -> list[tuple[str, ...]]:
    """The triples TRIPLES_FILE holds (none before its first drawing)."""
    if not TRIPLES_FILE.exists():
        return []
    return [tuple(t) for t in json.loads(TRIPLES_FILE.read_text())["triples"]]


def draw_triples(cells: dict, seed: int, count: int = TRIPLES) -> list[tuple[str, ...]]:
    """`count` triples, drawn with `seed`, whose three pairs compose, whose run the rules accept, and which
    `test_composition.comparable` gives a reference."""
    from test_composition import comparable

    composing = {p for p, (cell, _) in cells.items() if cell.status == "composes"}
    candidates = [t for t in itertools.combinations(list(compose.BY_NAME), 3)
                  if all(pair(a, b) in composing for a, b in itertools.combinations(t, 2)) and comparable(t)]
    random.Random(seed).shuffle(candidates)
    return list(itertools.islice((t for t in candidates if compose.verdict(t).status == "composes"), count))


def run_proofs() -> dict[tuple[str, str], list[str]]:
    """Pair -> the runs of tests/test_composition.py that prove it (`proven_by_run`)."""
    from test_composition import RUNS, proven_by_run

    found: dict[tuple[str, str], list[str]] = {}
    for features in [*RUNS, *recorded_triples()]:
        for key in proven_by_run(features):
            found.setdefault(key, []).append(f"{RUNS_TEST}[{'-'.join(features)}]")
    return found


def matrix() -> dict[tuple[str, str], tuple[compose.Cell, list[str]]]:
    """Every pair: its verdict, and the tests that prove it."""
    proofs = marked_proofs()
    for key, tests in run_proofs().items():
        proofs.setdefault(key, []).extend(tests)
    return {(a, b): (compose.cell(a, b), proofs.get((a, b), [])) for a, b in compose.pairs()}


SYMBOLS = {"composes": "✓", "refused": "✗", "alternatives": "·", "unproven": "?"}


def symbol_matrix(cells: dict) -> list[str]:
    """The symbol matrix docs/composition.md opens with, and its legend."""
    features = compose.FEATURES
    head = "| | " + " | ".join(f.label for f in features) + " |"
    rows = [head, "|---" * (len(features) + 1) + "|"]
    for a in features:
        marks = []
        for b in features:
            if a is b:
                marks.append("")
                continue
            cell, tests = cells[pair(a.name, b.name)]
            marks.append(SYMBOLS["unproven" if cell.status == "composes" and not tests else cell.status])
        rows.append(f"| **{a.label}** | " + " | ".join(marks) + " |")
    unproven = any(cell.status == "composes" and not tests for cell, tests in cells.values())
    legend = ("✓ composes, and a test on 8 CPU devices proves it equals one device (or its reference math); "
              + ("? the rules accept it and no test proves it yet; " if unproven else "")
              + "✗ refused with one line; · two choices of one setting.")
    return [*rows, "", legend]


def readme_block(cells: dict) -> str:
    """README.md's summary of the matrix, with its link."""
    counts = {status: sum(cell.status == status for cell, _ in cells.values())
              for status in ("composes", "refused", "alternatives")}
    proven = sum(cell.status == "composes" and bool(tests) for cell, tests in cells.values())
    line = (f"Of the {len(cells)} pairs of pjax's {len(compose.FEATURES)} features, {counts['composes']} compose "
            f"({proven} proven by a test on 8 CPU devices), {counts['refused']} are refused with one line and "
            f"{counts['alternatives']} are two choices of one setting: the matrix, each cell's test or line, and "
            f"the triples the suite runs are in [docs/composition.md](docs/composition.md).")
    return "\n".join([BEGIN, "", line, "", END])


def guide(cells: dict) -> str:
    """docs/composition.md: every pair, with the test that proves it or the line that refuses it."""
    lines = ["# Which features compose", "",
             "Generated by `python tests/composition.py` from the rules `pjax.train` checks (`pjax/compose.py`) "
             "and the tests that prove each pair; `tests/test_composition.py` fails when it is out of date. Ask "
             "about one pair with `python -m pjax.compose zb_h1 ring`.", "",
             "A pair's run is the `debug` model (4 layers, 8 heads) on a mesh of 2 along each axis the pair needs; "
             "the features and their overrides are `pjax/compose.py`'s `FEATURES`. A test's claim counts only where "
             "one of its own runs has both features on in a form that exercises them (ZeRO at dp >= 2, a pipeline at "
             "pp >= 2, experts over 2 or more devices, ...: `pjax.compose.exercised`, held by `tests/proofs.py`).",
             "", *symbol_matrix(cells), "",
             "## Refused", "", "| pair | the line `pjax.train` prints |", "|---|---|"]
    label = {f.name: f.label for f in compose.FEATURES}
    for (a, b), (cell, _) in cells.items():
        if cell.status == "refused":
            lines.append(f"| {label[a]} + {label[b]} | {cell.line} |")
    lines += ["", "## Proven", "", "| pair | tests |", "|---|---|"]
    for (a, b), (cell, tests) in cells.items():
        if cell.status == "composes" and tests:
            lines.append(f"| {label[a]} + {label[b]} | {'<br>'.join(f'`{t}`' for t in sorted(set(tests)))} |")
    waiting = [f"{label[a]} + {label[b]}" for (a, b), (cell, tests) in cells.items()
               if cell.status == "composes" and not tests]
    lines += ["", "## Accepted, not yet proven", "", ("The rules accept these and no test proves them yet: "
                                                   + ", ".join(waiting) + ".") if waiting else
              "None: a test proves every pair the rules accept.", ""]
    alternatives = [f"{label[a]} / {label[b]}" for (a, b), (cell, _) in cells.items() if cell.status == "alternatives"]
    lines += ["", "## Alternatives", "", "Two choices of one setting: " + ", ".join(alternatives) + ".", ""]
    drawn = json.loads(TRIPLES_FILE.read_text())
    lines += ["", "## Beyond pairs", "", "Pairs that compose do not make every triple compose: `python -m pjax.compose "
              "ring maml fp8` asks the rules about any set. Each `python tests/composition.py` draws "
              f"{TRIPLES} triples the rules accept (seed {drawn['seed']}) for `{RUNS_TEST}` to run against "
              "their references, besides its fixed runs:", "",
              *(f"- {' + '.join(label[f] for f in t)}" for t in recorded_triples()), ""]
    return "\n".join(lines)


def with_block(text: str, block: str) -> str:
    """README.md's text with the block between BEGIN and END replaced."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]


if __name__ == "__main__":
    from pjax.platforms import start_platforms

    start_platforms()  # JAX on the CPU where the CUDA plugin finds no GPU: no plugin traceback
    sys.path.insert(0, str(TESTS))
    import time

    seed = time.time_ns() % 2**32
    TRIPLES_FILE.write_text(json.dumps({"seed": seed, "triples": draw_triples(matrix(), seed)}) + "\n")
    cells = matrix()
    README.write_text(with_block(README.read_text(), readme_block(cells)))
    GUIDE.parent.mkdir(exist_ok=True)
    GUIDE.write_text(guide(cells))
    print(f"wrote {README} and {GUIDE}")
