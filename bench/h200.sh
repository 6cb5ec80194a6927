#!/usr/bin/env bash
# Device-machine runs (results under $OUT): `bash bench/h200.sh tests`, `... cmdbuf`, `... bench`.
# Each part fits one device call (10 minutes); run them as separate calls.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1

case "${1:-bench}" in
tests)  # the same tests as on the CPU, kernels compiled by Triton (test_generate needs transformers 5.24: skipped)
  timeout 560 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_paged.py \
    tests/test_drafter.py tests/test_engine.py tests/test_pool.py tests/test_model.py > "$OUT/tests.txt" 2>&1
  tail -15 "$OUT/tests.txt" ;;
cmdbuf)  # each drafter bucket is one command buffer: the thunk sequence of the compiled bucket
  rm -rf /tmp/dump
  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*draft_bucket.*" timeout 200 \
    python3 -m jaxspec.bench propose --bs 1,16 --ctx 4096 --iters 3 --eager-iters 1 --json /tmp/p.json > /dev/null 2>&1
  for f in /tmp/dump/*draft_bucket*thunk_sequence_after_thunk_passes.txt; do
    echo "== $f"; head -3 "$f"; echo "top-level thunks: $(grep -c '^[0-9]' "$f")"; done > "$OUT/cmdbuf.txt" 2>&1
  cat "$OUT/cmdbuf.txt" ;;
bench)
  timeout 200 python3 -m jaxspec.bench propose --bs 1,4,16,64 --ctx 4096,32768 --eager-iters 5 \
    --json "$OUT/propose.json" > "$OUT/bench.log" 2>&1
  timeout 120 python3 -m jaxspec.bench verify --bs 1,16 --json "$OUT/verify.json" >> "$OUT/bench.log" 2>&1
  timeout 240 python3 -m jaxspec.bench e2e --bs 1,4,16 --json "$OUT/e2e.json" >> "$OUT/bench.log" 2>&1
  grep -A14 "^ctx  bs\|^cache\|^bs  mode" "$OUT/bench.log" | head -60 ;;
esac
