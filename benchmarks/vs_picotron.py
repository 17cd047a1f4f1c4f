"""pjax against HuggingFace Picotron, side by side: the same shape per layout, tokens/s and their ratio.

    python benchmarks/vs_picotron.py --picotron PATH --python PICOTRON_PYTHON
    python benchmarks/vs_picotron.py --picotron PATH --python PY --layouts 1,dp2 --steps 10 --rounds 3 --plot out.png

For each layout (step.py's names: `1`, `dp2`, `tp2`, `pp2`, `cp2`, `dp2-tp2`, ...) it runs
Picotron's own `train.py` from the checkout at PATH under `torchrun` on CPU (gloo), one process
per device of the layout, then pjax's `benchmarks/step.py` for the same layout, and prints one
JSON object per layout with both tokens/s and pjax / Picotron; a table at the end.

The shape is the pjax config's (`--config`, default picotron-cpu, plus overrides): hidden size,
layers, heads, kv-heads, intermediate size, vocabulary, RoPE theta, sequence length, micro-batch
and gradient accumulation (the same tokens per optimizer step), float32, AdamW at the same lr
(Picotron passes only lr to AdamW: torch's betas, eps and weight decay, no clipping, no schedule).
tokens/s is the same figure on both sides: tokens per optimizer step over the median wall time of
a step, after `--warmup` steps. Picotron logs it per step (3 significant digits); its step reads
the book's tokens through its data loader, pjax's steps a fixed random batch.

Picotron is run, never changed, from the files at PATH. It needs a Python of its own: it calls
`batch_encode_plus`, which transformers 5 removed, so pjax's environment cannot run it. E.g.

    python -m venv .venv-picotron
    .venv-picotron/bin/pip install torch transformers==4.47.0 datasets safetensors wandb

(Picotron's requirements.txt pins the same; flash-attn is not needed on CPU). In the workers,
before Picotron's `train.py` runs, three stand-ins let its CPU path start on a CPU-only torch,
where it otherwise stops: an empty `flash_attn` (imported at the top of picotron/model.py, unused
with FLASH_ATTEN=0), `torch.cuda.synchronize` as a no-op (the pipeline and ring transfers call it
after every exchange; on CPU the exchange has finished once `wait()` returns), and
`get_num_params` (feeds only the logged MFU) with its one `device='cuda'` tensor made on the CPU.
A `wandb` module stands in where wandb is not installed (the runs log to none). Picotron reads a
model folder and a dataset by name: this script writes the shape's `config.json` and the config's
tokenizer to a model folder, the config's text to a dataset folder (one document, as pjax reads a
.txt file), and placeholder weights Picotron loads and then re-initialises, under `--workdir`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# A line of Picotron's log: "[rank 0] Step: 3     | Loss: 8.1234 | ... | Tokens/s:   6.57K | ..."
STEP_LINE = re.compile(r"Step:\s*(\d+)\s*\|\s*Loss:\s*([\d.]+).*?\|\s*Tokens/s:\s*([\d.]+)([KMBT]?)\s*\|")
UNITS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def picotron_config(template: dict, cfg, sizes: dict[str, int], model_dir: str, data_dir: str, steps: int,
                    threads: int, out_dir: str) -> dict:
    """Picotron's config JSON (its template/base_config.json, filled in) for pjax config `cfg` on the
    mesh `sizes`: the same model, tokens per step and lr, float32 on CPU over gloo."""
    mc, tc = cfg.model, cfg.train
    micro_rows = tc.batch_size // tc.grad_accum  # rows of one micro-batch over all of dp, as pjax counts them
    out = json.loads(json.dumps(template))
    out["distributed"].update(tp_size=sizes["tp"], cp_size=sizes["cp"], pp_size=sizes["pp"], dp_size=sizes["dp"],
                              pp_engine=cfg.pipeline.schedule, backend="gloo", use_cpu=True)
    out["model"].update(name=model_dir, num_hidden_layers=mc.num_hidden_layers,
                        num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_key_value_heads,
                        dtype="float32", use_flash_attention=False, use_fused_adam=False)
    out["training"].update(seed=tc.seed, learning_rate=tc.lr, total_train_steps=steps, seq_length=tc.seq_len,
                           micro_batch_size=micro_rows // sizes["dp"], gradient_accumulation_steps=tc.grad_accum,
                           num_samples=None, max_tokens=None)
    out["dataset"].update(name=data_dir, subset_name=None, num_workers=0, num_proc=1)
    out["checkpoint"].update(save_dir=out_dir, save_frequency=steps + 1, load_path="")  # never saves
    out["logging"].update(use_wandb=False, run_name="vs_pjax")
    # HF_TOKEN: train.py insists on one; the model and data are local folders, nothing is downloaded.
    out["environment"].update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", FLASH_ATTEN="0",
                              HF_TOKEN="unused")
    return out


def unsupported(cfg, layout: str) -> str | None:
    """Why Picotron cannot run this config and layout as pjax would, or None."""
    from common import parse_layout
    from models.precision import PrecisionConfig

    sizes, extra = parse_layout(layout)
    mc, tc = cfg.model, cfg.train
    if extra:
        return f"layout {layout!r} sets {' '.join(extra)}; Picotron has only plain dp, tp, pp and cp"
    if cfg.precision.resolve(tc.dtype) != PrecisionConfig(preset="fp32").resolve():
        return "the precision policy is not fp32; Picotron on CPU computes in float32"
    if mc.num_local_experts or mc.tie_word_embeddings or mc.rope_type != "default":
        return "the model has experts, tied embeddings or scaled RoPE; Picotron's LLaMA has none"
    if mc.head_dim != mc.hidden_size // mc.num_attention_heads:
        return f"model.head_dim={mc.head_dim}; Picotron's is hidden_size / num_attention_heads"
    if sizes["pp"] > 1 and cfg.pipeline.schedule not in ("1f1b", "afab"):
        return f"pipeline.schedule={cfg.pipeline.schedule}; Picotron has 1f1b and afab"
    if (tc.batch_size // tc.grad_accum) % sizes["dp"]:
        return "a micro-batch does not split over dp"
    return None


def write_inputs(cfg, workdir: str) -> tuple[str, str]:
    """The model folder (config.json, tokenizer) and dataset folder Picotron reads, and the
    placeholder weights it loads from ./hf_model_safetensors/ before re-initialising every one."""
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    from pjax import assets

    mc = cfg.model
    model_dir, data_dir = os.path.join(workdir, "model"), os.path.join(workdir, "data")
    weights_dir = os.path.join(workdir, "hf_model_safetensors")
    for d in (model_dir, data_dir, weights_dir):
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(mc.to_hf(), f, indent=1)
    tokenizer = assets.locate(cfg.data.tokenizer)
    tokenizer = tokenizer / "tokenizer.json" if tokenizer is not None and tokenizer.is_dir() else tokenizer
    text = assets.locate(cfg.data.path)
    if tokenizer is None or tokenizer.suffix != ".json" or text is None or text.suffix != ".txt":
        raise SystemExit("vs_picotron needs data.tokenizer as a tokenizer.json (or a folder holding one) "
                         "and data.path as a .txt file")
    shutil.copy(tokenizer, os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)  # no BOS/EOS added, as pjax tokenizes
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        f.write(json.dumps({"text": text.read_text(encoding="utf-8")}) + "\n")

    d, f_, hd = mc.hidden_size, mc.intermediate_size, mc.head_dim
    shapes = {"model.embed_tokens.weight": (mc.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(mc.num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes.update({layer + "input_layernorm.weight": (d,), layer + "post_attention_layernorm.weight": (d,),
                       layer + "self_attn.q_proj.weight": (mc.num_attention_heads * hd, d),
                       layer + "self_attn.k_proj.weight": (mc.num_key_value_heads * hd, d),
                       layer + "self_attn.v_proj.weight": (mc.num_key_value_heads * hd, d),
                       layer + "self_attn.o_proj.weight": (d, mc.num_attention_heads * hd),
                       layer + "mlp.gate_proj.weight": (f_, d), layer + "mlp.up_proj.weight": (f_, d),
                       layer + "mlp.down_proj.weight": (d, f_)})
    save_file({k: np.zeros(v, np.float32) for k, v in shapes.items()}, os.path.join(weights_dir, "model.safetensors"))
    return model_dir, data_dir


def picotron_versions(python: str, checkout: str) -> dict:
    """Picotron's commit and the versions its Python brings, or SystemExit saying what to install."""
    probe = ("import json, torch, transformers, datasets, safetensors; "
             "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__}))")
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    versions = json.loads(proc.stdout) if proc.returncode == 0 else None
    if versions is None or int(versions["transformers"].split(".")[0]) >= 5:
        why = f"transformers {versions['transformers']}" if versions else (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"{python} cannot run Picotron ({why}); give --python a Python with torch, transformers<5 "
                         f"(Picotron pins 4.47.0), datasets and safetensors, e.g. a venv made with: "
                         f"pip install torch transformers==4.47.0 datasets safetensors wandb")
    commit = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"commit": commit.stdout.strip() or None, **versions}


