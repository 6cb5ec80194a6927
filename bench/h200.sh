#!/usr/bin/env bash
# One device call: the GPU tests, the command-buffer evidence and the benchmarks (results under $OUT).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1

# 1. the same tests as on the CPU, kernels compiled by Triton
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_paged.py \
  -k "pallas or poisoned or each_other" > "$OUT/tests.txt" 2>&1
timeout 160 python3 -m pytest -q -p no:cacheprovider tests/test_drafter.py \
  -k "(every_batch_size and 3) or rebuild or bf16 or catches or transformers" >> "$OUT/tests.txt" 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py \
  -k "transformers_generate or (lossless and True) or sampling_matches" >> "$OUT/tests.txt" 2>&1

# 2. each drafter bucket is one command buffer: the thunk sequence of the compiled bucket
rm -rf /tmp/dump
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*draft_bucket.*" timeout 120 \
  python3 -m jaxspec.bench propose --bs 1,16 --ctx 4096 --iters 3 --eager-iters 1 --json /tmp/p.json > /dev/null 2>&1
for f in /tmp/dump/*draft_bucket*thunk_sequence_after_thunk_passes.txt; do
  echo "== $f"; head -3 "$f"; echo "top-level thunks: $(grep -c '^[0-9]' "$f")"; done > "$OUT/cmdbuf.txt" 2>&1

# 3. benchmarks
timeout 150 python3 -m jaxspec.bench propose --bs 1,4,16,64 --ctx 4096 --eager-iters 5 --json "$OUT/propose.json" > "$OUT/bench.log" 2>&1
timeout 90 python3 -m jaxspec.bench kernels --part attention --bs 1,16,64 --json "$OUT/kernels.json" >> "$OUT/bench.log" 2>&1
timeout 150 python3 -m jaxspec.bench decode --cache paged --unstacked --json "$OUT/decode.json" >> "$OUT/bench.log" 2>&1
tail -5 "$OUT/tests.txt"; cat "$OUT/cmdbuf.txt" | head -20; grep -A12 "^  d  bs\|^ctx  bs\|^cache" "$OUT/bench.log" | head -60
