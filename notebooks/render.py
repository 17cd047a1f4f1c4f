"""Run the notebooks and save their pictures into notebooks/figures/, for notebooks/README.md.

    python notebooks/render.py                  # every notebook
    python notebooks/render.py 03_context       # those whose name contains the word

The notebooks are stored without outputs (their diffs show only code and prose), so a reader of
the repository's web page sees the pictures through this folder. Figure k of notebook
`NN_name.ipynb` becomes `figures/NN_name-k.png`; the README links them. Needs `nbclient` and
`ipykernel` (the test extras).
"""
from __future__ import annotations

import base64
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def execute(path: Path, timeout: int = 900) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel, from its own folder (as Jupyter would);
    a cell that fails raises `nbclient.exceptions.CellExecutionError`."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return notebook


def pictures(notebook: nbformat.NotebookNode) -> list[bytes]:
    """The PNG images a run of the notebook displayed, in order."""
    return [base64.b64decode(output["data"]["image/png"])
            for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.get("outputs", []) if "image/png" in output.get("data", {})]


def main(words: list[str]) -> None:
    figures = HERE / "figures"
    figures.mkdir(exist_ok=True)
    for path in sorted(HERE.glob("[0-9]*.ipynb")):
        if words and not any(w in path.name for w in words):
            continue
        start = time.time()
        images = pictures(execute(path))
        for old in figures.glob(f"{path.stem}-*.png"):
            old.unlink()
        for k, png in enumerate(images, 1):
            (figures / f"{path.stem}-{k}.png").write_bytes(png)
        print(f"{path.name}: {len(images)} figures, {time.time() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
