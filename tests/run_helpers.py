"""Helpers for tests that train through `pjax.train.train` and resume."""
from __future__ import annotations

import shutil
from pathlib import Path


def preempted_after(source: Path, target: Path, step: int) -> None:
    """`target` as the run in `source` would have been left had it stopped after `step`: its checkpoint steps up
    to `step` and its first `step` metrics lines, so a resume from there repeats what `source` did next."""
    later = lambda d, names: [n for n in names if n.isdigit() and int(n) > step] if d == str(source / "ckpt") else []  # noqa: E731
    shutil.copytree(source / "ckpt", target / "ckpt", ignore=later)
    lines = (source / "metrics.jsonl").read_text().splitlines()[:step]
    (target / "metrics.jsonl").write_text("\n".join(lines) + "\n")
