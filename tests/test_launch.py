"""The launch files a pod uses (launch/): the SLURM batch script and the Kubernetes Indexed Job, each run under a
faked environment as far as the command every process starts. Each process must derive the same coordinator and
its own index, and its command must be one `python -m pjax.train` accepts, with a config that loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from mesh import distributed
from pjax.config_io import load_config
from pjax.train import parse_args

ROOT = Path(__file__).resolve().parents[1]
# A `python` that records what it was started with: its arguments and the environment pjax's start-up reads.
RECORDER = """#!/bin/bash
"$REAL_PYTHON" - "$@" >> "$RECORD" <<'PY'
import json, os, sys
seen = {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "JAX_")) or k == "JOB_COMPLETION_INDEX"}
print(json.dumps({"argv": sys.argv[1:], "env": seen, "cwd": os.getcwd()}))
PY
"""
# srun inside a batch job: one task per node of the allocation, each with the step's variables, all at once.
SRUN = """#!/bin/bash
while [[ $1 == -* ]]; do shift; done
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_PROCID=$i SLURM_NTASKS=$SLURM_JOB_NUM_NODES SLURM_LOCALID=0 SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST "$@" &
done
wait
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _faked(tmp: Path, **tools: str) -> dict[str, str]:
    """An environment whose PATH starts with the recorder as `python` and `tools`, and a venv whose activate
    script puts them first again (both launch files activate one)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "python", RECORDER)
    for name, text in tools.items():
        _executable(bin_dir / name, text)
    activate = tmp / ".venv" / "bin" / "activate"
    activate.parent.mkdir(parents=True)
    activate.write_text(f'export PATH="{bin_dir}:$PATH"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_COORDINATOR"))}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "REAL_PYTHON": sys.executable,
            "RECORD": str(tmp / "record.jsonl")}


def _records(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "record.jsonl").read_text().splitlines()]


def _pjax_train(argv: list[str]):
    """The recorded command as `python -m pjax.train` parses it, and its config loaded with its overrides."""
    assert argv[:2] == ["-m", "pjax.train"], argv
    args = parse_args(argv[2:])
    return args, load_config(args.config, args.overrides)


def test_the_slurm_script_starts_one_process_per_node_that_agree_on_the_coordinator(tmp_path, monkeypatch):
    """sbatch's environment for 4 nodes, srun faked: 4 processes, each `slurm_process()` under its own variables
    naming the first node on JAX's port for the job, and its own index; checkpoints and metrics under the run
    directory, which every node sees."""
    env = {**_faked(tmp_path, srun=SRUN), "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "pjax", "SLURM_NTASKS": "4",
           "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu[017-020]",
           "SLURM_SUBMIT_DIR": str(ROOT), "VENV": str(tmp_path / ".venv"), "RUN_DIR": str(tmp_path / "run")}
    done = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), "train.steps=100"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    records = _records(tmp_path)
    assert len(records) == 4
    joined = set()
    for record in records:
        for key in [k for k in os.environ if k.startswith("SLURM_")]:
            monkeypatch.delenv(key)
        for key, value in record["env"].items():
            monkeypatch.setenv(key, value)
        coordinator, processes, index = distributed.slurm_process()
        assert (coordinator, processes) == (f"gpu017:{61440 + 4242 % 4096}", 4)
        joined.add(index)
        args, cfg = _pjax_train(record["argv"])
        assert (args.coordinator, args.num_processes, args.process_id) == (None, None, None)  # SLURM's alone
        assert cfg.train.steps == 100 and cfg.checkpoint.dir == str(tmp_path / "run" / "checkpoints")
        assert record["cwd"] == str(ROOT)
    assert joined == {0, 1, 2, 3}
    directives = (ROOT / "launch" / "slurm.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in directives  # one process per node, seeing all its GPUs


def test_the_kubernetes_job_names_pod_0_the_coordinator_and_each_pod_its_index(tmp_path):
    """Each pod's command run by bash with what the Job controller sets (JOB_COMPLETION_INDEX) and the container's
    env: the same --coordinator, pod 0's name under the headless Service on the port it opens, and
    --process_id 0..N-1 with --num_processes N = the Job's completions and parallelism."""
    service, job = yaml.safe_load_all((ROOT / "launch" / "k8s-indexed-job.yaml").read_text())
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert spec["completionMode"] == "Indexed" and pod["subdomain"] == service["metadata"]["name"]
    env = _faked(tmp_path)
    env.update({item["name"]: item["value"] for item in container["env"]})
    for index in range(spec["completions"]):
        done = subprocess.run([*container["command"], *container["args"]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60, env={**env, "JOB_COMPLETION_INDEX": str(index)})
        assert done.returncode == 0, done.stderr
    records = _records(tmp_path)
    port = service["spec"]["ports"][0]["port"]
    assert container["ports"][0]["containerPort"] == port
    ids = []
    for record in records:
        args, cfg = _pjax_train(record["argv"])
        distributed.check_process_flags(args.coordinator, args.num_processes, args.process_id)
        assert args.coordinator == f"{job['metadata']['name']}-0.{pod['subdomain']}:{port}"
        assert args.num_processes == spec["completions"] == spec["parallelism"]
        ids.append(args.process_id)
        assert cfg.checkpoint.dir.startswith("/shared/")  # the volume every pod mounts
    assert sorted(ids) == list(range(spec["completions"]))
    assert any(v["mountPath"] == "/shared" for v in container["volumeMounts"])
