"""Load balance of a small fine-grained MoE over a training run: the auxiliary loss (softmax routing, Switch's
loss) against bias balancing (sigmoid routing, DeepSeek-V3's per-expert selection bias, no auxiliary loss) at
two update rates.

    python benchmarks/moe_balance.py                        # 200 steps each on the shipped text, one CPU device
    python benchmarks/moe_balance.py --steps 50 --plot benchmarks/plots   (from the repository root)

Both runs train `mixtral-tiny` made fine-grained (--experts experts of width --width, top --top_k) on one
device with the same data, seed and learning rate; metrics.jsonl's `load_max` (the most loaded expert against
an even share, over every layer's assignments of the step) is logged every step. One JSON line per run: the
mean of load_max over the first and the last quarter of the steps, its last value, the final loss.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

BIAS = ["model.router_score=sigmoid", "model.router_aux_loss_coef=0.0"]
RUNS = {"aux_loss": ["model.router_score=softmax", "model.router_aux_loss_coef=0.02"],
        "bias_0.001": [*BIAS, "moe.bias_update_rate=0.001"],  # DeepSeek-V3's rate (pjax's default)
        "bias_0.01": [*BIAS, "moe.bias_update_rate=0.01"]}


def run(name: str, args: argparse.Namespace, root: str) -> dict:
    import jax

    from pjax.config_io import load_config
    from pjax.train import train

    model = [f"model.num_local_experts={args.experts}", f"model.num_experts_per_tok={args.top_k}",
             f"model.intermediate_size={args.width}"]
    cfg = load_config("mixtral-tiny", [*model, *RUNS[name], "mesh.dp=1", "mesh.tp=1", f"train.steps={args.steps}",
                                       "log.every=1", "log.eval_every=0", f"log.dir={root}/{name}"])
    records = [r for r in train(cfg, progress=False, devices=jax.devices()[:1]) if "load_max" in r]
    loads = [r["load_max"] for r in records]
    quarter = max(1, len(loads) // 4)
    return {"run": name, "experts": args.experts, "top_k": args.top_k, "width": args.width, "steps": len(loads),
            "load_max_first_quarter": statistics.mean(loads[:quarter]),
            "load_max_last_quarter": statistics.mean(loads[-quarter:]), "load_max_last": loads[-1],
            "loss_last": records[-1]["loss"], "series": loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top_k", type=int, default=4)
    ap.add_argument("--width", type=int, default=48, help="each expert's intermediate size")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"a comma-separated subset of {', '.join(RUNS)}")
    ap.add_argument("--plot", default=None, help="directory for moe_balance.png")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        results = [run(name, args, root) for name in args.runs.split(",")]
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "series"}))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in results:
            ax.plot(range(1, len(r["series"]) + 1), r["series"], label=r["run"])
        ax.set_xlabel("step")
        ax.set_ylabel("load_max (x an even share)")
        ax.set_title(f"{args.experts} experts, top-{args.top_k}: auxiliary loss vs bias balancing")
        ax.legend()
        os.makedirs(args.plot, exist_ok=True)
        fig.savefig(os.path.join(args.plot, "moe_balance.png"), dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
