"""PyTorch reference for `step.py` on a GPU: the same LLaMA, batch and optimizer in HF transformers.

    python benchmarks/torch_step.py --config smollm-360m train.batch_size=32 train.grad_accum=4
    python benchmarks/torch_step.py --config smollm-360m --weights bf16 --compile

Picotron is not installable from a package registry; its training step is a LLaMA built like HF's
(fused SDPA/flash attention, bf16) stepped by AdamW, and this script is that step with HF's own
`LlamaForCausalLM`, so pjax's GPU numbers have a PyTorch figure next to them on the same card.
`--weights fp32` (default) keeps fp32 weights and runs the matmuls under bf16 autocast, as pjax's
`train.dtype=bfloat16` does; `--weights bf16` holds the weights in bf16 as Picotron does. Prints
one JSON object with the step time, tokens/s and MFU counted as pjax counts them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="smollm-360m")
    ap.add_argument("--weights", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--remat", action="store_true", help="HF gradient checkpointing (recompute each layer)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="config overrides, as for pjax.train")
    args = ap.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    from pjax.config_io import load_config
    from pjax.observe.metrics import PEAK_BF16, model_flops_per_token

    cfg = load_config(args.config, list(args.overrides))
    mc, tc = cfg.model, cfg.train
    dev = torch.device("cuda")
    hf = HFConfig(**{k: v for k, v in mc.to_hf().items() if k not in ("architectures", "model_type")})
    hf._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hf).to(dev, torch.bfloat16 if args.weights == "bf16" else torch.float32)
    if args.remat:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps,
                            weight_decay=tc.weight_decay, fused=True)
    fwd = torch.compile(model) if args.compile else model

    micro = tc.batch_size // tc.grad_accum
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(0, mc.vocab_size, (tc.grad_accum, micro, tc.seq_len + 1))).to(dev)

    def step() -> torch.Tensor:
        total = torch.zeros((), device=dev)
        for k in range(tc.grad_accum):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.weights == "fp32"):
                logits = fwd(tokens[k, :, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[k, :, 1:].flatten()) / tc.grad_accum
            loss.backward()
            total += loss.detach()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times))
    tps = tc.batch_size * tc.seq_len / step_s
    name = torch.cuda.get_device_name()
    peak = next((p for n, p in PEAK_BF16 if n in name), None)
    flops = tps * model_flops_per_token(mc, tc.seq_len)
    print(json.dumps({
        "impl": f"torch {torch.__version__} HF LlamaForCausalLM sdpa", "config": args.config, "device": name,
        "weights": args.weights, "compile": args.compile, "remat": args.remat,
        "batch": tc.batch_size, "grad_accum": tc.grad_accum, "seq_len": tc.seq_len,
        "step_ms": round(1000 * step_s, 1), "tokens_per_sec": round(tps), "model_tflops": round(flops / 1e12, 1),
        "mfu": None if not peak else round(flops / peak, 4), "loss": round(float(loss), 4),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }))


if __name__ == "__main__":
    main()
