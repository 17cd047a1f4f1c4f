"""The files pjax ships inside its package: the named configs (`configs/*.yaml`) and the default
text and tokenizers (`data/`, provenance and licences in `data/README.md`).

They are package data, found with `importlib.resources`, so a non-editable install
(`pip install .`, `pip install git+URL`) trains from any working directory, as a clone does.
A relative path a user gives (`data.path`, `data.tokenizer`, `--text`, `--config ...`) is read
from the working directory when it exists there, else from this folder: `data/prideprejudice.txt`
names the shipped book wherever pjax runs, and a file of your own at that path wins.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

# pip installs packages unpacked, so this is a real folder: tokenizers and the token cache's key
# (sizes, mtimes) need file paths, not the Traversable a zipped package would give.
ROOT: Path = Path(str(resources.files(__name__)))
CONFIGS: Path = ROOT / "configs"


def shipped(relative: str | Path) -> Path | None:
    """The shipped file or folder at `relative` (e.g. 'data/prideprejudice.txt'), or None."""
    relative = Path(relative)
    if relative.is_absolute() or relative.parts[:1] == ("~",):
        return None
    path = ROOT / relative
    return path if path.exists() else None


def locate(spec: str | Path) -> Path | None:
    """The existing file or folder `spec` names: from the working directory (`~` expanded), else
    among the shipped files; None when neither holds it."""
    given = Path(spec).expanduser()
    return given if given.exists() else shipped(spec)
