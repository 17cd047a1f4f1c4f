"""The files pjax ships as package data: named configs, the default text and tokenizers
(ARCHITECTURE.md, "What pjax ships is package data"). A user's relative path is read from the working
directory when it exists there, else from this folder."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

# A real folder (pip installs unpacked): tokenizers and the token cache's key need file paths.
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
    """The existing path `spec` names: in the working directory (`~` expanded), else shipped, else None."""
    given = Path(spec).expanduser()
    return given if given.exists() else shipped(spec)
