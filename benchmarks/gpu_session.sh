#!/usr/bin/env bash
# The GPU figures the open issues ask for, in one visit to a lent GPU (run from the repository root there):
#   bash benchmarks/gpu_session.sh precision   # smoke step, precision presets on SmolLM-360M/1.7B, calibration
#   bash benchmarks/gpu_session.sh remat       # each remat policy on SmolLM-360M/1.7B: time and allocator peak
#   bash benchmarks/gpu_session.sh calibrate   # the planner's calibration, then held-out steps to check it on
#   bash benchmarks/gpu_session.sh cudnn       # the image's jax: does cuDNN's attention compile for 8 GPUs with dp?
#   bash benchmarks/gpu_session.sh products    # the calibration with SmolLM-360M's and 1.7B's own products
#   bash benchmarks/gpu_session.sh held-out    # the steps it is checked against, with their compiled products
#   bash benchmarks/gpu_session.sh visit       # products, then held-out if time is left: one device call
#   bash benchmarks/gpu_session.sh pod         # issue 57: SmolLM-360M/1.7B, bf16/fp8, remat none/shipped, with
#                                              # pjax's defaults (cuDNN attention, XLA options); dp/tp scaling
#                                              # where several GPUs are lent; ends within 12 minutes
# Each result is a JSON line in $OUT/<part>.jsonl (benchmarks/step.py's), the calibration $OUT/calibration.json.
set -u
OUT=${OUT:-/tmp/pjax_gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} TF_CPP_MIN_LOG_LEVEL=2
# benchmarks/step.py compiles ahead of time for the memory figures, then jit compiles the same program:
# the persistent cache makes the second a lookup.
export JAX_COMPILATION_CACHE_DIR=/tmp/jcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
PY=${PY:-python3}
F8='__cublas$lt$matmul$f8'

step() {  # step CONFIG TIMEOUT PART ARGS...: one benchmarks/step.py run (layout $LAYOUT, default 1), its JSON line appended
  local config=$1 limit=$2 part=$3; shift 3
  echo "== $config ${LAYOUT:-1} $*"
  timeout "$limit" $PY benchmarks/step.py --config "$config" --layouts "${LAYOUT:-1}" "$@" 2>>"$OUT/$part.err" \
    | grep '^{"layout"' | tee -a "$OUT/$part.jsonl" || echo "{\"config\": \"$config\", \"args\": \"$*\", \"error\": \"timeout or crash\"}" | tee -a "$OUT/$part.jsonl"
}

case ${1:-precision} in
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
pod)
  # Tokens/s, MFU and the fp8 GEMM count per run (benchmarks/step.py's JSON lines in $OUT/pod.jsonl); each run
  # is skipped once 11 minutes have gone, so the part ends within 12. Targets (issue 57): SmolLM-1.7B bf16 at
  # >= 55% MFU on one H100, fp8 >= 1.2x bf16 tokens/s.
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/env.txt"
  $PY -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/env.txt"
  run() { if [ $SECONDS -lt 660 ]; then step "$@"; else echo "skipped (time): $*" | tee -a "$OUT/pod.jsonl"; fi; }
  for p in bf16 fp8; do
    for r in none dots_no_batch; do
      run smollm-1.7b 120 pod --steps 5 --warmup 2 --hlo-count "$F8" precision.preset=$p train.remat=$r \
        train.batch_size=16 train.grad_accum=4
    done
  done
  for p in bf16 fp8; do
    for r in none dots_no_batch; do
      run smollm-360m 100 pod --steps 5 --warmup 2 --hlo-count "$F8" precision.preset=$p train.remat=$r \
        train.batch_size=32 train.grad_accum=4
    done
  done
  gpus=$($PY -c "import jax; print(jax.device_count())")
  if [ "$gpus" -gt 1 ]; then  # scaling: dp n at the same per-GPU batch (360M), tp n at the same batch (1.7B)
    LAYOUT=dp$gpus run smollm-360m 150 pod --steps 5 --warmup 2 train.batch_size=$((32 * gpus)) train.grad_accum=4
    LAYOUT=dp$gpus-zero1 run smollm-360m 150 pod --steps 5 --warmup 2 train.batch_size=$((32 * gpus)) train.grad_accum=4
    LAYOUT=tp$gpus run smollm-1.7b 150 pod --steps 5 --warmup 2 train.batch_size=16 train.grad_accum=4
  fi
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
