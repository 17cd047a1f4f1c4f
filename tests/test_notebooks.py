"""The notebooks run top to bottom, each in a fresh kernel on 8 forced CPU devices, and end in
their own checks (asserts that the parallel result equals the single-device one). They are
stored without outputs so that their diffs show only code and prose, and they share one setup
cell (but for the pip extras each needs) so that a fix to it reaches all of them."""
import ast
import importlib.metadata
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
EXTRAS_LINE = re.compile(r"^EXTRAS = (.*?)  #.*$", re.MULTILINE)  # the setup cell's one per-notebook line
PATHS = sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))
_spec = importlib.util.spec_from_file_location("notebooks_render", NOTEBOOKS / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def test_there_is_a_notebook_for_each_idea_and_the_readme_shows_each():
    readme = (NOTEBOOKS / "README.md").read_text()
    assert [p.name[:2] for p in PATHS] == [f"{k:02d}" for k in range(8)], PATHS
    for path in PATHS:
        assert f"({path.name})" in readme, f"notebooks/README.md does not link {path.name}"
        figures = sorted((NOTEBOOKS / "figures").glob(f"{path.stem}-*.png"))
        for figure in figures:
            assert f"figures/{figure.name}" in readme, f"notebooks/README.md does not show {figure.name}"


def test_notebooks_are_stored_without_outputs_and_share_the_setup_cell():
    setups = set()
    for path in PATHS:
        code = [c for c in cells(path) if c["cell_type"] == "code"]
        for c in code:
            assert not c["outputs"] and c["execution_count"] is None, f"{path.name}: outputs are stored"
        setups.add(EXTRAS_LINE.sub("EXTRAS = ...", "".join(code[0]["source"])))
        assert "jax_num_cpu_devices" in "".join(code[0]["source"]), f"{path.name}: the first code cell is not the setup"
        assert "assert" in "".join(code[-1]["source"]), f"{path.name}: the last cell checks nothing"
    assert len(setups) == 1, "the notebooks' setup cells differ"


def _distribution(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_setup_cell_installs_what_the_notebook_imports(path):
    """On Colab nothing but the setup cell installs: every module a notebook imports is the
    standard library's, pjax's own, a dependency of pjax, or brought by the extras its setup cell
    names (and those extras are pyproject.toml's, listing those modules' distributions)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    code = [c for c in cells(path) if c["cell_type"] == "code"]
    extras = ast.literal_eval(EXTRAS_LINE.search("".join(code[0]["source"])).group(1))
    distributions = importlib.metadata.packages_distributions()
    provided = {_distribution(r) for r in project["dependencies"]}
    for extra, modules in extras.items():
        listed = {_distribution(r) for r in project["optional-dependencies"][extra]}
        for module in modules:
            assert {_distribution(d) for d in distributions.get(module, [module])} & listed, (extra, module)
        provided |= listed
    own = {"pjax", "mesh", "models"}
    extra_modules = {m for modules in extras.values() for m in modules}
    for cell in code:
        source = "\n".join(line for line in "".join(cell["source"]).splitlines() if not line.startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for top in (name.split(".")[0] for name in names):
                if top in sys.stdlib_module_names or top in own or top in extra_modules:
                    continue
                found = {_distribution(d) for d in distributions.get(top, [])}
                assert found & provided, f"{path.name} imports {top}, which neither pjax nor its setup cell installs"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs_and_its_checks_pass(path):
    notebook = render.execute(path)
    last = "".join(output.get("text", "") for output in notebook.cells[-1].outputs)
    assert "all checks passed" in last, last
