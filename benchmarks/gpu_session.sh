#!/usr/bin/env bash
# One prepared GPU session (NVIDIA or AMD): the GPU tests, then the kernel benchmark, each phase
# under its own time limit, every output written to $OUT (default benchmarks/results/gpu-run).
# Runs with whatever python3 holds torch + triton there (no install: the repo is on PYTHONPATH).
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh [tests] [main] [layouts] [asm] [others] [bf16] [swap] [peers]
#
# The phases' limits add up to 820 s, more than one device call may run (600 s), so the default
# is the first four (at most 510 s: what decides PRESHUFFLED_BACKENDS, ASM_PAIR_OPS and
# ASM_DOT_PAIR_OPS); `others bf16 swap` (at most 300 s) is a second call where the budget allows,
# `peers` (bf16: tinygemm's CUDA kernel takes bf16 only) a third, or in place of `others`.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
PHASES=${*:-tests main layouts asm}
PY=${PY:-python3}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null \
    || rocm-smi --showproductname 2>/dev/null
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/machine.txt"

for phase in $PHASES; do
  case $phase in
    tests)  # SIGINT at the limit: pytest still prints the failures of what ran
      stamp "GPU tests"
      timeout -s INT 100 $PY -m pytest -q -p no:cacheprovider -p no:benchmark -m gpu -n 16 --tb=short -rfE \
        tests/test_triton_kernels.py tests/test_peer_backends.py > "$OUT/tests.txt" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -30 ;;
    main)  # the w4g128 sweep: every M and layer shape of the issue
      stamp "benchmark: w4g128, all shapes"
      timeout 130 $PY benchmarks/kernel_speed.py --device cuda --schemes w4g128 --prewarm 16 --deadline 95 \
        --out "$OUT" --tag=-w4g128 2>&1 | grep -v '^{' ;;
    layouts)  # the pre-shuffled qweight (opt-in) against GPTQ's, decode sizes: decides wq_gemm.PRESHUFFLED_BACKENDS
      stamp "benchmark: qweight layouts"
      for layout in gptq mma16x64; do
        timeout 70 $PY benchmarks/kernel_speed.py --device cuda --prewarm 16 --deadline 50 --m 1 2 4 16 32 \
          --nk 4096x4096 14336x4096 --schemes w4g128 w4g128-asym --weight-layout $layout --no-reference \
          --out "$OUT" --tag=-layout-$layout 2>&1 | grep -v '^{'
      done ;;
    asm)  # layouts' cases with the inline-asm pair operations (--asm): M <= 2 A/Bs wq_gemm.ASM_PAIR_OPS,
          # M > 2 ASM_DOT_PAIR_OPS (sym and asym; fp16 here); the tests phase ran their gpu tests
      stamp "benchmark: inline-asm pair operations"
      for layout in gptq mma16x64; do
        timeout 70 $PY benchmarks/kernel_speed.py --device cuda --asm --prewarm 16 --deadline 50 --m 1 2 4 16 32 \
          --nk 4096x4096 14336x4096 --schemes w4g128 w4g128-asym --weight-layout $layout --no-reference \
          --out "$OUT" --tag=-asm-$layout 2>&1 | grep -v '^{'
      done ;;
    others)  # the other layouts, fewer shapes
      stamp "benchmark: other schemes"
      timeout 130 $PY benchmarks/kernel_speed.py --device cuda --prewarm 16 --deadline 95 --m 1 16 256 \
        --nk 4096x4096 14336x4096 8192x28672 \
        --schemes w4g128-asym w4g128-actorder-permute w4g128-actorder-gidx w4g32 w8a16 w8a8 \
        --out "$OUT" --tag=-others 2>&1 | grep -v '^{' ;;
    bf16)  # bf16 activations, w4g128
      stamp "benchmark: bf16"
      timeout 80 $PY benchmarks/kernel_speed.py --device cuda --dtype bf16 --prewarm 16 --deadline 55 --m 1 16 256 \
        --schemes w4g128 --no-reference --out "$OUT" --tag=-bf16 2>&1 | grep -v '^{' ;;
    swap)  # the tiled path with SWAP_AB against without, M >= 64: decides wq_gemm.SWAP_AB_LARGE_M_BACKENDS
      stamp "benchmark: large-M swap-AB"
      for swap in "" --swap-large-m; do
        timeout 45 $PY benchmarks/kernel_speed.py --device cuda $swap --prewarm 16 --deadline 30 --m 64 256 1024 \
          --nk 4096x4096 14336x4096 8192x28672 --schemes w4g128 --no-reference \
          --out "$OUT" --tag=-swap${swap:+-on} 2>&1 | grep -v '^{'
      done ;;
    peers)  # the peer backends that import there (Marlin via vLLM, gemlite, torch's tinygemm) beside ours
      stamp "benchmark: peer backends"
      timeout 100 $PY benchmarks/kernel_speed.py --device cuda --dtype bf16 --peers --prewarm 16 --deadline 75 \
        --m 1 4 16 256 --nk 4096x4096 8192x28672 --schemes w4g128 w4g128-asym \
        --out "$OUT" --tag=-peers 2>&1 | grep -v '^{' ;;
    *) echo "unknown phase $phase (tests, main, layouts, asm, others, bf16, swap, peers)" ;;
  esac
done
stamp "done"
