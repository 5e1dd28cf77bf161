#!/usr/bin/env bash
# The whole GPU session in one script: correctness first, then speed. Logs go to $OUT (or ./out).
#   bash benchmarks/run_gpu_checks.sh
# Needs a CUDA GPU and Triton (pip install -e '.[gpu]' from a checkout).
# gpu_check.py (kernels vs the emulator, 2**log2n values per format), the GPU pytest file with
# the interpreter off, then bench_kernels.py. Each step has its own time limit; a failure in one
# does not stop the next. ONLY=nvfp4 runs just the NVFP4 quantize / RHT part of each step
# (gpu_check --only nvfp4, the GPU tests named nvfp4 or rht, bench_kernels without the GEMMs).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/fp8sim-numba}
PY=${PYTHON:-python3}
# fp8sim installs its kernels/ and analysis/ folders under the fp8sim package: install it (no
# network needed) when this Python does not have it yet
(cd /tmp && $PY -c "import fp8sim.kernels" 2>/dev/null) || $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
{ nvidia-smi -L; $PY -c "import sys,torch,triton,numba,numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__)"; } 2>&1 | tee "$OUT/env.txt"
t0=$SECONDS
ONLY=${ONLY:-all}
if [ "$ONLY" = nvfp4 ]; then PYTEST_K=(-k "nvfp4 or rht"); BENCH_ARGS=(--sizes); else PYTEST_K=(); BENCH_ARGS=(); fi
timeout "${GPU_CHECK_S:-260}" $PY benchmarks/gpu_check.py --log2n "${LOG2N:-24}" --only "$ONLY" --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
echo "gpu_check: rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s"; t0=$SECONDS
timeout "${PYTEST_S:-150}" $PY -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py ${PYTEST_K[@]+"${PYTEST_K[@]}"} 2>&1 | tee "$OUT/pytest_gpu.log"
echo "pytest: rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s"; t0=$SECONDS
timeout "${BENCH_S:-100}" $PY benchmarks/bench_kernels.py ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} 2>&1 | tee "$OUT/bench_kernels.txt"
echo "bench_kernels: rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s"
# issue 29: training on the GPU -- the tiny GPT with --device cuda on the triton and the emulator
# backend (te-delayed, mx, nvfp4): step-1 FP8 codes identical, losses within 1e-3, tokens/s of
# each; then the CLI itself with --device cuda
if [ "$ONLY" = all ]; then
  t0=$SECONDS
  timeout "${TRAIN_S:-240}" $PY benchmarks/gpu_train_check.py --steps "${TRAIN_STEPS:-40}" --json "$OUT/gpu_train_check.json" 2>&1 | tee "$OUT/gpu_train_check.log"
  echo "gpu_train_check: rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s"; t0=$SECONDS
  timeout "${CLI_S:-120}" $PY -m fp8sim train --device cuda --recipe te-current --backend triton --steps 20 --eval-every 0 --out "$OUT/cli-cuda-run" --json 2>&1 | tail -3 | tee "$OUT/cli_cuda.log"
  echo "train --device cuda: rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s"
fi
