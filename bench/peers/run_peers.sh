#!/usr/bin/env bash
# Peer benchmarks on the GPU machine (issue #6), JSON and logs under $OUT:
#     bash bench/peers/run_peers.sh [all|hf|keras]          (device call with carry: [".whl"])
# Wheels in .whl/ (git-ignored; fetched with the device README's pip download command): transformers 5.24.0 for the
# hf peer, keras 3.15.1 + keras-hub 0.32.0 + optree, namex, kagglehub, kagglesdk for the keras peer; everything else
# they import is on the machine. Two install targets keep each peer's packages apart: /tmp/site-hf shadows the
# preinstalled transformers 5.17 for the hf peer only; /tmp/site-keras holds no jax/jaxlib (the machine's CUDA jax
# stays in use). Both peers rewrite their JSON after every figure, so a run cut by `timeout` keeps what it finished.
# Environment overrides: PEER_PRESET (E4B), PEER_CTX (1024,4096), PEER_NEW_TOKENS (64), PEER_K (3),
# HF_TIMEOUT (110 s), KERAS_TIMEOUT (210 s); all: ~330 s with the installs. PEER_HF_ARGS / PEER_KERAS_ARGS are
# appended to each peer's arguments (a CPU smoke test: PEER_HF_ARGS="--device cpu --tiny" PEER_CTX=32,64 ...).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PRESET=${PEER_PRESET:-E4B}; CTX=${PEER_CTX:-1024,4096}; NEW=${PEER_NEW_TOKENS:-64}; K=${PEER_K:-3}
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
part=${1:-all}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/peer-gpu.txt" 2>&1

if [ "$part" = all ] || [ "$part" = hf ]; then
  $PIP --target /tmp/site-hf .whl/transformers-*.whl || exit 1
  PYTHONPATH=/tmp/site-hf:. timeout -k 10 "${HF_TIMEOUT:-110}" python3 bench/peers/hf_peer.py --device cuda \
    --preset "$PRESET" --ctx "$CTX" --new-tokens "$NEW" -k "$K" --json "$OUT/peer-hf.json" ${PEER_HF_ARGS:-} \
    > "$OUT/peer-hf.log" 2>&1
  echo "hf peer: exit $?"; grep -v Warning "$OUT/peer-hf.log" | tail -8
fi

if [ "$part" = all ] || [ "$part" = keras ]; then
  $PIP --target /tmp/site-keras .whl/keras-*.whl .whl/keras_hub-*.whl .whl/optree-*.whl .whl/namex-*.whl \
    .whl/kagglehub-*.whl .whl/kagglesdk-*.whl || exit 1
  KERAS_BACKEND=jax PYTHONPATH=/tmp/site-keras:. timeout -k 10 "${KERAS_TIMEOUT:-210}" python3 \
    bench/peers/keras_peer.py --preset "$PRESET" --ctx "$CTX" --new-tokens "$NEW" -k "$K" \
    --json "$OUT/peer-keras.json" ${PEER_KERAS_ARGS:-} > "$OUT/peer-keras.log" 2>&1
  echo "keras peer: exit $?"; grep -v Warning "$OUT/peer-keras.log" | tail -12
fi
