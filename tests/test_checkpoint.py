"""pjax/checkpoint/checkpointer.py: exact resume, restore onto other meshes, atomic and preemptible saves, HF export."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from mesh.errors import ConfigError
from mesh.mesh import MeshConfig, make_mesh
from models import llama
from pjax import assets
from pjax.checkpoint.checkpointer import Checkpointer, layer_rows, saving_in_progress
from pjax.config import PipelineConfig
from pjax.config_io import load_config
from pjax.data import build_data
from pjax.checkpoint.dirlock import LOCK_NAME
from pjax.step import build_trainer
from pjax.train import train

REPO = Path(__file__).resolve().parents[1]
# The debug model on one device with small batches: fast to compile and to step on a busy CPU.
SMALL = ["mesh.dp=1", "mesh.tp=1", "train.batch_size=8", "train.seq_len=64", "train.grad_accum=1",
         "log.every=1", "log.eval_every=0"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token_cache")  # tokenized once for the whole module


def small_cfg(tmp: Path, cache: Path, *overrides: str):
    return load_config("debug", [*SMALL, f"data.cache_dir={cache}", f"log.dir={tmp}/run", f"checkpoint.dir={tmp}/ckpt",
                                 *overrides])


def host_copy(tree):
    # A real copy: on CPU a device_get may alias buffers that the next (donating) step reuses.
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache) -> tuple[Path, list[float]]:
    """(run directory, losses of steps 1..10) of a 10-step run that saves at steps 5 and 10."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    records = train(small_cfg(tmp, cache, "train.steps=10", "checkpoint.every=5"), progress=False,
                    devices=jax.devices()[:1])
    return tmp, [r["loss"] for r in records]


def test_resume_at_step_5_repeats_the_uninterrupted_losses_bit_for_bit(uninterrupted, cache, tmp_path):
    src, losses = uninterrupted
    assert sorted(os.listdir(src / "ckpt")) == [LOCK_NAME, "10", "5", "config.yaml"]
    # A run preempted right after saving step 5: its checkpoints and metrics end there.
    shutil.copytree(src / "ckpt", tmp_path / "ckpt", ignore=lambda d, names: ["10"] if d == str(src / "ckpt") else [])
    (tmp_path / "run").mkdir()
    first5 = (src / "run" / "metrics.jsonl").read_text().splitlines()[:5]
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(first5) + "\n")

    resumed = train(small_cfg(tmp_path, cache, "train.steps=10", "checkpoint.every=5"), progress=False,
                    devices=jax.devices()[:1])
    assert [r["step"] for r in resumed] == [6, 7, 8, 9, 10]
    assert [r["loss"] for r in resumed] == losses[5:]  # fp32 on CPU: exactly equal
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 11))  # appended, not truncated
    assert [r["loss"] for r in lines] == losses
    with Checkpointer(str(tmp_path / "ckpt"), read_only=True) as ckpt:
        assert ckpt.latest_step() == 10
    assert load_config(str(tmp_path / "run" / "config.yaml")).train.steps == 10


def test_a_run_planned_for_10_steps_and_continued_equals_the_10_step_run(uninterrupted, cache, tmp_path):
    """train.steps=5 with train.schedule_steps=10, then train.steps=10: the schedule was saved with
    the checkpoint, so the two halves are the 10-step run, bit for bit."""
    _, losses = uninterrupted
    first = train(small_cfg(tmp_path, cache, "train.steps=5", "train.schedule_steps=10"), progress=False,
                  devices=jax.devices()[:1])
    second = train(small_cfg(tmp_path, cache, "train.steps=10"), progress=False, devices=jax.devices()[:1])
    assert [r["loss"] for r in first + second] == losses


