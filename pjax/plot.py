"""Plot a run's metrics.jsonl: loss (train and eval) and throughput against the step, as a two-panel PNG."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mesh.errors import ConfigError
from pjax.cli import ArgumentParser, run_main, writable_dir

Series = tuple[list[int], list[float]]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order."""
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; pass a run directory that holds metrics.jsonl.")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; pass the metrics.jsonl a pjax run wrote.") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the writer may be mid-line while training runs
                break
            raise ConfigError(f"{path}:{number} is not valid JSON; fix or delete that line.") from None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def series(records: list[dict[str, Any]], key: str) -> Series:
    """(steps, values) of the records that hold a finite number under `key` (`mfu` may be null)."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


def plot(records: list[dict[str, Any]], out: Path, title: str = "") -> None:
    """Write the two-panel figure: loss vs step (train, eval if present), tokens/s vs step."""
    train, evals = series(records, "loss"), series(records, "eval_loss")
    # The first logged interval's time includes compilation: its throughput would squash the axis.
    speed = series([r for r in records if not r.get("includes_compile")], "tokens_per_sec")
    if not train[0] and not evals[0]:
        raise ConfigError("no loss records to plot; metrics.jsonl needs lines with \"step\" and \"loss\" or \"eval_loss\".")
    # A bare Figure on the Agg canvas: no pyplot, so no GUI backend and no global figure state.
    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, speed_ax = fig.subplots(1, 2)
    if train[0]:
        loss_ax.plot(*train, label="train")
    if evals[0]:
        loss_ax.plot(*evals, "o-", label="eval")
    loss_ax.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    if speed[0]:
        speed_ax.plot(*speed, color="tab:green")
    speed_ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    speed_ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def parser() -> ArgumentParser:
    """The command line's parser (tests/test_docs.py parses the commands the docs show with it)."""
    ap = ArgumentParser(prog="python -m pjax.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    ap.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/metrics.png)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "metrics.png"

    def body() -> None:
        records = read_metrics(run_dir / "metrics.jsonl")
        writable_dir(str(out.parent), "--out")
        plot(records, out, title=str(run_dir))
        print(out)

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
