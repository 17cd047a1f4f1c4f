"""pjax/plot.py: metrics.jsonl -> a two-panel PNG; a missing file is a one-line error."""
from __future__ import annotations

import json

from pjax import plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run_dir, tail: str = "") -> None:
    lines = []
    for step in range(1, 21):
        lines.append({"step": step, "loss": 8.0 / step ** 0.3, "grad_norm": 1.0, "lr": 1e-3,
                      "tokens_per_sec": 1000.0 + step, "mfu": None, "step_time_s": 0.5,
                      **({"includes_compile": True} if step == 1 else {})})
        if step % 10 == 0:
            lines.append({"step": step, "eval_loss": 8.2 / step ** 0.3})
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n" + tail)


def test_plot_writes_png_with_train_and_eval_series(tmp_path, capsys):
    _write_metrics(tmp_path, tail='{"step": 21, "loss"')  # a line still being written is skipped
    records = plot.read_metrics(tmp_path / "metrics.jsonl")
    assert plot.series(records, "eval_loss")[0] == [10, 20]
    assert plot.series(records, "mfu") == ([], [])  # null values are left out, not plotted as 0
    assert plot.main([str(tmp_path)]) == 0
    png = (tmp_path / "metrics.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    assert capsys.readouterr().out.strip().endswith("metrics.png")


def test_plot_out_option_sets_the_path(tmp_path):
    _write_metrics(tmp_path)
    out = tmp_path / "figs" / "run.png"
    assert plot.main([str(tmp_path), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_missing_metrics_file_is_one_line_error_exit_2(tmp_path, capsys):
    assert plot.main([str(tmp_path / "no_run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "metrics.jsonl" in err[0]
