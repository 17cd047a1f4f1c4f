"""Multi-process start-up (mesh/distributed.py): what `init_distributed` hands
`jax.distributed.initialize` under SLURM and with explicit flags, without connecting anywhere.
The two-process runs that do connect are in tests/test_train.py."""
from __future__ import annotations

import os

import jax
import pytest

from mesh import distributed
from mesh.distributed import first_slurm_host, init_distributed

SRUN = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "gpu[017-020]"}


@pytest.fixture
def joined(monkeypatch) -> list[dict]:
    """Environment cleared of SLURM; the arguments each `jax.distributed.initialize` call received."""
    for key in [k for k in os.environ if k.startswith("SLURM_")] + ["JAX_COORDINATOR_PORT"]:
        monkeypatch.delenv(key, raising=False)
    calls: list[dict] = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(distributed.jax.config, "update", lambda *args: None)  # this process's backend is up
    monkeypatch.setattr(distributed.watchdog, "start", lambda *args: None)  # nothing joined: nothing to watch
    return calls


def test_first_host_of_a_slurm_nodelist_is_jaxs():
    for nodes in ("n001", "n001,x2", "n[001-015],x2", "n[001,007-015],x2", "n[001]"):
        assert first_slurm_host(nodes) == "n001", nodes
    assert first_slurm_host("localhost") == "localhost" and first_slurm_host("127.0.0.1") == "127.0.0.1"


def test_srun_step_joins_at_the_first_node_on_jaxs_port_over_every_local_device(joined, monkeypatch):
    for key, value in SRUN.items():
        monkeypatch.setenv(key, value)
    assert init_distributed() == 4
    # 61440 + 4242 mod 4096; "deactivate" keeps JAX from narrowing the process to GPU SLURM_LOCALID
    # JAX's own timeouts (a fatal abort) fall after pjax's join deadline and watchdog (tests/test_processes.py)
    assert joined == [dict(coordinator_address="gpu017:61586", num_processes=4, process_id=3,
                           cluster_detection_method="deactivate", initialization_timeout=360,
                           heartbeat_timeout_seconds=100)]
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "12345")
    init_distributed()
    assert joined[-1]["coordinator_address"] == "gpu017:12345"


def test_explicit_flags_move_the_coordinator_but_must_match_slurms_tasks(joined, monkeypatch):
    for key, value in SRUN.items():
        monkeypatch.setenv(key, value)
    assert init_distributed("10.0.0.1:1234", 4, 3) == 4
    assert joined[-1]["coordinator_address"] == "10.0.0.1:1234"
    with pytest.raises(distributed.ConfigError, match="disagree with SLURM's SLURM_NTASKS=4 SLURM_PROCID=3"):
        init_distributed("10.0.0.1:1234", 4, 0)
    assert len(joined) == 1  # refused before connecting


def test_one_task_or_no_slurm_runs_alone(joined, monkeypatch):
    assert init_distributed() == 1
    for key, value in {**SRUN, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(key, value)
    assert init_distributed() == 1 and joined == []
