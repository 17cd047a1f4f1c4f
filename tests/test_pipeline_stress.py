"""No accepted pipeline layout hangs: layouts with collectives inside their stages (tp, cp, SP)
and more micro-batches than stages run to the end under a timeout, each in a process sized as
`pjax.train` sizes it. Before the fix, dp2 x pp2 x tp2 at 8 micro-batches aborted in XLA:CPU's
collective rendezvous ("Expected 8 threads to join ... only 7 arrived")."""
import json
import os
import subprocess
import sys

from hf_helpers import REPO

TIMEOUT_S = 600  # a hang ends in XLA's 40 s rendezvous abort or here, never in a stuck suite


def _run(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_the_layout_that_deadlocked_trains(tmp_path):
    """The reported command, as a user runs it (pjax.train sizes the thread pool itself)."""
    done = _run(["-m", "pjax.train", "--no_progress", "mesh.dp=2", "mesh.tp=2", "mesh.pp=2", "pipeline.schedule=1f1b",
                 "model.num_hidden_layers=8", "train.grad_accum=8", "model.hidden_size=128",
                 "model.intermediate_size=256", "model.num_attention_heads=8", "model.num_key_value_heads=4",
                 "train.seq_len=128", "train.batch_size=16", "train.dtype=float32", "train.steps=2",
                 "log.every=1", "log.eval_every=0", f"log.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2]


def test_pipeline_layouts_with_more_micro_batches_than_stages_finish_and_equal_one_device(tmp_path):
    done = _run([str(REPO / "tests" / "pipeline_stress.py")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ran = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(ran) == 4 and all(r["threads"] == "16" for r in ran), done.stdout
