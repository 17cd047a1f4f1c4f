"""Is building a batch on the step's critical path? Host time per batch, and step time with and
without `data.prefetch`, for the cached token stream and a streamed JSONL corpus.

    python benchmarks/data_prefetch.py --jsonl /tmp/docs100k.jsonl            # writes the corpus first if missing
    python benchmarks/data_prefetch.py --jsonl /tmp/docs100k.jsonl --rounds 3 --steps 60

1. `host`: the loop's `next()` alone, in this process (no training): ms per batch of
   `--config`'s batch, for the shipped text from the token cache, the JSONL from the token cache,
   and the JSONL streamed (data.streaming=true; its first chunk is read when it is built).
2. `overlap`: the streamed JSONL's batches taken by a loop whose "step" sleeps `--sleep_ms`, a
   host left free as it is while an accelerator runs the step: the wait per batch and the time
   per step without prefetch, with pjax's thread (data.prefetch=2), and with grain's thread
   prefetch (`ThreadPrefetchIterDataset`, buffer 2) when grain is importable.
3. `step`: `python -m pjax.train --config ...` runs, each in its own process, prefetch 0 and 2
   interleaved per round (so a noisy machine hits both alike), for the cached text and the
   streamed JSONL: the median over logged intervals (the first, with compilation, left out) of
   `step_time_s` and of `data_wait_s`, the time the loop waited for its batch per step.
Output: one JSON object per measurement on stdout.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_corpus(path: Path, n_docs: int, seed: int = 0) -> None:
    """n_docs documents of 1 to 3 consecutive paragraphs of the shipped book (~600 characters each)."""
    import numpy as np

    from pjax import assets

    paragraphs = [p.strip() for p in (assets.ROOT / "data/prideprejudice.txt").read_text().split("\n\n") if p.strip()]
    rng = np.random.default_rng(seed)
    starts, lengths = rng.integers(0, len(paragraphs) - 3, n_docs), rng.integers(1, 4, n_docs)
    with path.open("w") as f:
        for start, length in zip(starts, lengths):
            f.write(json.dumps({"text": "\n\n".join(paragraphs[start:start + length])}) + "\n")


def host_times(config: str, jsonl: str, cache: str, batches: int) -> None:
    import jax
    import numpy as np

    from mesh.mesh import make_mesh
    from pjax.config_io import load_config
    from pjax.data import build_data

    for name, overrides in (("text, cached", []), ("jsonl, cached", [f"data.path={jsonl}"]),
                            ("jsonl, streamed", [f"data.path={jsonl}", "data.streaming=true"])):
        cfg = load_config(config, [f"data.cache_dir={cache}", *overrides])
        t0 = time.perf_counter()
        it, _, _ = build_data(cfg.data, cfg.train, make_mesh(cfg.mesh, jax.devices()[:cfg.mesh.size]))
        built = time.perf_counter() - t0
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            jax.block_until_ready(next(it))
            times.append(time.perf_counter() - t0)
        ms = np.asarray(times) * 1e3
        print(json.dumps({"kind": "host", "data": name, "build_s": round(built, 2), "batches": batches,
                          "mean_ms": round(float(ms.mean()), 3), "median_ms": round(float(np.median(ms)), 3),
                          "p95_ms": round(float(np.percentile(ms, 95)), 3), "max_ms": round(float(ms.max()), 3),
                          "tokens_per_batch": cfg.train.batch_size * cfg.train.seq_len}), flush=True)


def overlap_times(config: str, jsonl: str, sleep_ms: float, batches: int) -> None:
    import jax

    from mesh.mesh import make_mesh
    from pjax.config_io import load_config
    from pjax.data import build_data
    from pjax.data.prefetch import Prefetcher

    cfg = load_config(config, [f"data.path={jsonl}", "data.streaming=true"])

    def fresh():
        return build_data(cfg.data, cfg.train, make_mesh(cfg.mesh, jax.devices()[:cfg.mesh.size]))[0]

    def grain_thread(source):
        import grain

        class Source(grain.DatasetIterator):
            def __next__(self):
                return next(source)

            def get_state(self):
                return source.state()

            def set_state(self, state):
                source.restore(state)

        class Stream(grain.IterDataset):
            def __iter__(self):
                return Source()

        return iter(grain.experimental.ThreadPrefetchIterDataset(Stream(), prefetch_buffer_size=2))

    modes = {"none": lambda: fresh(), "thread": lambda: Prefetcher(fresh(), 2)}
    if importlib.util.find_spec("grain") is not None:  # optional: only this comparison uses it
        modes["grain thread"] = lambda: grain_thread(fresh())
    for name, make in modes.items():
        it = make()
        jax.block_until_ready(next(it))  # the thread started, its first batch out of the way
        waits, t_start = [], time.perf_counter()
        for _ in range(batches):
            t0 = time.perf_counter()
            jax.block_until_ready(next(it))
            waits.append(time.perf_counter() - t0)
            time.sleep(sleep_ms / 1e3)
        per_step = (time.perf_counter() - t_start) / batches
        getattr(it, "close", lambda: None)()
        print(json.dumps({"kind": "overlap", "prefetch": name, "sleep_ms": sleep_ms, "batches": batches,
                          "wait_ms": round(1e3 * statistics.mean(waits), 3),
                          "max_wait_ms": round(1e3 * max(waits), 3), "step_ms": round(1e3 * per_step, 2)}), flush=True)


def train_once(config: str, overrides: list[str], steps: int, every: int, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as run:
        cmd = [sys.executable, "-m", "pjax.train", "--config", config, "--no_progress", f"train.steps={steps}",
               f"log.every={every}", "log.eval_every=0", f"log.dir={run}", *overrides]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-2000:])
        records = [json.loads(line) for line in Path(run, "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "step_time_s" in r and not r.get("includes_compile")]
    return {"step_ms": 1e3 * statistics.median(r["step_time_s"] for r in timed),
            "data_wait_ms": 1e3 * statistics.median(r["data_wait_s"] for r in timed)}


def measure(args: argparse.Namespace, jsonl: Path, cache: str) -> None:
    """The parts asked for, with the token cache (and compiled programs) in `cache`."""
    if args.only in (None, "host"):
        host_times(args.config, str(jsonl), cache, args.batches)
    if args.only in (None, "overlap"):
        overlap_times(args.config, str(jsonl), args.sleep_ms, args.batches)
    if args.only not in (None, "step"):
        return
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", f"{cache}/xla")}
    for round_ in range(args.rounds):
        for name, data in (("text, cached", []), ("jsonl, streamed", [f"data.path={jsonl}", "data.streaming=true"])):
            for prefetch in (0, 2):
                result = train_once(args.config, [f"data.cache_dir={cache}", f"data.prefetch={prefetch}", *data],
                                    args.steps, args.every, env)
                print(json.dumps({"kind": "step", "round": round_, "data": name, "prefetch": prefetch,
                                  **{k: round(v, 2) for k, v in result.items()}}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="picotron-cpu")
    ap.add_argument("--jsonl", required=True, help="the JSONL corpus (written with --docs documents if missing)")
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--batches", type=int, default=200, help="batches timed per source in the host part")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sleep_ms", type=float, default=30.0, help="the overlap part's stand-in step")
    ap.add_argument("--only", choices=("host", "overlap", "step"), default=None)
    args = ap.parse_args()
    jsonl = Path(args.jsonl)
    if not jsonl.exists():
        write_corpus(jsonl, args.docs)
    with tempfile.TemporaryDirectory(prefix="pjax-bench-tokens-") as cache:
        measure(args, jsonl, cache)



if __name__ == "__main__":
    main()