def test_resuming_with_more_steps_keeps_the_saved_schedule_and_says_so(cache, tmp_path, capsys):
    first = train(small_cfg(tmp_path, cache, "train.steps=3", "train.warmup_steps=1"), progress=False,
                  devices=jax.devices()[:1])
    capsys.readouterr()
    second = train(small_cfg(tmp_path, cache, "train.steps=5", "train.warmup_steps=1"), progress=False,
                   devices=jax.devices()[:1])
    assert "train.steps=5, but the checkpoint's learning-rate schedule spans 3 steps: keeping it; steps past 3 run " \
           "at its final learning rate." in capsys.readouterr().out
    final = 1e-3 * 0.1  # debug.yaml's lr x min_lr_ratio
    assert first[-1]["lr"] > final and [r["lr"] for r in second] == pytest.approx([final, final])
    assert load_config(str(tmp_path / "ckpt" / "config.yaml")).train.schedule_steps == 3
    # Set explicitly, the user's schedule wins (and is what the next checkpoint records).
    third = train(small_cfg(tmp_path, cache, "train.steps=6", "train.schedule_steps=6", "train.warmup_steps=1"),
                  progress=False, devices=jax.devices()[:1])
    assert [r["step"] for r in third] == [6] and third[0]["lr"] > final * 1.5
    assert load_config(str(tmp_path / "ckpt" / "config.yaml")).train.schedule_steps == 6


def test_checkpoint_holds_no_pickle(uninterrupted):
    files = [p for p in (uninterrupted[0] / "ckpt").rglob("*") if p.is_file()]
    assert files
    for p in files:
        head = p.read_bytes()[:2]
        assert not (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5), f"{p} looks like a pickle"
    meta = json.loads((uninterrupted[0] / "ckpt" / "5" / "meta" / "metadata").read_text())  # plain JSON
    assert meta["step"] == 5 and meta["data"]["step_in_epoch"] + meta["data"]["epoch"] > 0


# -- restore onto other meshes ---------------------------------------------------------------------
LAYOUTS = {  # name -> (mesh sizes, train.zero)
    "tp4": (dict(tp=4), 0),
    "dp8_zero3": (dict(dp=8), 3),
    "pp2": (dict(pp=2, tp=2), 0),
}
MESH_RUN = ["train.batch_size=16", "train.seq_len=32", "train.grad_accum=2", "model.num_key_value_heads=4"]  # tp=4 splits kv-heads


def build(cfg, sizes: dict, zero: int, pipeline: PipelineConfig | None = None):
    tc = dataclasses.replace(cfg.train, zero=zero)
    mesh = make_mesh(MeshConfig(**sizes), jax.devices()[:math.prod(sizes.values())])
    return build_trainer(mesh, cfg.model, tc, pipeline)  # pp > 1: the pipelined step (1F1B by default)


@pytest.fixture(scope="module")
def saved_dp2_tp2(tmp_path_factory, cache):
    """A step-1 checkpoint written under dp=2 x tp=2, the state it holds, and that layout's step-2 loss."""
    tmp = tmp_path_factory.mktemp("dp2_tp2")
    cfg = load_config("debug", [*MESH_RUN, f"data.cache_dir={cache}"])
    data, _, _ = build_data(cfg.data, cfg.train, None)
    batches = [next(data) for _ in range(2)]
    trainer = build(cfg, dict(dp=2, tp=2), 0)
    state, _ = trainer.step(trainer.init(jax.random.key(0)), jax.device_put(batches[0], trainer.batch_sharding))
    rng = jax.random.key(7)
    ckpt = Checkpointer(str(tmp))
    ckpt.save(1, state, data={"position": 1}, rng=rng, config=cfg)
    saved = host_copy(state)
    _, metrics = trainer.step(state, jax.device_put(batches[1], trainer.batch_sharding))  # donates `state`
    ckpt.close()
    return tmp, cfg, saved, batches[1], float(metrics["loss"]), jax.random.key_data(rng)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_restore_onto_another_mesh_gives_equal_state_and_next_loss(saved_dp2_tp2, layout):
    directory, cfg, saved, batch, loss, rng = saved_dp2_tp2
    sizes, zero = LAYOUTS[layout]
    trainer = build(cfg, sizes, zero)
    assert (trainer.pipeline is not None) == (sizes.get("pp", 1) > 1)  # pp=2 runs the real pipeline
    with Checkpointer(str(directory)) as ckpt:
        state, data, new_rng, saved_cfg = ckpt.restore(trainer, cfg)
    assert data == {"position": 1} and saved_cfg == cfg
    np.testing.assert_array_equal(jax.random.key_data(new_rng), rng)
    assert int(state.step) == 1
    for got, want, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(saved),
                                   jax.tree.leaves(trainer.state_sharding)):
        assert got.sharding == sharding  # every leaf on the new layout, the Adam moments included
        np.testing.assert_array_equal(np.asarray(got), want)
    _, metrics = trainer.step(state, jax.device_put(batch, trainer.batch_sharding))
    assert abs(float(metrics["loss"]) - loss) <= 1e-5, (float(metrics["loss"]), loss)


