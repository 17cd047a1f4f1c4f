"""The composition matrix from the rules (`pjax.compose`) and the tests: which test proves each composing pair.

A test names the pairs it proves with `@pytest.mark.proves("zb_h1+sp", ...)` (on the function, or on a
`pytest.param`); `tests/test_composition.py`'s runs prove the pairs inside each of its feature sets. Both are read
from the source (no import, no collection). `python tests/composition.py` writes the matrix into README.md and
docs/composition.md; `tests/test_composition.py` fails when either differs from what this module renders."""
from __future__ import annotations

import ast
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
UNPROVEN: frozenset[tuple[str, str]] = frozenset({
    ("1f1b", "int8_reduce"), ("zb_v", "reptile"), ("ring", "sp"), ("ring", "reptile"), ("ring", "fomaml"),
    ("all_gather", "fomaml"), ("all_gather", "maml"), ("ulysses", "reptile"), ("sp", "reptile"), ("moe", "bf16_reduce"),
    ("moe", "powersgd"), ("moe", "fp8"), ("bf16_reduce", "diloco"), ("bf16_reduce", "streaming"), ("bf16_reduce",
    "curriculum"), ("bf16_reduce", "fp8"), ("int8_reduce", "streaming"), ("int8_reduce", "curriculum"), ("int8_reduce",
    "fp8"), ("powersgd", "diloco"), ("powersgd", "curriculum"), ("powersgd", "fp8"), ("powersgd", "loss_chunk"),
    ("diloco", "curriculum"), ("diloco", "fp8"), ("streaming", "curriculum"), ("streaming", "fp8"), ("reptile", "fp8"),
    ("fomaml", "fp8"), ("maml", "fp8"), ("maml", "remat_full"), ("maml", "loss_chunk"), ("curriculum", "fp8")})
RUNS_TEST = "tests/test_composition.py::test_features_together_equal_their_reference"


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
                for arg in mark.args:
                    a, _, b = arg.value.partition("+")
                    found.setdefault(pair(a, b), []).append(f"tests/{path.name}::{node.name}")
    return found


def _is_proves(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "proves"


def run_proofs() -> dict[tuple[str, str], list[str]]:
    """Pair -> the runs of tests/test_composition.py that prove it (`proven_by_run`)."""
    from test_composition import RUNS, proven_by_run

    found: dict[tuple[str, str], list[str]] = {}
    for features in RUNS:
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


def readme_block(cells: dict) -> str:
    """The symbol matrix README.md shows."""
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
    legend = ("✓ composes, and a test on 8 CPU devices proves it equals one device (or its reference math); ? the "
              "rules accept it and no test proves it yet; ✗ refused with one line; · two choices of one setting. Each "
              "cell's test or line: "
              "[docs/composition.md](docs/composition.md).")
    return "\n".join([BEGIN, "", *rows, "", legend, "", END])


def guide(cells: dict) -> str:
    """docs/composition.md: every pair, with the test that proves it or the line that refuses it."""
    lines = ["# Which features compose", "",
             "Generated by `python tests/composition.py` from the rules `pjax.train` checks (`pjax/compose.py`) "
             "and the tests that prove each pair; `tests/test_composition.py` fails when it is out of date. Ask "
             "about one pair with `python -m pjax.compose zb_h1 ring`.", "",
             "A pair's run is the `debug` model (4 layers, 8 heads) on a mesh of 2 along each axis the pair needs; "
             "the features and their overrides are `pjax/compose.py`'s `FEATURES`.", "",
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
    lines += ["", "## Accepted, not yet proven", "", "The rules accept these and no test proves them yet: "
              + ", ".join(waiting) + ".", ""]
    alternatives = [f"{label[a]} / {label[b]}" for (a, b), (cell, _) in cells.items() if cell.status == "alternatives"]
    lines += ["", "## Alternatives", "", "Two choices of one setting: " + ", ".join(alternatives) + ".", ""]
    return "\n".join(lines)


def with_block(text: str, block: str) -> str:
    """README.md's text with the block between BEGIN and END replaced."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))
    cells = matrix()
    README.write_text(with_block(README.read_text(), readme_block(cells)))
    GUIDE.parent.mkdir(exist_ok=True)
    GUIDE.write_text(guide(cells))
    print(f"wrote {README} and {GUIDE}")
