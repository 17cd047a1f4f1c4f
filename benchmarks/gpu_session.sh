#!/usr/bin/env bash
# The GPU figures the open issues ask for, in visits to a lent GPU (run from the repository root there):
#   bash benchmarks/gpu_session.sh headline    # SmolLM-1.7B on one GPU, remat none: bf16, fp8, and bf16 with
#                                              # train.xla_options=false (the control); one call, under 9 minutes
#   bash benchmarks/gpu_session.sh rest        # SmolLM-360M bf16/fp8, the shipped remat policy, fp8 against bf16
#                                              # over 100 steps, dp/tp scaling where several GPUs are lent
#   bash benchmarks/gpu_session.sh precision   # smoke step, precision presets on SmolLM-360M/1.7B, calibration
#   bash benchmarks/gpu_session.sh remat       # each remat policy on SmolLM-360M/1.7B: time and allocator peak
#   bash benchmarks/gpu_session.sh calibrate   # the planner's calibration, then held-out steps to check it on
#   bash benchmarks/gpu_session.sh cudnn       # the image's jax: does cuDNN's attention compile for 8 GPUs with dp?
#   bash benchmarks/gpu_session.sh products    # the calibration with SmolLM-360M's and 1.7B's own products
#   bash benchmarks/gpu_session.sh held-out    # the steps it is checked against, with their compiled products
#   bash benchmarks/gpu_session.sh visit       # products, then held-out if time is left: one device call
#   bash benchmarks/gpu_session.sh pod         # headline, then rest (two calls' worth: only where time allows)
# Each result is a JSON line in $OUT/<part>.jsonl (benchmarks/step.py's: compile and step time, memory, cuDNN's
# calls and each GEMM kind's FLOP share read from the compiled step, pjax's XLA options and XLA_FLAGS), every
# run's whole stderr in $OUT/<part>.err under a header naming the run, the calibration $OUT/calibration.json.
set -u -o pipefail
OUT=${OUT:-/tmp/pjax_gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} TF_CPP_MIN_LOG_LEVEL=2
# JAX's default share of the GPU's memory, said rather than assumed (the planner's --mem-fraction default).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.75}
# benchmarks/step.py compiles ahead of time for the memory figures, then jit compiles the same program:
# the persistent cache makes the second a lookup.
export JAX_COMPILATION_CACHE_DIR=/tmp/jcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
PY=${PY:-python3}
F8='__cublas$lt$matmul$f8'

step() {  # step CONFIG TIMEOUT PART ARGS...: one benchmarks/step.py run (layout $LAYOUT, default 1), its JSON line appended
  local config=$1 limit=$2 part=$3 rc; shift 3
  echo "== $config ${LAYOUT:-1} $*" | tee -a "$OUT/$part.err"
  timeout "$limit" $PY benchmarks/step.py --config "$config" --layouts "${LAYOUT:-1}" "$@" 2>>"$OUT/$part.err" \
    >"$OUT/.step.out"; rc=$?
  grep '^{"layout"' "$OUT/.step.out" | tee -a "$OUT/$part.jsonl" \
    || echo "{\"config\": \"$config\", \"args\": \"$*\", \"error\": \"exit $rc (124: timeout), $OUT/$part.err\"}" \
    | tee -a "$OUT/$part.jsonl"
}

env_line() {  # the GPU, its driver and the software, once per part
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee -a "$OUT/env.txt"
  $PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" \
    | tee -a "$OUT/env.txt"
  git log -1 --format='pjax %H %cd' 2>/dev/null | tee -a "$OUT/env.txt"
}

losses() {  # losses PRESET: 100 steps of SmolLM-360M on the shipped text, metrics in $OUT/loss_PRESET
  echo "== loss $1" | tee -a "$OUT/rest.err"
  timeout 200 $PY -m pjax.train --config smollm-360m precision.preset=$1 train.steps=100 train.warmup_steps=10 \
    train.batch_size=32 train.grad_accum=4 mesh.dp=1 checkpoint.every=0 log.every=10 log.dir="$OUT/loss_$1" \
    >>"$OUT/rest.err" 2>&1 || echo "loss $1: exit $?" | tee -a "$OUT/rest.jsonl"
}

case ${1:-headline} in
headline)
  # SmolLM-1.7B on one H100 or H200, remat none: pjax's bf16 and fp8 steps, and the control without pjax's XLA
  # options. Targets (issue 74): bf16 at least its 2026-11 figure, fp8 at least 1.2x bf16 tokens/s.
  env_line
  for args in "precision.preset=bf16" "precision.preset=fp8" "precision.preset=bf16 train.xla_options=false"; do
    # shellcheck disable=SC2086
    step smollm-1.7b 150 headline --steps 5 --warmup 2 $args train.remat=none train.batch_size=16 train.grad_accum=4
  done
  ;;
rest)
  env_line
  run() { if [ $SECONDS -lt 420 ]; then step "$@"; else echo "skipped (time): $*" | tee -a "$OUT/rest.jsonl"; fi; }
  for p in bf16 fp8; do
    run smollm-360m 100 rest --steps 5 --warmup 2 precision.preset=$p train.remat=none train.batch_size=32 train.grad_accum=4
  done
  run smollm-1.7b 120 rest --steps 5 --warmup 2 precision.preset=bf16 train.batch_size=16 train.grad_accum=4  # shipped remat
  # fp8 against bf16 over 100 steps on the same batches (goal: within 1%): the mean of the losses logged at steps 90 and 100
  losses bf16; losses fp8
  $PY -c "
