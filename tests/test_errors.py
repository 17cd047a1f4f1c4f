"""Every mistake a user can make at the command line ends as one `error:` line and exit status 2:
no traceback, and no checkpoint step lost. One table, run through the four entry points' `main`."""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator

import jax
import pytest
import safetensors.numpy

from hf_helpers import SHIPPED, random_hf_llama
from pjax import eval as pjax_eval
from pjax import export as pjax_export
from pjax import plot as pjax_plot
from pjax import train as pjax_train
from pjax.config_io import load_config
from pjax.checkpoint.dirlock import DirectoryLock

SMALL = ["mesh.dp=1", "mesh.tp=1", "train.batch_size=8", "train.seq_len=64", "log.every=1", "log.eval_every=0"]
MAINS = {"train": pjax_train.main, "eval": pjax_eval.main, "export": pjax_export.main, "plot": pjax_plot.main}


def damage(step_dir: Path) -> None:
    """Cut every data file of a step's parameters short, as a partial copy would."""
    for f in glob.glob(f"{step_dir}/params/**/d/*", recursive=True):
        with open(f, "r+b") as fh:
            fh.truncate(10)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Every bad input of the table, made once."""
    root = tmp_path_factory.mktemp("bad_inputs")
    out = {"root": root}

    def write(name: str, content: str | bytes) -> Path:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        out[name] = path
        return path

    write("a_file", "not a directory")
    write("binary.txt", bytes(range(256)) * 4)
    write("nul.txt", "text\x00with a NUL")
    write("latin1.txt", "caf\xe9".encode("latin-1"))
    write("malformed.jsonl", '{"text": "fine"}\n{"text": "no end"\n')
    write("no_text.jsonl", '{"body": "where is the text"}\n')
    write("null_text.jsonl", '{"text": null}\n')
    write("number_text.jsonl", '{"text": 42}\n')
    write("list_line.jsonl", '["text"]\n')
    write("corrupt.parquet", b"PAR1 this is not parquet PAR1")
    write("tokenizer.json", '{"model": {"type": "BPE", "vocab": ')
    write("gpt2_broken/vocab.json", "{not json")
    write("gpt2_broken/merges.txt", "#version: 0.2\n")
    write("metrics_latin1/metrics.jsonl", '{"step": 1, "loss": "caf\xe9"}\n'.encode("latin-1"))
    write("latin1.yaml", "train:\n  dtype: caf\xe9\n".encode("latin-1"))
    write("huge_int.yaml", "train:\n  steps: " + "1" * 10_000 + "\n")
    # Streamed: line 71 is read by the prefetch thread, after the first 64k-character chunk (and
    # ~13 steps: " Elizabeth" is one token).
    write("empty.jsonl", "")
    write("late_bad.jsonl", "".join(json.dumps({"text": f"line {i}" + " Elizabeth" * 100}) + "\n" for i in range(70))
          + '{"text": "no end\n')
    import datasets

    out["saved_ds"] = root / "saved_ds"
    datasets.Dataset.from_dict({"content": ["a saved document"]}).save_to_disk(str(out["saved_ds"]))
    (root / "empty_run").mkdir()
    # HF checkpoints: a valid tiny one (4,096 tokens: the default tokenizer's), then broken copies.
    good = out["hf_good"] = root / "hf_good"
    random_hf_llama(good, vocab_size=4096, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64)
    for name in ("hf_no_config", "hf_bad_json", "hf_no_layers_key", "hf_bad_value", "hf_untied_no_head",
                 "hf_truncated", "hf_no_weights", "hf_rope_yarn", "hf_rope_dynamic"):
        shutil.copytree(good, root / name)
        out[name] = root / name
    (root / "hf_no_config" / "config.json").unlink()
    (root / "hf_bad_json" / "config.json").write_text('{"vocab_size": 4096,')
    config = (good / "config.json").read_text()
    (root / "hf_no_layers_key" / "config.json").write_text(config.replace('"num_hidden_layers"', '"n_layers"'))
    (root / "hf_bad_value" / "config.json").write_text(config.replace('"hidden_size": 32', '"hidden_size": "big"'))
    for kind, rope in (("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}),
                       ("dynamic", {"rope_type": "dynamic", "factor": 2.0})):  # as Qwen / community files have them
        (root / f"hf_rope_{kind}" / "config.json").write_text(json.dumps({**json.loads(config), "rope_scaling": rope}))
    tensors = safetensors.numpy.load_file(str(good / "model.safetensors"))
    del tensors["lm_head.weight"]
    safetensors.numpy.save_file(tensors, str(root / "hf_untied_no_head" / "model.safetensors"), metadata={"format": "pt"})
    weights = root / "hf_truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    (root / "hf_no_weights" / "model.safetensors").unlink()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Iterator[dict[str, Path]]:
    """A run's checkpoints at steps 1 and 2, a copy whose every step is damaged, a partial copy,
    and a copy that another run (this process, through its own lock) is using."""
    root = tmp_path_factory.mktemp("checkpoints")
    cfg = load_config("debug", [*SMALL, "train.steps=2", "checkpoint.every=1", f"data.cache_dir={root}/cache",
                                f"log.dir={root}/run", f"checkpoint.dir={root}/good"])
    pjax_train.train(cfg, progress=False, devices=jax.devices()[:1])
    shutil.copytree(root / "good", root / "damaged")
    damage(root / "damaged" / "1")
    damage(root / "damaged" / "2")
    shutil.copytree(root / "good", root / "partial")  # a partial copy: one item of each step missing
    for step in ("1", "2"):
        shutil.rmtree(root / "partial" / step / "opt_state")
    shutil.copytree(root / "good", root / "busy")
    lock = DirectoryLock(str(root / "busy"))  # held as a running trainer holds it
    yield {"good": root / "good", "damaged": root / "damaged", "partial": root / "partial", "busy": root / "busy",
           "cache": root / "cache"}
    lock.release()


def snapshot(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def in_process(monkeypatch) -> None:
    """The CLIs in this process: the 8 forced CPU devices exist already (conftest), so a run takes
    the first mesh-size of them, which is what forcing the count would have given it."""
    for module in (pjax_train, pjax_eval):
        monkeypatch.setattr(module, "force_cpu_devices", lambda *a: 8)
    train = pjax_train.train
    monkeypatch.setattr(pjax_train, "train", lambda cfg, progress=True, devices=None: train(
        cfg, progress, devices=devices or (jax.devices()[:cfg.mesh.size] if cfg.mesh.dp > 0 else None)))


# (name, entry point, arguments given the fixtures (f: files, c: checkpoints, t: this test's tmp), in the line,
# and optionally the environment variables the case runs under, as srun would set them)
Case = tuple[str, str, Callable[[dict, dict, Path], list[str]], str] | tuple[str, str, Callable, str, dict[str, str]]
SRUN = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "localhost"}
CASES: list[Case] = [
    ("mesh tp 0", "train", lambda f, c, t: ["mesh.tp=0"], "mesh.tp=0 is invalid"),
    ("mesh dp 0", "train", lambda f, c, t: ["mesh.dp=0"], "mesh.dp=0 is invalid"),
    ("mesh pp negative", "train", lambda f, c, t: ["mesh.pp=-2"], "mesh.pp=-2 is invalid"),
    ("hidden size 0", "train", lambda f, c, t: ["model.hidden_size=0"], "model.hidden_size=0 is invalid"),
    ("no heads", "train", lambda f, c, t: ["model.num_attention_heads=0"], "model.num_attention_heads=0 is invalid"),
    ("no layers", "train", lambda f, c, t: ["model.num_hidden_layers=0"], "model.num_hidden_layers=0 is invalid"),
    ("no vocabulary", "train", lambda f, c, t: ["model.vocab_size=0"], "model.vocab_size=0 is invalid"),
    ("odd head_dim", "train", lambda f, c, t: ["model.head_dim=7"], "model.head_dim=7 is invalid"),
    ("kv heads", "train", lambda f, c, t: ["model.num_key_value_heads=3"], "is not divisible by model.num_key_value"),
    ("binary text", "train", lambda f, c, t: [f"data.path={f['binary.txt']}"], "is not UTF-8 text (byte 128"),
    ("NUL in text", "train", lambda f, c, t: [f"data.path={f['nul.txt']}"], "looks like a binary file"),
    ("latin-1 text", "train", lambda f, c, t: [f"data.path={f['latin1.txt']}"], "convert it to UTF-8"),
    ("malformed JSONL", "train", lambda f, c, t: [f"data.path={f['malformed.jsonl']}"], "malformed.jsonl:2 is not valid JSON"),
    ("JSONL without text", "train", lambda f, c, t: [f"data.path={f['no_text.jsonl']}"], ':1 has no "text" field'),
    ("JSONL null text", "train", lambda f, c, t: [f"data.path={f['null_text.jsonl']}"], '"text" null, not a string'),
    ("JSONL number text", "train", lambda f, c, t: [f"data.path={f['number_text.jsonl']}"], "of type int, not a string"),
    ("JSONL list line", "train", lambda f, c, t: [f"data.path={f['list_line.jsonl']}"], ':1 has no "text" field'),
    ("corrupt parquet", "train", lambda f, c, t: [f"data.path={f['corrupt.parquet']}"], "is not a valid parquet file"),
    ("split of a plain file", "train", lambda f, c, t: ["data.split=validation"],
     "data.split=validation applies only to a HuggingFace dataset"),
    ("dataset without the column", "train", lambda f, c, t: [f"data.path={f['saved_ds']}"],
     "has no column 'text' (it has content); set data.column"),
    ("negative prefetch", "train", lambda f, c, t: ["data.prefetch=-1"], "data.prefetch=-1 is invalid"),
    ("streaming holds out most documents", "train", lambda f, c, t: ["data.streaming=true", "data.eval_fraction=0.7"],
     "with data.streaming=true every round(1/eval_fraction)-th document is held out, so use at most 0.5"),
    ("empty corpus streamed", "train", lambda f, c, t: [f"data.path={f['empty.jsonl']}", "data.streaming=true"],
     "data.path holds no documents to stream"),
    ("streamed JSONL broken past the first chunk", "train",
     lambda f, c, t: [f"data.path={f['late_bad.jsonl']}", "data.streaming=true", "train.steps=1000"],
     "late_bad.jsonl:71 is not valid JSON"),
    ("corrupt tokenizer.json", "train", lambda f, c, t: [f"data.tokenizer={f['tokenizer.json']}"],
     "is not a valid tokenizer.json"),
    ("corrupt vocab.json", "train", lambda f, c, t: [f"data.tokenizer={f['root'] / 'gpt2_broken'}"],
     ": its vocab.json/merges.txt pair does not load"),
    ("log dir in a file", "train", lambda f, c, t: [f"log.dir={f['a_file']}/run"], "log.dir="),
    ("cache dir in a file", "train", lambda f, c, t: [f"data.cache_dir={f['a_file']}/cache"], "data.cache_dir="),
    ("checkpoint dir in a file", "train", lambda f, c, t: [f"checkpoint.dir={f['a_file']}/ckpt"],
     "checkpoint.dir="),
    ("checkpoint dir in use by another run", "train", lambda f, c, t: [f"checkpoint.dir={c['busy']}"],
     "is in use by another run (pid "),
    ("config file not UTF-8", "train", lambda f, c, t: ["--config", str(f["latin1.yaml"])],
     "is not UTF-8 text (byte 0xe9 at offset 19); save it as UTF-8"),
    ("10,000-digit integer in a config file", "train", lambda f, c, t: ["--config", str(f["huge_int.yaml"])],
     "holds an integer of over 4,300 digits"),
    ("10,000-digit integer override", "train", lambda f, c, t: ["train.steps=" + "1" * 10_000],
     "holds an integer of over 4,300 digits"),
    ("integer past 64 bits", "train", lambda f, c, t: ["train.steps=" + "9" * 30], "train.steps is too large"),
    ("10,000-character value", "train", lambda f, c, t: ["train.dtype=" + "x" * 10_000],
     "xxx… (10,002 characters) is invalid; choose one of"),
    ("10,000-character path", "train", lambda f, c, t: [f"data.path={t}/{'p' * 10_000}"], "ppp… (10,"),
    ("every step damaged", "train", lambda f, c, t: [f"checkpoint.dir={c['damaged']}", "train.steps=4"],
     "no checkpoint step in"),
    ("every step partial", "train", lambda f, c, t: [f"checkpoint.dir={c['partial']}", "train.steps=4"],
     "no checkpoint step in"),
    ("init_from without config.json", "train", lambda f, c, t: [f"train.init_from={f['hf_no_config']}"],
     "has no config.json"),
    ("init_from with broken JSON", "train", lambda f, c, t: [f"train.init_from={f['hf_bad_json']}"],
     "is not a readable JSON file"),
    ("init_from config.json without layers", "train", lambda f, c, t: [f"train.init_from={f['hf_no_layers_key']}"],
     "has no num_hidden_layers"),
    ("init_from config.json with a string size", "train", lambda f, c, t: [f"train.init_from={f['hf_bad_value']}"],
     "hidden_size='big' is invalid"),
    ("init_from untied without lm_head", "train", lambda f, c, t: [f"train.init_from={f['hf_untied_no_head']}"],
     "no lm_head.weight but its config.json says tie_word_embeddings=false"),
    ("init_from with YaRN RoPE", "train", lambda f, c, t: [f"train.init_from={f['hf_rope_yarn']}"],
     "rope_type='yarn' is refused: YaRN is not implemented"),
    ("RoPE type not implemented", "train", lambda f, c, t: ["model.rope_type=dynamic"],
     "model.rope_type='dynamic' is not supported: dynamic NTK scaling"),
    ("llama3 RoPE without its keys", "train", lambda f, c, t: ["model.rope_type=llama3", "model.rope_factor=8"],
     "model.rope_type='llama3' needs model.rope_low_freq_factor"),
    ("init_from truncated weights", "train", lambda f, c, t: [f"train.init_from={f['hf_truncated']}"], "is truncated"),
    ("init_from without weights", "train", lambda f, c, t: [f"train.init_from={f['hf_no_weights']}"],
     "no model.safetensors"),
    ("multi-host without coordinator", "train", lambda f, c, t: ["--num_processes", "2"], "go together"),
    ("coordinator without port", "train",
     lambda f, c, t: ["--coordinator", "localhost", "--num_processes", "2", "--process_id", "0"], "is not host:port"),
    ("process id out of range", "train",
     lambda f, c, t: ["--coordinator", "127.0.0.1:1234", "--num_processes", "2", "--process_id", "2"],
     "--process_id=2 is invalid for --num_processes=2"),
    ("SLURM tasks outside srun", "train", lambda f, c, t: [],
     "SLURM_NTASKS=2 but this process is in no srun step", {**SRUN, "SLURM_STEP_NODELIST": None}),
    ("SLURM without a job id", "train", lambda f, c, t: [], "SLURM_JOB_ID is not set", {**SRUN, "SLURM_JOB_ID": None}),
    ("SLURM process id out of range", "train", lambda f, c, t: [], "SLURM_PROCID=2 is invalid for SLURM_NTASKS=2",
     {**SRUN, "SLURM_PROCID": "2"}),
    ("flags disagree with SLURM", "train",
     lambda f, c, t: ["--coordinator", "127.0.0.1:1234", "--num_processes", "4", "--process_id", "0"],
     "--num_processes=4 --process_id=0 disagree with SLURM's SLURM_NTASKS=2 SLURM_PROCID=0", SRUN),
    ("unknown option", "train", lambda f, c, t: ["--bogus"], "unrecognized arguments: --bogus"),
    ("checkpoint.every without a dir", "train", lambda f, c, t: ["checkpoint.every=5"],
     "checkpoint.every=5 is invalid; it saves only with a checkpoint.dir"),
    ("pipeline schedule without a pipeline", "train", lambda f, c, t: ["pipeline.schedule=zb_v"],
     "pipeline.schedule=zb_v and pipeline.virtual_stages=1 apply only when mesh.pp > 1"),
    ("grad compression on one data replica", "train", lambda f, c, t: ["train.grad_compression=int8"],
     "train.grad_compression=int8 compresses the gradient reduction over dp and cp, and this mesh has dp=1"),
    ("grad compression unknown", "train", lambda f, c, t: ["train.grad_compression=fp4"],
     "train.grad_compression='fp4' is invalid; choose one of none, bf16, int8, powersgd"),
    ("powersgd rank without powersgd", "train", lambda f, c, t: ["train.powersgd_rank=4"],
     "train.powersgd_rank=4 is invalid; it applies only with train.grad_compression=powersgd"),
    ("powersgd start without powersgd", "train", lambda f, c, t: ["train.powersgd_start=10"],
     "train.powersgd_start=10 is invalid; it applies only with train.grad_compression=powersgd"),
    ("DiLoCo on one data replica", "train", lambda f, c, t: ["train.local_steps=4"],
     "train.local_steps=4 (DiLoCo) syncs dp groups, and this mesh has dp=1: set mesh.dp >= 2"),
    ("DiLoCo groups without local steps", "train", lambda f, c, t: ["train.diloco_groups=2"],
     "train.diloco_groups=2 is invalid; it applies only with train.local_steps > 0"),
    ("DiLoCo groups of zero", "train", lambda f, c, t: ["mesh.dp=2", "train.local_steps=4", "train.diloco_groups=0"],
     "train.diloco_groups=0 is invalid; use an integer >= 1"),
    ("DiLoCo that never synchronises", "train",
     lambda f, c, t: ["mesh.dp=2", "train.local_steps=400", "train.steps=10"],
     "train.local_steps=400 (DiLoCo) first synchronises at step 400, after train.steps=10: set "
     "train.local_steps <= 10, or more train.steps"),
    ("streaming fragments that do not divide H", "train",
     lambda f, c, t: ["mesh.dp=2", "train.local_steps=3", "train.diloco_fragments=2"],
     "train.diloco_fragments=2 (streaming DiLoCo) needs train.local_steps=3 to divide by 2: use a divisor of 3"),
    ("streaming overlap past the next send", "train",
     lambda f, c, t: ["mesh.dp=2", "train.local_steps=4", "train.diloco_fragments=2", "train.diloco_overlap=2"],
     "train.diloco_overlap=2 must land before the next fragment is sent, 2 steps later"),
    ("streaming fragments that do not split the layers", "train",
     lambda f, c, t: ["mesh.dp=2", "train.local_steps=6", "train.diloco_fragments=3"],
     "(streaming DiLoCo): model.num_hidden_layers (2) does not divide by 3"),
    ("MAML under sequence parallelism", "train",
     lambda f, c, t: ["mesh.dp=2", "mesh.tp=2", "train.sequence_parallel=true", "meta.algorithm=maml",
                      "meta.tasks=[data/austen/emma.txt,data/austen/persuasion.txt]", "meta.inner_steps=1",
                      "train.grad_accum=2"],
     "meta.algorithm=maml does not run with train.sequence_parallel: set it to false"),
    ("MAML with Ulysses", "train",
     lambda f, c, t: ["mesh.dp=2", "mesh.cp=2", "context.strategy=ulysses", "meta.algorithm=maml",
                      "meta.tasks=[data/austen/emma.txt,data/austen/persuasion.txt]", "meta.inner_steps=1",
                      "train.grad_accum=2"],
     "meta.algorithm=maml does not run with context.strategy=ulysses: use ring or all_gather"),
    ("streaming fragments a pipeline stores two of in a row", "train",
     lambda f, c, t: ["mesh.dp=2", "mesh.pp=2", "model.num_hidden_layers=4", "pipeline.schedule=interleaved",
                      "pipeline.virtual_stages=2", "train.local_steps=4", "train.diloco_fragments=2"],
     "with pipeline.schedule=interleaved: use fragments that divide the 1 layer(s) of a stage chunk"),
    ("streaming overlap without DiLoCo", "train", lambda f, c, t: ["train.diloco_overlap=1"],
     "train.diloco_overlap=1 is invalid; it applies only with train.local_steps > 0"),
    ("outer lr without an outer loop", "train", lambda f, c, t: ["train.outer_lr=0.5"],
     "train.outer_lr=0.5 steps the outer loop, which this run does not have"),
    ("meta key without meta-learning", "train", lambda f, c, t: ["meta.inner_steps=3"],
     "meta.inner_steps=3 is invalid; it applies only with a meta.algorithm"),
    ("unknown key", "train", lambda f, c, t: ["train.stpes=3"],
     "(did you mean 'train.steps'?); every train key: docs/training.md#every-config-key"),
    ("loss chunk that does not split over tp", "train",
     lambda f, c, t: ["mesh.tp=2", "train.sequence_parallel=true", "train.loss_chunk=3"],
     "train.loss_chunk=3 with train.sequence_parallel takes loss_chunk / mesh.tp tokens from each tp part"),
    ("meta tasks that do not divide over dp", "train",
     lambda f, c, t: ["mesh.dp=2", "meta.algorithm=reptile", "meta.tasks=[a.txt,b.txt,c.txt]", "train.grad_accum=1"],
     "meta.tasks names 3 tasks, which do not divide over the mesh.dp=2 groups"),
    ("meta compression on one data replica", "train",
     lambda f, c, t: ["mesh.cp=2", "mesh.tp=1", "meta.algorithm=reptile", "meta.tasks=[data/austen/emma.txt]",
                      "train.grad_accum=1", "train.grad_compression=int8"],
     "meta.algorithm=reptile with train.grad_compression=int8 and mesh.dp=1: set mesh.dp >= 2"),
    ("meta compression after exact steps", "train",
     lambda f, c, t: ["mesh.dp=2", "meta.algorithm=fomaml",
                      "meta.tasks=[data/austen/emma.txt,data/austen/persuasion.txt]", "meta.inner_steps=1", "train.grad_accum=2", "train.grad_compression=powersgd",
                      "train.powersgd_start=5"],
     "compresses from the first meta step: set train.powersgd_start=0"),
    ("MAML compressed with cp", "train",
     lambda f, c, t: ["mesh.dp=2", "mesh.cp=2", "mesh.tp=1", "meta.algorithm=maml",
                      "meta.tasks=[data/austen/emma.txt,data/austen/persuasion.txt]", "meta.inner_steps=1",
                      "train.grad_accum=2", "train.grad_compression=bf16"],
     "and mesh.cp=2: use mesh.cp=1, meta.algorithm=fomaml or reptile, or train.grad_compression=none"),
    ("grad compression under ZeRO-3", "train", lambda f, c, t: ["mesh.dp=2", "train.zero=3", "train.grad_compression=bf16"],
     "with train.zero=3: use train.zero=1 (its reduce-scatter is compressed), or train.grad_compression=none"),
    ("attention kernel under ring attention", "train", lambda f, c, t: ["mesh.cp=2", "train.attention=reference"],
     "train.attention=reference has no effect with mesh.cp=2 and context.strategy=ring"),
    ("profile steps not [start, count]", "train", lambda f, c, t: ["log.profile_steps=[0,5]"],
     "log.profile_steps=[0, 5] is invalid; use [start, count]"),
    ("profile steps past train.steps", "train", lambda f, c, t: ["train.steps=4", "log.profile_steps=[3,5]"],
     "log.profile_steps=[3, 5] traces steps 3 to 7, past train.steps=4"),
    ("remat names without remat=names", "train", lambda f, c, t: ["train.remat_names=[q_proj, o_proj]"],
     "train.remat_names=['q_proj', 'o_proj'] is invalid; it applies only with train.remat=names"),
    ("non-finite loss", "train", lambda f, c, t: ["train.lr=1e20", "train.warmup_steps=0", "train.steps=3"],
     "not finite (train.on_nonfinite=stop)"),
    ("eval: HF dir without config.json", "eval", lambda f, c, t: ["--hf", str(f["hf_no_config"])], "has no config.json"),
    ("eval: broken config.json", "eval", lambda f, c, t: ["--hf", str(f["hf_bad_json"])], "is not a readable JSON"),
    ("eval: dynamic NTK RoPE", "eval", lambda f, c, t: ["--hf", str(f["hf_rope_dynamic"])],
     "rope_type='dynamic' is refused: dynamic NTK"),
    ("eval: binary text", "eval", lambda f, c, t: ["--hf", str(f["hf_good"]), "--text", str(f["binary.txt"])],
     "is not UTF-8 text"),
    ("eval: every step damaged", "eval", lambda f, c, t: ["--checkpoint", str(c["damaged"])], "no checkpoint step in"),
    ("eval: batch size 0", "eval", lambda f, c, t: ["--hf", str(f["hf_good"]), "--batch_size", "0"],
     "--batch_size=0 is invalid"),
    ("export: out in a file", "export", lambda f, c, t: ["--checkpoint", str(c["good"]), "--out", f"{f['a_file']}/hf"],
     "--out="),
    ("export: no such checkpoint", "export", lambda f, c, t: ["--checkpoint", f"{t}/nope", "--out", f"{t}/hf"],
     "does not exist"),
    ("export: unsaved step", "export",
     lambda f, c, t: ["--checkpoint", str(c["good"]), "--step", "99", "--out", f"{t}/hf"], "no checkpoint for step 99"),
    ("export: every step damaged", "export", lambda f, c, t: ["--checkpoint", str(c["damaged"]), "--out", f"{t}/hf"],
     "no checkpoint step in"),
    ("export: a process count alone", "export",
     lambda f, c, t: ["--checkpoint", str(c["good"]), "--out", f"{t}/hf", "--num_processes", "2"],
     "pass --num_processes N and --process_id K together"),
    ("export: flags against srun's", "export",
     lambda f, c, t: ["--checkpoint", str(c["good"]), "--out", f"{t}/hf", "--num_processes", "2", "--process_id", "0"],
     "disagree with SLURM's SLURM_NTASKS=2 SLURM_PROCID=1",
     {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_JOB_ID": "7"}),
    ("plot: no metrics", "plot", lambda f, c, t: [str(f["root"] / "empty_run")], "metrics.jsonl does not exist"),
    ("plot: metrics not UTF-8", "plot", lambda f, c, t: [str(f["root"] / "metrics_latin1")], "is not UTF-8 text"),
    ("plot: no run dir given", "plot", lambda f, c, t: [], "the following arguments are required: run_dir"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line_exit_2_and_no_lost_checkpoint(case, files, checkpoints, tmp_path, monkeypatch,
                                                                    capfd):
    name, tool, make_argv, expected, *environment = case
    in_process(monkeypatch)
    for key in [k for k in os.environ if k.startswith("SLURM_")] + ["JAX_COORDINATOR_PORT"]:
        monkeypatch.delenv(key, raising=False)  # a case runs as outside SLURM unless it says otherwise
    for key, value in (environment[0] if environment else {}).items():
        if value is not None:
            monkeypatch.setenv(key, value)
    argv = make_argv(files, checkpoints, tmp_path)
    if tool == "train":
        argv = ["--no_progress", *SMALL, f"log.dir={tmp_path}/run", f"data.cache_dir={checkpoints['cache']}", *argv]
    steps = ("good", "damaged", "partial", "busy")
    before = [snapshot(checkpoints[k]) for k in steps]
    try:
        status = MAINS[tool](argv)
    except SystemExit as e:  # argparse's exit: the status it would give the shell
        status = e.code
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2, err
    assert "Traceback" not in err, err
    assert len(errors) == 1 and expected in errors[0], err
    assert len(errors[0]) <= 600, errors[0]  # values and paths echoed from the user are cut
    assert [snapshot(checkpoints[k]) for k in steps] == before  # every checkpoint step still there, unchanged


def test_the_table_holds_at_least_30_distinct_mistakes():
    assert len({name for name, *_ in CASES}) == len(CASES) >= 30


def test_the_line_recorder_fails_a_201_character_line_and_passes_a_200_character_one(capsys):
    """tests/error_lines.py records each ConfigError's `error:` line and each `warning:` line a test reads back, and
    fails a test with a line over 200 characters (`error: ` included), naming the line and its length."""
    import error_lines
    from mesh.errors import ConfigError

    words = lambda n: ("x" * 9 + " ") * (n // 10) + "x" * (n % 10)  # noqa: E731 (n characters, none cut by `fail`)
    assert [len(words(n)) for n in (191, 192, 193, 194)] == [191, 192, 193, 194]
    ConfigError(words(193))  # "error: " + 193 = 200 characters
    print("warning: " + words(191), file=sys.stderr)  # 200
    capsys.readouterr()
    assert error_lines.drain() == []
    error_lines.check(["error: " + words(193), "warning: " + words(191)])
    ConfigError(words(194))  # 201
    print("warning: " + words(192), file=sys.stderr)  # 201
    capsys.readouterr()
    lines = error_lines.drain()
    assert lines == ["error: " + words(194), "warning: " + words(192)]
    with pytest.raises(AssertionError, match=r"201 characters: error: x{9} .*\n201 characters: warning: x{9} "):
        error_lines.check(lines)


def test_a_damaged_newest_step_falls_back_with_a_warning_and_keeps_its_files(checkpoints, tmp_path, monkeypatch,
                                                                            capfd):
    shutil.copytree(checkpoints["good"], tmp_path / "ckpt")
    damage(tmp_path / "ckpt" / "2")
    damaged = snapshot(tmp_path / "ckpt" / "2")
    monkeypatch.setattr(pjax_eval, "force_cpu_devices", lambda *a: 8)
    text = SHIPPED / "data" / "prideprejudice.txt"
    # Reading (eval): step 1 is used, nothing on disk changes.
    assert pjax_eval.main(["--checkpoint", str(tmp_path / "ckpt"), "--text", str(text), "--batch_size", "2"]) == 0
    err = capfd.readouterr().err
    assert err.count(f"warning: checkpoint {tmp_path / 'ckpt'}/2 cannot be read (") == 1 \
        and "trying the step before it" in err and "Traceback" not in err, err
    assert snapshot(tmp_path / "ckpt" / "2") == damaged
    # Training: resumes from step 1, sets step 2 aside (renamed, not deleted) and saves a new step 2.
    cfg = load_config("debug", [*SMALL, "train.steps=3", "checkpoint.every=1", f"data.cache_dir={checkpoints['cache']}",
                                f"log.dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt"])
    resumed = pjax_train.train(cfg, progress=False, devices=jax.devices()[:1])
    assert [r["step"] for r in resumed] == [2, 3]
    err = capfd.readouterr().err
    assert "warning: moved the unreadable checkpoint step 2 to" in err and "Traceback" not in err, err
    assert snapshot(tmp_path / "ckpt" / "2.unreadable") == damaged
    assert {"1", "2", "3", "2.unreadable"} <= {p.name for p in (tmp_path / "ckpt").iterdir()}


def test_a_sharding_no_validator_foresaw_is_one_line_not_a_traceback(capsys):
    """jax's own IndivisibleError (6 rows over dp=4), from any entry point, ends as one `error:` line."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mesh import MeshConfig, make_mesh
    from pjax.cli import run_main

    mesh = make_mesh(MeshConfig(dp=4), jax.devices()[:4])
    assert run_main(lambda: jax.device_put(jnp.zeros((6, 2)), NamedSharding(mesh, P("dp")))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: a dimension does not split over the mesh (") \
        and "choose mesh.dp" in err, err
    with pytest.raises(ValueError, match="not a sharding"):  # any other ValueError is a bug: its traceback stays
        run_main(lambda: (_ for _ in ()).throw(ValueError("not a sharding")))


def test_a_sequence_longer_than_the_models_positions_is_one_warning_and_the_run_trains(checkpoints, tmp_path,
                                                                                      monkeypatch, capfd):
    in_process(monkeypatch)
    status = pjax_train.main(["--no_progress", *SMALL, "model.max_position_embeddings=32", "train.steps=1",
                              f"log.dir={tmp_path}/run", f"data.cache_dir={checkpoints['cache']}"])
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert status == 0 and "error:" not in err and "Traceback" not in err, err
    assert len(warnings) == 1, err
    assert "train.seq_len=64 is longer than model.max_position_embeddings=32" in warnings[0]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"step": 1') == 1


def test_a_refusal_at_the_command_line_is_the_process_s_only_output(tmp_path):
    """In a process of its own, as a user runs it: nothing left running prints after the `error:` line (SP with
    ZeRO-1 and FOMAML once ended in `RuntimeError: cannot schedule new futures after shutdown` after its refusal)."""
    import subprocess

    argv = ["mesh.dp=2", "mesh.tp=2", "train.sequence_parallel=true", "train.zero=1", "meta.algorithm=fomaml",
            "meta.tasks=[data/austen/emma.txt,data/austen/persuasion.txt]", f"log.dir={tmp_path}",
            f"checkpoint.dir={tmp_path}/ckpt"]
    done = subprocess.run([sys.executable, "-m", "pjax.train", "--no_progress", *argv], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.splitlines() == ["error: meta.algorithm=fomaml does not run with train.zero=1; use "
                                        "train.zero=0."], done.stderr