def run_picotron(python: str, checkout: str, config_path: str, workdir: str, devices: int, threads: int,
                 warmup: int, timeout: int) -> dict:
    """Picotron's train.py under torchrun, its log parsed: median tokens/s of the steps after `warmup`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DTYPE": "float32",  # RoPE tables in fp32 too
           "HF_HOME": os.path.join(workdir, "hf_home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(devices),
           __file__, "--launch-picotron", checkout, "--config", config_path]
    # A session of its own, so that a run past the timeout is ended with all its workers.
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"Picotron did not finish in {timeout} s"}
    steps = [(int(s), float(loss), float(tps) * UNITS[unit]) for s, loss, tps, unit in STEP_LINE.findall(log)]
    timed = [tps for s, _, tps in steps if s > warmup]
    if proc.returncode or not timed:
        errors = [line.strip() for line in log.splitlines() if re.match(r"\s*\w*(Error|Exception)\b", line)]
        return {"error": (errors or log.strip().splitlines() or ["?"])[-1][:300]}
    tokens_per_sec = 1 / statistics.median(1 / tps for tps in timed)  # tokens per step / median step time
    return {"tokens_per_sec": round(tokens_per_sec), "loss_first_last": [steps[0][1], steps[-1][1]]}


def launch_picotron(checkout: str, argv: list[str]) -> None:
    """In a torchrun worker (Picotron's Python, no pjax): Picotron's train.py as its own __main__,
    with the stand-ins the module docstring lists."""
    import importlib.util
    import runpy
    import types

    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]  # benchmarks/ shadows names
    sys.path.insert(0, checkout)
    import torch

    def missing(*_, **__):
        raise RuntimeError("flash-attn is not installed (FLASH_ATTEN=0 keeps Picotron off it)")

    if importlib.util.find_spec("flash_attn") is None:
        for name, attrs in {"flash_attn": {}, "flash_attn.flash_attn_interface": {"flash_attn_func": missing},
                            "flash_attn.layers": {}, "flash_attn.layers.rotary": {"apply_rotary_emb": missing},
                            "flash_attn.ops": {}, "flash_attn.ops.triton": {},
                            "flash_attn.ops.triton.layer_norm": {"layer_norm_fn": missing}}.items():
            sys.modules[name] = types.ModuleType(name)
            vars(sys.modules[name]).update(attrs)
    if importlib.util.find_spec("wandb") is None:
        sys.modules["wandb"] = types.ModuleType("wandb")
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *_, **__: None
        import picotron.utils

        count_params = picotron.utils.get_num_params

        def get_num_params_on_cpu(model):
            make_tensor = torch.tensor
            torch.tensor = lambda *args, device=None, **kwargs: make_tensor(*args, **kwargs)
            try:
                return count_params(model)
            finally:
                torch.tensor = make_tensor

        picotron.utils.get_num_params = get_num_params_on_cpu
    train = os.path.join(checkout, "train.py")
    sys.argv = [train, *argv]
    runpy.run_path(train, run_name="__main__")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--launch-picotron":
        launch_picotron(sys.argv[2], sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--picotron", required=True, help="a checkout of huggingface/picotron")
    ap.add_argument("--python", default=sys.executable, help="the Python that runs Picotron (see above)")
    ap.add_argument("--config", default="picotron-cpu")
    ap.add_argument("--layouts", default="1,dp2,tp2,pp2,cp2")
    ap.add_argument("--steps", type=int, default=10, help="timed steps, each side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="Picotron then pjax, this many times per layout (medians)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OpenMP threads per Picotron process (default: the cores over the layout's processes)")
    ap.add_argument("--workdir", default="runs/vs_picotron", help="Picotron's model, data, configs and caches")
    ap.add_argument("--timeout", type=int, default=600, help="seconds for one Picotron run")
    ap.add_argument("--plot", default=None, help="write a bar chart of both tokens/s to this PNG")
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every layout")
    args = ap.parse_args()

    from common import parse_layout
    from pjax.config_io import load_config
    from step import plot, run_layout

    checkout, workdir = os.path.abspath(args.picotron), os.path.abspath(args.workdir)
    if not os.path.isfile(os.path.join(checkout, "train.py")):
        raise SystemExit(f"--picotron {args.picotron} holds no train.py; give a checkout of huggingface/picotron")
    with open(os.path.join(checkout, "template", "base_config.json")) as f:
        template = json.load(f)
    picotron = picotron_versions(args.python, checkout)
    cores = len(os.sched_getaffinity(0))
    model_dir = data_dir = None
    results = []
    for layout in args.layouts.split(","):
        sizes, _ = parse_layout(layout)
        cfg = load_config(args.config, [f"mesh.{k}={v}" for k, v in sizes.items()] + list(args.overrides))
        devices = sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]
        threads = args.threads or max(1, cores // devices)  # the processes share the cores, as pjax's devices do
        result = {"layout": layout, "config": args.config, "devices": devices,
                  "tokens_per_step": cfg.train.batch_size * cfg.train.seq_len}
        why = unsupported(cfg, layout)
        if why:
            result["error"] = why
            print(json.dumps(result), flush=True)
            results.append(result)
            continue
        if model_dir is None:
            model_dir, data_dir = write_inputs(cfg, workdir)
        config_path = os.path.join(workdir, "configs", f"{layout}.json")
        os.makedirs(os.path.dirname(config_path), exist_ok=True)
        with open(config_path, "w") as f:
            json.dump(picotron_config(template, cfg, sizes, model_dir, data_dir, args.warmup + args.steps, threads,
                                      os.path.join(workdir, "ckpt", layout)), f, indent=1)
        rounds = []
        for _ in range(args.rounds):
            pico = run_picotron(args.python, checkout, config_path, workdir, devices, threads, args.warmup,
                                args.timeout)
            ours = run_layout(args.config, layout, args.steps, args.warmup, False, list(args.overrides))
            rounds.append({"picotron": pico, "pjax": ours})
            if "error" in pico or "error" in ours:
                break
        errors = {side: r[side]["error"] for r in rounds for side in r if "error" in r[side]}
        if errors:
            result["error"] = errors
        else:
            pico_tps = statistics.median(r["picotron"]["tokens_per_sec"] for r in rounds)
            ours_tps = statistics.median(r["pjax"]["tokens_per_sec"] for r in rounds)
            result.update(pjax_tokens_per_sec=round(ours_tps), picotron_tokens_per_sec=round(pico_tps),
                          ratio=round(ours_tps / pico_tps, 3),
                          rounds=[{side: r[side]["tokens_per_sec"] for side in ("pjax", "picotron")} for r in rounds],
                          picotron_loss_first_last=rounds[-1]["picotron"]["loss_first_last"],
                          picotron_threads_per_process=threads)
        result["picotron"] = picotron
        print(json.dumps(result), flush=True)
        results.append(result)

    print(f"\n{'layout':<10} {'pjax tok/s':>11} {'Picotron tok/s':>15} {'ratio':>6}")
    for r in results:
        if "error" in r:
            print(f"{r['layout']:<10} error: {r['error']}")
        else:
            print(f"{r['layout']:<10} {r['pjax_tokens_per_sec']:>11,} {r['picotron_tokens_per_sec']:>15,} "
                  f"{r['ratio']:>6.2f}")
    print(f"Picotron {picotron['commit']} (torch {picotron['torch']}, transformers {picotron['transformers']}), "
          f"{cores} cores, {args.steps} steps after {args.warmup}, {args.rounds} round(s)")
    if args.plot:
        plot([{"layout": r["layout"], "tokens_per_sec": r["pjax_tokens_per_sec"],
               "picotron_tokens_per_sec": r["picotron_tokens_per_sec"]} for r in results if "ratio" in r], args.plot)


if __name__ == "__main__":
    main()