def test_interleaved_pipeline_is_stored_in_model_order_and_restores_anywhere(tmp_path, cache):
    """pp=2 x v=2 keeps its layer stack in pipeline order (model layers 0, 2, 1, 3); the checkpoint
    holds model order, so a plain layout and the pipeline itself both read it right."""
    cfg = load_config("debug", [*MESH_RUN, "model.num_hidden_layers=4", f"data.cache_dir={cache}"])
    data, _, _ = build_data(cfg.data, cfg.train, None)
    batch = next(data)
    piped = build(cfg, dict(pp=2), 0, PipelineConfig(schedule="interleaved", virtual_stages=2))
    plain = build(cfg, dict(dp=1), 0)
    rows = layer_rows(piped)
    assert list(rows) == [0, 2, 1, 3] and layer_rows(plain) is None
    state = piped.init(jax.random.key(0))
    saved = host_copy(state)
    with Checkpointer(str(tmp_path), layer_rows=rows) as ckpt:
        ckpt.save(0, state, data={}, rng=jax.random.key(0), config=cfg)
    with Checkpointer(str(tmp_path)) as ckpt:
        on_plain = ckpt.restore(plain, cfg).state
    with Checkpointer(str(tmp_path), layer_rows=rows) as ckpt:
        on_piped = ckpt.restore(piped, cfg).state
    for name, w in saved.params["layers"].items():
        np.testing.assert_array_equal(np.asarray(on_plain.params["layers"][name])[rows], w)
    for got, want in zip(jax.tree.leaves(on_piped), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(got), want)
    _, m_plain = plain.step(on_plain, jax.device_put(batch, plain.batch_sharding))
    _, m_piped = piped.step(on_piped, jax.device_put(batch, piped.batch_sharding))
    assert abs(float(m_plain["loss"]) - float(m_piped["loss"])) <= 1e-5


def test_resume_refuses_another_model_and_a_fresh_start_over_old_checkpoints(uninterrupted, cache, tmp_path):
    src, _ = uninterrupted
    shutil.copytree(src / "ckpt", tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"model.intermediate_size=256 \(checkpoint: 384\)"):
        train(small_cfg(tmp_path, cache, "model.intermediate_size=256"), progress=False, devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="already holds checkpoints .* checkpoint.resume=false"):
        train(small_cfg(tmp_path, cache, "checkpoint.resume=false"), progress=False, devices=jax.devices()[:1])
    with Checkpointer(str(tmp_path / "ckpt"), read_only=True) as ckpt, pytest.raises(ConfigError, match="step 7"):
        ckpt.resolve_step(7)