import json, sys
def tail(p):
    rows = [json.loads(l) for l in open(f'$OUT/loss_{p}/metrics.jsonl')]
    losses = [r['loss'] for r in rows if r.get('loss') is not None][-2:]
    return sum(losses) / len(losses)
b, f = tail('bf16'), tail('fp8')
print(json.dumps({'loss_check': 'smollm-360m 100 steps', 'bf16': round(b, 4), 'fp8': round(f, 4), 'fp8_over_bf16': round(f / b, 4)}))
" | tee -a "$OUT/rest.jsonl"
  gpus=$($PY -c "import jax; print(jax.device_count())")
  if [ "$gpus" -gt 1 ]; then  # scaling: dp n at the same per-GPU batch (360M), tp n at the same batch (1.7B)
    LAYOUT=dp$gpus-zero1 run smollm-360m 150 rest --steps 5 --warmup 2 train.batch_size=$((32 * gpus)) train.grad_accum=4
    LAYOUT=tp$gpus run smollm-1.7b 150 rest --steps 5 --warmup 2 train.batch_size=16 train.grad_accum=4
  fi
  ;;
precision)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/env.txt"
  $PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" | tee -a "$OUT/env.txt"
  step debug 120 precision --steps 3 --warmup 1
  for p in bf16 bf16-lean fp8; do
    step smollm-360m 150 precision --steps 6 --warmup 2 --hlo-count "$F8" precision.preset=$p train.batch_size=32 train.grad_accum=4
  done
  for p in bf16 bf16-lean fp8; do
    step smollm-1.7b 150 precision --steps 6 --warmup 2 --hlo-count "$F8" precision.preset=$p train.batch_size=16 train.grad_accum=4
  done
  timeout 150 $PY -m pjax.plan.calibrate --out "$OUT/calibration.json" 2>"$OUT/calibration.err" | tail -1
  ;;
remat)
  for r in none full names offload; do
    step smollm-360m 150 remat --steps 5 --warmup 1 train.remat=$r train.batch_size=32 train.grad_accum=4
  done
  for r in none full names; do
    step smollm-1.7b 150 remat --steps 5 --warmup 1 train.remat=$r train.batch_size=16 train.grad_accum=4
  done
  ;;
calibrate)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/env.txt"
  timeout 120 $PY -m pjax.plan.calibrate --verbose --out "$OUT/calibration.json" 2>"$OUT/calibration.err" | tail -1
  timeout 200 $PY -m pjax.plan.calibrate --quick --dtypes float8_e4m3fn --verbose --out "$OUT/calibration_fp8.json" \
    2>"$OUT/calibration_fp8.err" | tail -1
  for r in dots_no_batch none; do
    step smollm-360m 120 calibrate --steps 5 --warmup 1 train.remat=$r train.batch_size=32 train.grad_accum=4
    step smollm-1.7b 150 calibrate --steps 5 --warmup 1 train.remat=$r train.batch_size=16 train.grad_accum=4
  done
  ;;
products)
  # The calibration with SmolLM-360M's and SmolLM-1.7B's own compiled products, timed as the calibration now
  # times a GPU (4 products per call, 8 calls queued per sample: benchmarks/README.md, "One H200, third visit").
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/env.txt"
  timeout 180 $PY -m pjax.plan.calibrate --quick --verbose --config smollm-360m train.batch_size=32 train.grad_accum=4 \
    --only matmul,attention,bandwidth --out "$OUT/calibration.json" 2>>"$OUT/products.err" | tail -1
  timeout 150 $PY -m pjax.plan.calibrate --quick --verbose --config smollm-1.7b train.batch_size=16 train.grad_accum=4 \
    --only matmul --out "$OUT/calibration_1.7b.json" 2>>"$OUT/products.err" | tail -1
  ;;
held-out)  # the steps `products` is checked against: time, allocator peak and the compiled step's products
  step smollm-360m 100 held-out --steps 5 --warmup 1 train.remat=none train.batch_size=32 train.grad_accum=4
  step smollm-1.7b 110 held-out --steps 5 --warmup 1 train.remat=none train.batch_size=16 train.grad_accum=4
  ;;
visit)  # what issue 41 still needs from one GPU, in one call that ends within ~8 minutes
  bash "$0" products
  if [ $SECONDS -lt 330 ]; then bash "$0" held-out; fi
  ;;
pod)  # both parts in one go, where a call may run that long
  bash "$0" headline; bash "$0" rest
  ;;
cudnn)
  # Whether cuDNN's attention compiles for 8 GPUs with dp in this image's jax; compile-only GPUs answer in
  # seconds, and "attention chunked" in the head line would mean pjax.cudnn_fallback had to step in.
  $PY -c "import jax; print('jax', jax.__version__)" | tee "$OUT/cudnn.txt"
  for layout in dp8 dp8-zero1 dp8-zero3; do
    timeout 120 $PY -m pjax.plan --config smollm-360m --devices 8 --xla gpu --explain $layout train.batch_size=32 \
      2>>"$OUT/cudnn.err" | head -1 | tee -a "$OUT/cudnn.txt"
  done
  ;;
esac
