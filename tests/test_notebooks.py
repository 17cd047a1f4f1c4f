"""The notebooks run top to bottom, each in a fresh kernel on 8 forced CPU devices, and end in
their own checks (asserts that the parallel result equals the single-device one). They are
stored without outputs so that their diffs show only code and prose, and they share one setup
cell so that a fix to it reaches all of them."""
import importlib.util
import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))
_spec = importlib.util.spec_from_file_location("notebooks_render", NOTEBOOKS / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def test_there_is_a_notebook_for_each_idea_and_the_readme_shows_each():
    readme = (NOTEBOOKS / "README.md").read_text()
    assert [p.name[:2] for p in PATHS] == [f"{k:02d}" for k in range(7)], PATHS
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
        setups.add("".join(code[0]["source"]))
        assert "jax_num_cpu_devices" in "".join(code[0]["source"]), f"{path.name}: the first code cell is not the setup"
        assert "assert" in "".join(code[-1]["source"]), f"{path.name}: the last cell checks nothing"
    assert len(setups) == 1, "the notebooks' setup cells differ"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs_and_its_checks_pass(path):
    notebook = render.execute(path)
    last = "".join(output.get("text", "") for output in notebook.cells[-1].outputs)
    assert "all checks passed" in last, last