# -- preemption: real processes ------------------------------------------------------------------
def start_cli(tmp: Path, cache: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the trainer forces the CPU device count the mesh needs
    return subprocess.Popen([sys.executable, "-m", "pjax.train", "--no_progress", *SMALL, f"data.cache_dir={cache}",
                             f"log.dir={tmp}/run", f"checkpoint.dir={tmp}/ckpt", *overrides],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def committed_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_a_second_run_is_refused_and_a_sigkilled_run_leaves_no_lock_and_resumes_from_its_last_complete_step(
        tmp_path, cache):
    proc = start_cli(tmp_path, cache, "train.steps=8", "checkpoint.every=1", "checkpoint.keep=2")
    ckpt_dir = tmp_path / "ckpt"
    deadline = time.time() + 300
    try:
        # While the first run holds checkpoint.dir, a second one into it stops before touching it.
        while not (ckpt_dir / LOCK_NAME).is_file() or not (ckpt_dir / LOCK_NAME).read_text():
            assert proc.poll() is None and time.time() < deadline, "the run never took its lock"
            time.sleep(0.005)
        in_use = rf"checkpoint.dir=.*ckpt is in use by another run \(pid {proc.pid} on "
        with pytest.raises(ConfigError, match=in_use):
            train(small_cfg(tmp_path, cache, "train.steps=8", "checkpoint.every=1", "checkpoint.keep=2"),
                  progress=False, devices=jax.devices()[:1])
        # Wait until a save is being written while an earlier one is complete, then kill -9.
        while not (ckpt_dir.is_dir() and committed_steps(ckpt_dir) and saving_in_progress(ckpt_dir)):
            assert proc.poll() is None, f"the run ended before a save could be interrupted: {proc.stderr.read()[-2000:]}"
            assert time.time() < deadline, "no save started"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert saving_in_progress(ckpt_dir), "the kill came after the save committed"
    last = max(committed_steps(ckpt_dir))
    killed = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    # The kernel dropped the killed run's lock with its files: this run takes the directory over.
    resumed = train(small_cfg(tmp_path, cache, "train.steps=8", "checkpoint.every=1", "checkpoint.keep=2"),
                    progress=False, devices=jax.devices()[:1])
    assert resumed[0]["step"] == last + 1
    assert not saving_in_progress(ckpt_dir)  # the partial save was cleaned up, never read
    assert committed_steps(ckpt_dir) == [7, 8]
    # Steps the killed run finished after its last checkpoint come out the same again.
    again = {r["step"]: r["loss"] for r in resumed}
    for r in killed:
        if r["step"] in again:
            assert abs(r["loss"] - again[r["step"]]) <= 1e-6, (r, again[r["step"]])


def test_sigterm_finishes_the_step_saves_and_exits_0(tmp_path, cache):
    proc = start_cli(tmp_path, cache, "train.steps=500", "checkpoint.every=0")
    try:
        for line in proc.stdout:
            if line.startswith("step 2:"):
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    stopped = int(out.split("stopping at step ")[1].split()[0])
    assert stopped < 500
    with Checkpointer(str(tmp_path / "ckpt"), read_only=True) as ckpt:
        assert ckpt.resolve_step() == stopped
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == stopped


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 20 MB file system (tmpfs): room for one checkpoint of the debug model (~12 MB), not two."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a size-limited file system needs `mount -t tmpfs`, which needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {made.stderr.strip() or made.returncode}")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=False)


def test_a_full_disk_mid_save_is_one_line_and_the_step_before_it_resumes(small_disk, cache, tmp_path, capfd):
    from pjax.cli import run_main

    overrides = ("train.steps=3", "checkpoint.every=1", "checkpoint.keep=1")
    cfg = small_cfg(tmp_path, cache, *overrides, f"checkpoint.dir={small_disk}/ckpt")
    status = run_main(lambda: train(cfg, progress=False, devices=jax.devices()[:1]))
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2 and "Traceback" not in err and "ERROR" not in err, err
    assert len(errors) == 1 and errors[0].startswith("error: checkpoint.dir=/") and \
        "is full: step 2 needs about 16.5 MB and " in errors[0] and "rerun to resume from step 1." in errors[0], err
    # keep=1 would have deleted step 1 once step 2 was complete: it never was, so step 1 stays.
    assert committed_steps(small_disk / "ckpt") == [1] and saving_in_progress(small_disk / "ckpt")
    with Checkpointer(str(small_disk / "ckpt"), read_only=True) as ckpt:
        assert ckpt.latest_step() == 1
    # On a disk with room, the run continues from step 1 (the partial step 2 is cleaned up, never read).
    shutil.copytree(small_disk / "ckpt", tmp_path / "ckpt")
    resumed = train(small_cfg(tmp_path, cache, *overrides), progress=False, devices=jax.devices()[:1])
    assert [r["step"] for r in resumed] == [2, 3] and committed_steps(tmp_path / "ckpt") == [3]
    assert not saving_in_progress(tmp_path / "ckpt")


# -- HuggingFace export and import; pjax.eval ----------------------------------------------------
@pytest.fixture(scope="module")
def exported(uninterrupted, tmp_path_factory) -> Path:
    from pjax.export import main

    out = tmp_path_factory.mktemp("hf")  # in shards of 1 MB, as transformers' max_shard_size spells it
    assert main(["--checkpoint", str(uninterrupted[0] / "ckpt"), "--out", str(out), "--max-shard-size", "1MB"]) == 0
    return out


def test_export_loads_in_transformers_with_equal_logits(uninterrupted, exported):
    import torch
    import transformers

    ckpt = Checkpointer(str(uninterrupted[0] / "ckpt"), read_only=True)
    cfg = ckpt.config()
    on_device_0 = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, _, params = ckpt.restore_params(lambda model: jax.tree.map(lambda _: on_device_0, llama.param_logical_axes(model),
                                                                  is_leaf=lambda x: isinstance(x, tuple)))
    ckpt.close()
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 24)).astype(np.int32)
    ours = np.asarray(jax.jit(llama.logits, static_argnums=2)(params, tokens, cfg.model))
    model = transformers.LlamaForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-5
    assert (exported / "tokenizer.json").is_file()
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    shards = sorted(exported.glob("model-*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == [p.name for p in shards] and len(shards) > 1
    for shard in shards:  # at most 1 MB and its header, or one tensor larger than that alone (as transformers does)
        held = [k for k, v in index["weight_map"].items() if v == shard.name]
        assert shard.stat().st_size <= 1_000_000 + 10_000 or len(held) == 1, (shard.name, held)


def test_a_bf16_export_is_the_fp32_one_rounded_and_each_process_writes_its_own_shards(uninterrupted, exported,
                                                                                         tmp_path):
    """--dtype bf16: every tensor the fp32 export's rounded to nearest even. Two `pjax.export` processes side by
    side: process k writes shards k, k + 2, ... and nothing else (process 0 the config and index too); together
    they write the files one process writes."""
    import ml_dtypes
    import safetensors.numpy

    from pjax.export import export

    ckpt = str(uninterrupted[0] / "ckpt")
    step, written = export(ckpt, str(tmp_path / "one"), max_shard_size="1MB", dtype="bf16")
    fp32 = {k: v for p in exported.glob("model-*.safetensors") for k, v in safetensors.numpy.load_file(p).items()}
    bf16 = {k: v for p in (tmp_path / "one").glob("model-*.safetensors")
            for k, v in safetensors.numpy.load_file(p).items()}
    assert bf16.keys() == fp32.keys()
    for name, w in fp32.items():
        np.testing.assert_array_equal(bf16[name], w.astype(ml_dtypes.bfloat16), err_msg=name)
    assert json.loads((tmp_path / "one" / "config.json").read_text())["torch_dtype"] == "bfloat16"

    every = sorted(p.name for p in (tmp_path / "one").glob("model-*"))
    assert written == every and len(every) >= 3
    args = ["--checkpoint", ckpt, "--out", str(tmp_path / "two"), "--max-shard-size", "1MB", "--dtype", "bf16",
            "--num_processes", "2"]
    procs = [subprocess.Popen([sys.executable, "-m", "pjax.export", *args, "--process_id", str(k)], cwd=REPO,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for k, (p, (out, err)) in enumerate(zip(procs, outs)):
        mine = len(every[k::2])
        assert p.returncode == 0 and out.strip().endswith(f"(process {k} of 2: {mine} shards)"), (out, err)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir())
    for name in [*every, "config.json", "model.safetensors.index.json", "tokenizer.json"]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_init_from_hf_export_trains_from_those_weights(exported, cache, tmp_path):
    from models.hf import load_hf

    cfg = load_config("debug", [*SMALL, f"data.cache_dir={cache}", f"log.dir={tmp_path}", "train.steps=1",
                                f"train.init_from={exported}"])
    [record] = train(cfg, progress=False, devices=jax.devices()[:1])
    # The step's loss is the exported weights' loss on the first batch: they were used, not re-randomised.
    trainer = build(cfg, dict(dp=1), 0)
    data, _, _ = build_data(cfg.data, cfg.train, trainer.mesh)
    _, params = load_hf(str(exported), trainer.state_sharding.params)
    assert abs(float(trainer.loss(params, next(data))) - record["loss"]) <= 1e-5


def test_eval_on_a_checkpoint_equals_eval_on_its_hf_export(uninterrupted, exported, tmp_path):
    from pjax import eval as pjax_eval

    text = tmp_path / "text.txt"
    text.write_text((assets.ROOT / "data" / "prideprejudice.txt").read_text()[:3000])
    cfg = load_config("debug", ["mesh.dp=2", "mesh.tp=2"])
    mesh = make_mesh(cfg.mesh, jax.devices()[:4])
    ours = pjax_eval.run(pjax_eval.parse_args(["--checkpoint", str(uninterrupted[0] / "ckpt"), "--text", str(text)]),
                         cfg, mesh)
    theirs = pjax_eval.run(pjax_eval.parse_args(["--hf", str(exported), "--text", str(text)]), cfg, mesh)
    assert ours["tokens"] == theirs["tokens"] and abs(ours["loss"] - theirs["loss"]) <= 1e-6
    with pytest.raises(ConfigError, match="is a HuggingFace checkpoint"):
        pjax_eval.run(pjax_eval.parse_args(["--checkpoint", str(exported), "--text", str(text)]), cfg, mesh)


def test_export_reads_one_layer_and_expert_at_a_time_and_reads_older_checkpoints_whole(tmp_path):
    """Saved parameters are chunked per layer and expert, so `ParamReader` reads a layer's chunk alone; a checkpoint
    saved as one chunk per parameter (before that) is read whole, once, and gives the same slices."""
    import orbax.checkpoint as ocp

    from models.config import LlamaConfig
    from pjax.checkpoint.checkpointer import _per_piece
    from pjax.checkpoint.param_reader import ParamReader

    model = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    params = jax.tree.map(lambda s: np.random.default_rng(0).standard_normal(s.shape).astype(np.float32),
                          jax.eval_shape(lambda: llama.init_params(model, jax.random.key(0))))
    for name, args in [("pieces", _per_piece(params, model)), ("whole", None)]:
        with ocp.CheckpointManager(tmp_path / name) as manager:
            manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(params, save_args=args)))
        read = ParamReader(tmp_path / name / "1")
        chunks = {path: read._open(path).chunk_layout.read_chunk.shape for path in
                  [("layers", "wq"), ("layers", "w_up"), ("embed", "embedding")]}
        if name == "pieces":
            assert chunks[("layers", "wq")][0] == 1 and chunks[("layers", "w_up")][:2] == (1, 1), chunks
        else:
            assert chunks[("layers", "wq")] == params["layers"]["wq"].shape, chunks
        np.testing.assert_array_equal(read(("layers", "w_up"), (2, 3)), params["layers"]["w_up"][2, 3])
        np.testing.assert_array_equal(read(("layers", "wq"), (1,)), params["layers"]["wq"][1])
        np.testing.assert_array_equal(read(("embed", "embedding")), params["embed"]["embedding"])


def test_an_export_process_knows_its_index_from_the_flags_or_from_srun(monkeypatch):
    from pjax.export import this_process

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    assert this_process(None, None) == (0, 1) and this_process(3, 2) == (2, 3)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[01-04]")
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    assert this_process(None, None) == (3, 4) and this_process(4, 3) == (3, 4)
