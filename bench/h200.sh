#!/usr/bin/env bash
# Device-machine runs (results under $OUT): `bash bench/h200.sh tests`, `... cmdbuf`, `... bench`, `... e2e0`, `... e2e1`;
# session 4: `BS=1 bash bench/h200.sh s4-e4b`, `... s4-tests`, `... s4-270m` (after carrying .gg/part0..6 and .whl).
# Each part fits one device call (10 minutes). On a two-GPU machine two parts run side by side:
#   (CUDA_VISIBLE_DEVICES=0 bash bench/h200.sh e2e0 &); CUDA_VISIBLE_DEVICES=1 bash bench/h200.sh e2e1; wait
# (e2e1 runs bench/peers/run_peers.sh: carry .whl). Compiles are shared within a part through the persistent cache.
# session 6 (issues #13, #16, #17), one warm machine, calls chained without pause: `bash bench/h200.sh s6-stage` once per
# carried GGUF part (.gg0 .. .gg7, with .whl and .tok in the first), then `... s6-distill` (with .gg7 and .dist), then
# `... s6-bench`; `... s6-tests` where device time is left.
# session 7 (issues #14, #13, #16), one warm machine, calls chained without pause: s7-tests, s7-propose; then the GGUF
# in four xz parts (.gg0 with .whl, .gg1, .gg2 staged by `bash bench/h200.sh s6-stage`; .gg3 with jaxspec/assets,
# the working tree cut to jaxspec/ and bench/ so that each part fits) and `s6-stage; s7-convert; s7-serve; s7-e2e270`.
# session 8 (issues #14, #17, #13), one warm machine, calls chained without pause: s8-propose with .gg0 and .whl
# (s6-stage first), .gg1 and .gg2 staged, .gg3 with jaxspec/assets staged + s7-convert, then s8-data with .dist
# (mixed.jsonl.xz from `python -m jaxspec.corpus --max-per-source 12000 --stride 64`), s8-train, s8-e2e.
# session 9 (issues #16, #17): the GGUF in four xz parts (.gg0 with .whl, .gg1, .gg2, .gg3, each staged by s6-stage,
# the working tree cut to jaxspec/ without its assets and bench/), then with the whole tree: s7-convert, s9-serve;
# s9-e2e. Have the next command ready before a call ends: a machine idle for 30 s is given back, and what was staged
# on it with it (session 9 staged the GGUF twice so).
# session 10 (issues #14, #17): s10-launch (bench/diag_launch.py under XLA flag sets), then with .gg0 and .before (the
# earlier tree's jaxspec/, for side-by-side runs) s10-propose, .gg1-.gg3 staged (.gg3 with .whl and tests/: part of
# the GPU lane), then the whole tree: s7-convert, s10-ab270, s10-trace270.
# session 11 (issues #14, #17): s11-alloc and `UNROLL_MODEL=E4B UNROLL_TIMEOUT=280 ... s11-unroll` (E4B random, no GGUF),
# then the GGUF staged (.gg0 with .whl, .gg1-.gg3; tree cut), the whole tree with .whl: `s7-convert && RS_WHILE=1,16
# RS_UNROLL=4,16 UNROLL_TIMEOUT=250 ... s11-unroll`; bench/diag_splits.py (no GGUF). Next: the unrolled 270M round
# traced (RS=4 DUMP=1 TOP=80 ... s10-trace270), s12-gather, s11-alloc again (the buffer assignment now comes back), s12-same (E4B bf16 spec = plain over 64 prompts), the GPU lane's untested rest
# (TESTS=... s6-tests: test_paged's last two, test_drafter, test_engine).
# session 12 (issues #14, #17): the GGUF staged (tree cut), then the whole tree with .whl: `s7-convert && s12-gather`,
# `RS=4 DUMP=1 TOP=80 ... s10-trace270`, `TESTS="tests/test_drafter.py tests/test_engine.py" ... s6-tests`; the GGUF
# staged again on a fresh machine, `s7-convert && s12-sweep`, `s12-same`. Next: s13-qkv (after s7-convert), the rest
# of test_engine.py in the GPU lane (TESTS="tests/test_engine.py -k 'not greedy_equals'"), s11-alloc.
# session 13 (issues #14, #17): the GGUF staged (tree cut), then the whole tree with .whl: `s7-convert && s14-ab`; then
# `s14-tests` (the GPU lane of the session's kernel change and both switches) and `s14-e4b` (no GGUF). Next: the rest of
# s14-e4b (the bs-16 verify, decode, propose as shipped), `RS=4 DUMP=1 TOP=80 ... s10-trace270` with the new defaults
# (launches per round; name the q norm + RoPE concatenate fusion), the rest of test_engine.py in the GPU lane.
# session 14 (issue #14): s15-inv (the batch-invariant mode's GPU lane and E4B's spec = plain at P 5, no GGUF); the GGUF
# staged (tree cut), then the whole tree with .whl: `s7-convert && s15-ab`, s12-same (the control), propose and verify
# as shipped. Next: s15-cost (E4B with and without --batch-invariant side by side in one call: the mode's cost),
# `RS=4 DUMP=1 TOP=80 ... s10-trace270` with the session-13 defaults, the rest of test_engine.py in the GPU lane.
# session 15 (issue #14): s16-merged (the in-kernel split merge's GPU lane, then E4B verify / decode / propose with
# JAXSPEC_ATTN_MERGED 0 and 1 side by side, no GGUF); the GGUF staged (tree cut), then the whole tree with .whl:
# `s7-convert && s16-ab` (the default pair, the switch 0 against 1); s16-splits (piece counts x where the merge runs).
# session 17 (issue #14): s18 PARTS=lane, then gemv, then joint (session 16's kernels: GPU lane and E4B A/B), then
# s18-sweep && PARTS=gemv s18 (the small products' cuts against XLA's at E4B's shapes, then the engine with the dot cut).
# session 18 (issues #14, #17): s19-flags (XLA flag sets side by side: PDL, the command-buffer scheduling modes), the GPU
# lane's rest of test_engine.py (`TESTS=tests/test_engine.py K="not greedy_equals" ... s6-tests`) and test_gemv.py.
# session 19 (issues #14, #17): s19-split (tree cut, with .gg0 + .whl), .gg1-.gg3 staged (PARTS=4, tree cut; .dist with
# .gg3), `s7-convert; s19-data`, `TAG=l2 DISTILL_ARGS="--assistant-layers 2" TRAIN_LIMIT=470 ... s19-train`,
# `TAGS=l2 KS=3,4,5 ... s19-e2e`; the drafter packed as the default, then on a fresh machine the GGUF staged again and
# e2e k 1-6 with it. Names under $OUT must not hold commas (the device tool does not bring such files back).
# session 20 (issue #14): `IO_STEPS=bench IO_TIMEOUT=170 ... s20-io`, `IO_STEPS=vlog ... s20-io`, `IO_BENCHES=verify
# IO_VERIFY_BS=16 IO_TIMEOUT=280 IO_VLOGS=<the two propose lines> ... s20-io` on one warm machine; `S20_REPEATS=1
# E2E_TIMEOUT=130 ... s20-concurrent` (cut: E4B's cold compile outran 130 s); s20-fused, s20-fused-trace; the propose
# variants in two opposite orders (inline); the E2B engine's re-recorded nodes (inline). Next (issue #14): s21-pin
# (JAXSPEC_PIN_OUTPUT measured), s20-concurrent with E2E_TIMEOUT=300 on a machine whose compiles are warm (the 270M
# rows need the GGUF staged and s7-convert first, E4B's do not).
# session 21 (issue #14): s21-propose-hlo then `PIN_STEPS=vlog PIN_TIMEOUT=200 ... s21-pin`; `PIN_STEPS=e4b
# E2E_TIMEOUT=285 ... s21-pin`; s21-pin-ab, then on the same warm machine `PIN_VALUES="1 0"` (files renamed *-rev).
# Next (issue #14): after session 22 (the fused drafter kernels by default at bs 1-2; a phase inside a cluster kernel
# measured at 0.8-1.9 µs, no cheaper than a kernel boundary), s23-fused-rows, fewer phases and bytes a propose;
# s20-concurrent with E2E_TIMEOUT=300 after warm compiles.
# session 22 (issue #14): s22-fused (FUSED_E2E=1 on a warm machine), s22-cluster, s22-default, s22-cluster-device.
# session 24 (issue #14, no device time; `bench graph` counts launches without one): next, goal-rows, s24-qkv,
# s24-qkv-decode, s24-graph, s24-graph-trace, s24-norms, s24-tiling, then s23-fused-rows.
# session 25 (issue #14, no device time): next, s25-diag-lp (pick layer_products.Config), s25-layer-products (GPU lane,
# then verify/decode bs 1 with JAXSPEC_LAYER_PRODUCTS 0/1/0; LP_WITH="JAXSPEC_QKV_KERNEL=1 JAXSPEC_FUSED_NORMS=1" for
# all three), then session 24's list; `JAXSPEC_LAYER_PRODUCTS=1 ... s24-graph` counts with it on the device.
# session 26 (issue #14): s26-lp (the layer products kernel timed: 2.7-2.8x slower, off), s25-diag-lp twice, s26-goals.
# Next: s27-first (the kernel's GPU lane alone, the bs-64 propose traced), then session 24's list.
# session 27 (issue #14, no device time; the per-call inputs staged, JAXSPEC_STAGE_INPUTS): next, s27-stage first (its GPU
# lane, XLA's count of updated nodes a propose call, the goal rows' programs staged against not), then s27-first.
# session 28 (issue #14): s28-stage-goals (STAGE_ORDER "0 1 0", then "1"), s27-stage's verify step, then the verify /
# decode goal rows with the switch 1, 0, 1: staged inputs on by default. Next: STAGE_STEPS="lane vlog" s27-stage (the
# staging tests on the GPU, XLA's updated-node count), s27-first, then session 24's list.
# session 29 (issue #14): DISPATCH_LANE=1 s29-dispatch (the host inputs' cost taken apart; the staging lane owed since 28),
# then LAYER_STEPS="warm lane" s29-layer and LAYER_STEPS="decode verify" s29-layer chained (session 24's kernels timed:
# the norms kernel shipped on). Next: s30-tfrt (PJRT's TFRT GPU client), s30-qkv-lane, then s30-e2e (the engine end to
# end with the session-28/29 defaults; E2E_NORMS=1, then 0, one call each), s27-first, session 24's rest (s24-graph, s24-tiling, s23-fused-rows).
# session 30 (issue #14): no device time (the session's budget was spent when it began). Queued first: s30-nodes (the
# graph's nodes a call from traces of the shipped programs: the goal propose_e4b_bs1_4k_graph_kernels; the head's one
# reduction fewer a step is in them, untimed otherwise), then as above.
# session 31 (issue #14, H100 only): s30-nodes, s30-tfrt (TFRT_STEPS="diag goals"), s30-e2e (E2E_NORMS=1, then "0 1"),
# s30-qkv-lane, s29-layer (LAYER_STEPS="decode verify", QKV 01/11 x3, verify 0 1 0 1): the q/k/v kernel shipped on in
# one-position steps. Next: s31-qkv-default (its lane as shipped, decode bs 1 and 16), s30-nodes on an H200, goal rows.
# session 32 (issue #14): s32 (the q/k/v default's and the o/down partials' GPU lane, decode and verify A/B in one call),
# then s30-nodes and the goal rows on an H200.
# session 34 (issue #14, H100 only): s34-lane (PART 1, 2: the whole GPU lane), the o/down partials' decode traced,
# bench/diag_one_row_products.py. Next: s34-one-row (carry .before), then s30-nodes and goal-rows on an H200.
# session 35 (issue #14, H100): s34-one-row, then ONE_ROW_STEPS=e2e s34-one-row (the one-row products timed: kept);
# s35-pinned (diag + 0 1 0 1), DIAG=0 PINNED_SEQ="0 1 0 1 0 1" s35-pinned, s35-pinned-ab, s35-pinned-default (pinned
# inputs: on). Next: s35-pinned-default and goal-rows and s30-nodes on an H200.
# session 37 (issue #14): goal-rows on an H200 when one comes; s37-named (decode and verify bs 1 traced with XLA's HLO
# beside them: every kernel's µs by jax op, where the launch count of a step goes on the device).
# session 38 (issue #14, H100): s38-gelu (the one-row PLE gate's exp-form gelu against the tanh form, GPU tests of
# test_model and test_draft_layer first), s38-tiling (XLA's exhaustive GEMM tiling search: the same kernels), both
# traced inline (BENCHMARKS.md session 38 has the commands). Next: goal-rows, s35-pinned-ab, s30-nodes on an H200.
# session 39 (issue #14): the GPU lane's test_paged + test_rounds (greedy, paged) with session 38's change, inline;
# s39-rows (the split attention storing and merging only the real query rows' partials, against the tree before),
# s39-attn (E4B's attention shapes in chains: the real-rows partials and other kernel knobs in one process).
# session 44 (issue #14): s44-one, s44-verify16 (the bs-16 verify traced against .before/<dir> kernel files), then
# s44-apart (session 45: verify-16; session 46: verify-1, decode-1, then JAXSPEC_STEP_KEYS_APART on by default).
# session 46: the GPU lane with the switch on, `PART=2 bash bench/h200.sh s34-lane` (test_rounds, test_engine: 49 of 50
# in 540 s, the last alone after). Next: `JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache-shared bash bench/h200.sh goal-rows`
# on an H200, then `python -m jaxspec.bench goals`.
# session 47: the lane's old part 1 (test_kernels, test_model all passed; test_paged 11 of 13, test_drafter 6 of 27
# before the time ran out, no failure): compile-bound (ptxas), now split, parts 1, 3, 4. Next: PART=3, PART=4, then
# goal-rows on an H200 as above.
# Session 37 removed six switches that measured slower (JAXSPEC_ATTN_MERGED, JAXSPEC_ATTN_PREFETCH, JAXSPEC_GEMV,
# JAXSPEC_SPLIT_PRODUCTS, JAXSPEC_LAYER_PRODUCTS, JAXSPEC_PIN_OUTPUT) with their code and diagnoses: the recipes above
# that use them need commit a536233's tree.
# Compile caches between calls and sessions: `CACHE_OUT=1 bash bench/h200.sh PART` returns the part's compile cache as
# $OUT/jaxcache-part-* (15 MiB each; the device returns 8 files, 64 MiB in all); copy them into .jaxcache/ (ignored)
# and name ".jaxcache" in the next call's carry: every part unpacks it first (untried on the device as of session 26).
# session 23: no device time. Next (issue #14): goal-rows first (every goal row of #14 in one call, the figures of
# session 22 came from a slow machine), then s23-fused-rows (session 24 adds s24-qkv, s24-qkv-decode, s24-graph, s24-graph-trace, s24-norms, s24-tiling).
# The lane-* parts are sized to run one per GPU of a four-GPU machine in one call:
#   for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i bash bench/h200.sh lane-X & done; wait
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache-${1:-bench}} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu-${1:-bench}.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$OUT/gpu-${1:-bench}.txt" 2>&1
# A compile cache brought back by an earlier call (CACHE_OUT=1: $OUT/jaxcache-part-*, copied into .jaxcache/ and
# carried: `carry: [".jaxcache"]`) is unpacked into this part's cache directory, so programs compiled then (the same
# code, jax and GPU) load instead of compiling again (E4B's verify step: >130 s cold)
if compgen -G ".jaxcache/jaxcache-part-*" > /dev/null; then
  mkdir -p "$JAX_COMPILATION_CACHE_DIR" && cat .jaxcache/jaxcache-part-* | tar xzf - -C "$JAX_COMPILATION_CACHE_DIR" \
    && echo "carried compile cache: $(ls "$JAX_COMPILATION_CACHE_DIR" | wc -l) files" >> "$OUT/gpu-${1:-bench}.txt"
fi

switch_ab_270m() {  # $1 an environment switch, $2 a file tag, $3 a timeout: the default pair at bs 1, 16 held-out
  # prompts, plain and k 4 at R $RS (default 4), once with the switch 0 and once with 1 (s7-convert first)
  local A v; A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  for v in 0 1; do env "$1=$v" timeout "$3" python3 -m jaxspec.bench e2e --model /root/gemma-3-270m \
      --assistant "$A" --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 \
      --modes off,bucketed -k 4 --rounds-per-call ${RS:-4} --overlap on --json "$OUT/e2e-270m-$2$v.json" \
      > "$OUT/e2e-270m-$2$v.log" 2>&1
    echo "== $1=$v"; grep "^e2e bs\|Error" "$OUT/e2e-270m-$2$v.log" | head -4; done
}

traced_propose() {  # $1 a file tag, $2 batch sizes, $3 variants (the first traced), $4 a timeout, $5 kernels listed:
  # one propose run (E4B drafter, k 3, 4K) with its trace summarised (kernels and launches a propose)
  rm -rf /tmp/ptr
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout "$4" python3 -m jaxspec.bench propose --bs "$2" \
    --ctx 4096 --variants "$3" --profile-dir /tmp/ptr --json "$OUT/propose-$1.json" > "$OUT/propose-$1.log" 2>&1
  timeout 60 python3 -m jaxspec.bench trace /tmp/ptr --rounds 20 --top "$5" --json "$OUT/trace-propose-$1.json" \
    >> "$OUT/propose-$1.log" 2>&1
  echo "== $3"; grep "^propose ctx\|launches\|Error\|error:" "$OUT/propose-$1.log" | head -5
}

named_propose() {  # $1 a file tag, $2 a batch size, $3 the variant, $4 a timeout: one propose run (E4B drafter, k 3,
  # 4K) traced with XLA's optimized HLO beside it (xz-packed), so that `bench trace --hlo` names every kernel of it
  # (shape and jax op): $OUT/$1-experiment.json, $OUT/$1.txt.xz, $OUT/trace-$1-experiment.json, $OUT/$1.log
  rm -rf /tmp/hlo /tmp/ph
  XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true --xla_dump_to=/tmp/hlo" timeout "$4" \
    python3 -m jaxspec.bench propose --bs "$2" --ctx 4096 --variants "$3" --profile-dir /tmp/ph \
    --json "$OUT/$1-experiment.json" > "$OUT/$1.log" 2>&1
  local f; f=$(ls -S /tmp/hlo/*after_optimizations.txt 2>/dev/null | head -1)
  [ -n "$f" ] && xz -c "$f" > "$OUT/$1.txt.xz"
  timeout 120 python3 -m jaxspec.bench trace /tmp/ph --rounds 20 --top 400 $([ -n "$f" ] && echo "--hlo $f") \
    --json "$OUT/trace-$1-experiment.json" >> "$OUT/$1.log" 2>&1
  grep "^propose ctx\|launches\|Error\|error" "$OUT/$1.log" | head -6
}

goal_rows() {  # every goal row of issue #14 (E4B, 4K, the defaults): the propose at bs 1 and 64 (bucketed: the default
  # program, fresh host inputs each call), verify at bs 1 and 16, decode at bs 1 (paged), each in its own process (a
  # cut loses one row, not all); then `python -m jaxspec.bench goals` here
  timeout ${PROPOSE_TIMEOUT:-200} python3 -m jaxspec.bench propose --bs 1,64 --ctx 4096 --variants bucketed \
    --json "$OUT/propose-goals.json" > "$OUT/goals.log" 2>&1
  timeout ${VERIFY_TIMEOUT:-200} python3 -m jaxspec.bench verify --bs 1,16 --json "$OUT/verify-goals.json" \
    >> "$OUT/goals.log" 2>&1
  timeout ${DECODE_TIMEOUT:-120} python3 -m jaxspec.bench decode --bs 1 --cache paged --json "$OUT/decode-goals.json" \
    >> "$OUT/goals.log" 2>&1
  grep -E "^(propose|verify|decode)|Error|error:" "$OUT/goals.log" | head -20
}

need_xdist() {  # pytest-xdist for `-n`: installed, or from the wheels carried in .whl/ (pip, else unpacked on the path)
  python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 \
    || { mkdir -p /tmp/xd && for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/xd; done; export PYTHONPATH=.:/tmp/xd; }
}

ab_save() {  # the working tree's versions of these repo files, kept for ab_use (an A/B against .before/ copies)
  rm -rf /tmp/ab-new && mkdir -p /tmp/ab-new && cp "$@" /tmp/ab-new/
}

ab_use() {  # $1 new or old, the rest repo files: each from ab_save's copy (new) or from $AB_OLD/<its name> (old;
  # AB_OLD default .before)
  local v=$1 f; shift
  for f in "$@"; do cp "$([[ $v == old ]] && echo "${AB_OLD:-.before}" || echo /tmp/ab-new)/$(basename "$f")" "$f"; done
}

traced_step() {  # $1 a tag (the files $OUT/$1.json and $OUT/trace-$1.json, the log /tmp/$1.log), $2 the run's
  # environment ("NAME=value ..."), $3 its time limit, the rest a bench subcommand and its flags: one run traced in
  # its own process (command buffers kept while profiling), then `bench trace` of its 20 traced calls
  local tag=$1 envs=$2 limit=$3; shift 3
  rm -rf "/tmp/$tag-prof"
  env $envs XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout "$limit" python3 -m jaxspec.bench \
    "$@" --profile-dir "/tmp/$tag-prof" --json "$OUT/$tag.json" > "/tmp/$tag.log" 2>&1
  timeout 90 python3 -m jaxspec.bench trace "/tmp/$tag-prof" --rounds 20 --top 40 --json "$OUT/trace-$tag.json" \
    >> "/tmp/$tag.log" 2>&1
}

warm() {  # $1 a log tag, the rest a bench subcommand and its flags: one --iters 1 run that fills the persistent compile
  # cache, memory not preallocated and held to WARM_MEM of the GPU (default 14%: several run side by side; session 26
  # saw six unbounded ones run the GPU out of memory); its own figures are not results (JSON under /tmp)
  local tag=$1; shift
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=${WARM_MEM:-.14} timeout ${WARM_TIMEOUT:-260} \
    python3 -m jaxspec.bench "$@" --iters 1 --json "/tmp/warm-$tag.json" > "$OUT/warm-$tag.log" 2>&1
}

lp_lane() {  # the layer products kernel's GPU lane: the kernel against its reference (Triton), the engine with it
  # against transformers' greedy; failures named
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_layer_products.py \
    tests/test_rounds.py -k "stream_product or rows_do or fp32_products or layer_products" \
    > "$OUT/tests-layer-products.txt" 2>&1
  grep -E "passed|failed|^FAILED" "$OUT/tests-layer-products.txt" | tail -8
}

ab_verify() {  # $1 an environment switch, $2 a file tag, $3 a timeout: E4B's verify (bs 1, 4K) with the switch 0 and 1,
  # each traced (every kernel listed); the switch-0 run also dumps XLA's optimized HLO (xz back) to name the kernels
  local v f dump
  for v in 0 1; do
    rm -rf /tmp/hlo; dump=$([ $v = 0 ] && echo "--xla_dump_to=/tmp/hlo --xla_dump_hlo_module_re=.*paged_decode_step.*")
    env "$1=$v" XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true $dump" \
      timeout "$3" python3 -m jaxspec.bench verify --bs 1 --profile-dir /tmp/v$v \
      --json "$OUT/verify-$2$v.json" > "$OUT/verify-$2$v.log" 2>&1
    f=$(ls -S /tmp/hlo/*paged_decode_step*after_optimizations.txt 2>/dev/null | head -1)
    [ -n "$f" ] && xz -c "$f" > "$OUT/verify-hlo-$2$v.txt.xz"
    timeout 60 python3 -m jaxspec.bench trace /tmp/v$v --rounds 20 --top 900 $([ -n "$f" ] && echo "--hlo $f") \
      --json "$OUT/trace-verify-$2$v.json" >> "$OUT/verify-$2$v.log" 2>&1
    echo "== $1=$v"; grep "^step of\|launches\|Error" "$OUT/verify-$2$v.log" | head -4; done
}

ab_e4b() {  # $1 an environment switch, $2 a file tag: E4B's verify (ab_verify), decode (bs 1, paged) and propose (bs 1,
  # 4K) with the switch 0 and 1 side by side
  local v
  ab_verify "$1" "$2" ${VERIFY_TIMEOUT:-150}
  for v in 0 1; do
    env "$1=$v" timeout ${DECODE_TIMEOUT:-90} python3 -m jaxspec.bench decode --bs 1 --cache paged \
      --json "$OUT/decode-$2$v.json" > "$OUT/decode-$2$v.log" 2>&1
    env "$1=$v" timeout ${PROPOSE_TIMEOUT:-90} python3 -m jaxspec.bench propose --bs 1 --ctx 4096 \
      --variants bucketed --json "$OUT/propose-$2$v.json" > "$OUT/propose-$2$v.log" 2>&1
    echo "== $1=$v"; grep -h "^step of\|Error" "$OUT/decode-$2$v.log"
    grep -h "^propose ctx\|Error" "$OUT/propose-$2$v.log" | head -3; done
}

case "${1:-bench}" in
tests)  # the same tests as on the CPU, kernels compiled by Triton (test_generate needs transformers 5.24: skipped),
  # pytest-xdist workers sharing the GPU (one process ran 37% of them in 560 s: session 46's call 2)
  need_xdist
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 560 python3 -m pytest -q -p no:cacheprovider -n ${WORKERS:-8} \
    --dist loadgroup tests/test_kernels.py tests/test_paged.py tests/test_drafter.py tests/test_engine.py \
    tests/test_pool.py tests/test_model.py > "$OUT/tests.txt" 2>&1
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
e2e0)  # engine end to end at a 1K prompt (issue #5), one profiled bucketed round set, verify vs the HBM bound
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout 330 python3 -m jaxspec.bench e2e \
    --bs 1,4,16 --prompt-len 1024 --profile-dir /tmp/prof --json "$OUT/e2e-1k.json" > "$OUT/e2e0.log" 2>&1
  timeout 60 python3 -m jaxspec.bench trace /tmp/prof --json "$OUT/trace.json" >> "$OUT/e2e0.log" 2>&1
  timeout 120 python3 -m jaxspec.bench verify --bs 1,16 --json "$OUT/verify.json" >> "$OUT/e2e0.log" 2>&1
  grep -A20 "^bs  \|^XLA modules\|^top\|^cache" "$OUT/e2e0.log" | head -70 ;;
e2e1)  # the transformers and keras-hub peers (bench/peers), then jaxspec at a 4K prompt, bs 1
  bash bench/peers/run_peers.sh all
  timeout 200 python3 -m jaxspec.bench e2e --bs 1 --modes off,bucketed --prompt-len 4096 \
    --json "$OUT/e2e-4k.json" > "$OUT/e2e1.log" 2>&1
  grep -A6 "^bs  " "$OUT/e2e1.log" ;;
e2e-bs)  # one e2e batch size per GPU (E2E_BS), all three modes, rows saved as they land; then $E2E_THEN
  timeout ${E2E_TIMEOUT:-470} python3 -m jaxspec.bench e2e --bs "$E2E_BS" --prompt-len 1024 \
    --json "$OUT/e2e-1k-bs$E2E_BS.json" > "$OUT/e2e-bs$E2E_BS.log" 2>&1
  grep "^e2e bs" "$OUT/e2e-bs$E2E_BS.log" ;;
distill)  # issue #7: convert the GGUF (at $GGUF), distill the drafter, pack it under $OUT, e2e with/without it
  # needs .dist/ (gguf wheel, prompts.jsonl and heldout.jsonl from `python -m jaxspec.corpus`) and /tmp/site-hf
  python3 -m pip install -q --no-index --no-deps --target /tmp/site-gguf .dist/gguf-*.whl
  PYTHONPATH=/tmp/site-gguf:/tmp/site-hf:. python3 -c "from jaxspec.model.gguf import convert_gguf as c; \
    c('$GGUF', '/root/g270')" > "$OUT/distill.log" 2>&1
  timeout ${DISTILL_TIMEOUT:-330} python3 -m jaxspec.distill --model /root/g270 --out /root/asst \
    --packed-out "$OUT/packed" --prompts .dist/prompts.jsonl --ckpt-dir /root/ckpt ${DISTILL_ARGS:-} \
    >> "$OUT/distill.log" 2>&1
  cp /root/asst/distill.json "$OUT/" 2>/dev/null
  timeout 200 python3 -m jaxspec.bench e2e --model /root/g270 --assistant /root/asst --prompts .dist/heldout.jsonl \
    --bs 1,8 --modes off,bucketed --new-tokens 128 --json "$OUT/e2e-270m.json" > "$OUT/e2e-270m.log" 2>&1
  tail -5 "$OUT/distill.log"; grep -A5 "^bs  \|^ *bs  " "$OUT/e2e-270m.log" ;;
diag0)  # the verify step: its thunk sequence (one command buffer or not), a profile, and XLA flag variants
  rm -rf /tmp/dump
  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*paged_decode_step.* \
--xla_enable_command_buffers_during_profiling=true" timeout 200 python3 -m jaxspec.bench verify --bs 1 --iters 30 \
    --profile-dir /tmp/pv --json "$OUT/diag-verify.json" > "$OUT/diag0.log" 2>&1
  for f in /tmp/dump/*paged_decode_step*thunk_sequence_after_thunk_passes.txt; do echo "== $f"; head -3 "$f"
    echo "top-level thunks:"; grep '^[0-9]' "$f" | awk '{print $2}' | sort | uniq -c; done >> "$OUT/diag0.log" 2>&1
  timeout 60 python3 -m jaxspec.bench trace /tmp/pv --rounds 20 --top 30 --json "$OUT/diag-verify-trace.json" \
    >> "$OUT/diag0.log" 2>&1
  for flags in --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_command_buffer= ${DIAG_FLAGS:-}; do
    echo "== XLA_FLAGS=$flags" >> "$OUT/diag0.log"
    XLA_FLAGS=$flags timeout 150 python3 -m jaxspec.bench verify --bs 1 --iters 30 --json /tmp/v.json 2>&1 \
      | grep "^step of" >> "$OUT/diag0.log"; done
  grep -A34 "^top\|^top-level\|^step of\|^== XLA" "$OUT/diag0.log" | head -120 ;;
diag1)  # the draft bucket's kernels at bs 1 / 4K, and the bf16 drafter tests with and without excess precision
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout 200 python3 -m jaxspec.bench propose --bs 1 \
    --ctx 4096 --iters 50 --eager-iters 1 --profile-dir /tmp/pp --json "$OUT/diag-propose.json" > "$OUT/diag1.log" 2>&1
  timeout 60 python3 -m jaxspec.bench trace /tmp/pp --rounds 20 --top 40 --json "$OUT/diag-propose-trace.json" \
    >> "$OUT/diag1.log" 2>&1
  for flags in "" --xla_allow_excess_precision=false; do echo "== XLA_FLAGS=$flags" >> "$OUT/diag1.log"
    XLA_FLAGS=$flags timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_drafter.py -k bf16 2>&1 \
      | grep -E "^bf16|Error|passed|failed" >> "$OUT/diag1.log"; done
  grep -A44 "^top\|^propose ctx\|^== XLA\|^bf16\|passed\|failed" "$OUT/diag1.log" | head -120 ;;
lane-tests)  # GPU tests of the kernels and the drafter (Triton kernels compiled for the H200)
  timeout ${LANE_TIMEOUT:-500} python3 -m pytest -q -p no:cacheprovider -s tests/test_kernels.py tests/test_drafter.py \
    > "$OUT/tests-drafter.txt" 2>&1
  grep -E "^bf16|passed|failed" "$OUT/tests-drafter.txt" ;;
lane-propose)  # issue #4's table: propose at bs 1..64, 4K then 32K (rows saved per context)
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout ${LANE_TIMEOUT:-500} python3 -m jaxspec.bench \
    propose --bs 1,4,16,64 --ctx 4096,32768 --eager-iters 3 --profile-dir /tmp/pp --json "$OUT/propose.json" \
    > "$OUT/propose.log" 2>&1
  timeout 50 python3 -m jaxspec.bench trace /tmp/pp --rounds 20 --top 25 --json "$OUT/propose-trace.json" \
    > "$OUT/propose-trace.log" 2>&1
  grep "^propose ctx\|all kernels" "$OUT/propose.log" "$OUT/propose-trace.log" ;;
lane-e2e1k)  # bs 1 at 1K, all three modes, then the verify step at bs 1 and 16
  timeout 330 python3 -m jaxspec.bench e2e --bs 1 --prompt-len 1024 --json "$OUT/e2e-1k-bs1.json" \
    > "$OUT/e2e-1k-bs1.log" 2>&1
  timeout ${LANE_TIMEOUT:-230} python3 -m jaxspec.bench verify --bs 1,16 --json "$OUT/verify.json" \
    > "$OUT/verify.log" 2>&1
  grep "^e2e bs\|^step of" "$OUT/e2e-1k-bs1.log" "$OUT/verify.log" ;;
lane-e2e4k)  # bs 1 at 4K: plain and bucketed
  timeout ${LANE_TIMEOUT:-560} python3 -m jaxspec.bench e2e --bs 1 --modes off,bucketed --prompt-len 4096 \
    --json "$OUT/e2e-4k-bs1.json" > "$OUT/e2e-4k-bs1.log" 2>&1
  grep "^e2e bs" "$OUT/e2e-4k-bs1.log" ;;
lane-cb-propose)  # command-buffer update mode: propose and verify launch and total time, default vs SKIP_TEMP
  for mode in ALWAYS_UPDATE SKIP_TEMP; do
    XLA_FLAGS=--xla_gpu_command_buffer_update_mode=$mode timeout 110 python3 -m jaxspec.bench propose --bs 1,4 \
      --ctx 4096 --eager-iters 1 --json "$OUT/propose-$mode.json" > "$OUT/propose-$mode.log" 2>&1
    XLA_FLAGS=--xla_gpu_command_buffer_update_mode=$mode timeout 110 python3 -m jaxspec.bench verify --bs 1 \
      --iters 50 --json "$OUT/verify-$mode.json" > "$OUT/verify-$mode.log" 2>&1
  done
  grep -A4 "^ctx  bs" "$OUT"/propose-*.log; grep "^step of" "$OUT"/verify-*.log ;;
lane-cb-e2e)  # the engine at bs 1, 1K, with each command-buffer update mode
  for mode in SKIP_TEMP ALWAYS_UPDATE; do
    XLA_FLAGS=--xla_gpu_command_buffer_update_mode=$mode timeout 250 python3 -m jaxspec.bench e2e --bs 1 \
      --modes off,bucketed --prompt-len 1024 --json "$OUT/e2e-1k-bs1-$mode.json" > "$OUT/e2e-$mode.log" 2>&1
  done
  grep -A3 "^bs  " "$OUT"/e2e-*.log ;;
s4-e4b)  # session 4, issue #13: the engine at bs $BS, 1K prompt, plain and bucketed, R in $RS, overlap off/on; the
  # bucketed rows of the first bs are profiled (command buffers kept) for the GPU-busy fraction and round gap
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout ${E2E_TIMEOUT:-540} python3 -m jaxspec.bench \
    e2e --bs "${BS:-1}" --prompt-len 1024 --modes "${MODES:-off,bucketed}" --rounds-per-call "${RS:-1,8}" --overlap off,on \
    ${PROFILE:+--profile-dir /tmp/prof} --json "$OUT/e2e-e4b-1k-bs${BS:-1}.json" > "$OUT/e2e-e4b-bs${BS:-1}.log" 2>&1
  grep "^e2e bs\|^trace\|Error" "$OUT/e2e-e4b-bs${BS:-1}.log" | head -30 ;;
s4-tests)  # the transformers-equivalence tests on the GPU (Triton kernels, fp32): issue #14's GPU lane
  timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -s ${TESTS:-tests/test_kernels.py \
    tests/test_model.py tests/test_paged.py tests/test_drafter.py tests/test_rounds.py} > "$OUT/tests.txt" 2>&1
  grep -E "^bf16|passed|failed|Error" "$OUT/tests.txt" | tail -15 ;;
s4-270m)  # the default pair: assemble the carried GGUF (.gg/part*, xz), convert it, then the engine at bs 1 (16
  # held-out prompts one at a time, 128 new tokens) over R and overlap, and bs 8
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl
  cat .gg?/part* | python3 -c "import lzma, sys, shutil; shutil.copyfileobj(lzma.LZMAFile(sys.stdin.buffer), \
    open('/tmp/model.gguf', 'wb'))"
  sha256sum /tmp/model.gguf > "$OUT/270m.log"
  PYTHONPATH=/tmp/site:. python3 -c "
from jaxspec.model import gguf
try:
    gguf.convert_gguf('/tmp/model.gguf', '/root/gemma-3-270m')
except Exception as e:  # the image's transformers may lack the GGUF tokenizer converters: weights only (ids in)
    print('tokenizer skipped:', e)
    gguf._tokenizer = lambda meta: type('NoTokenizer', (), {'save_pretrained': lambda self, d: None})()
    gguf.convert_gguf('/tmp/model.gguf', '/root/gemma-3-270m')
from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())" >> "$OUT/270m.log" 2>&1
  A=$(tail -1 "$OUT/270m.log")
  timeout ${E2E_TIMEOUT:-400} python3 -m jaxspec.bench e2e --model /root/gemma-3-270m --assistant "$A" \
    --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 --modes off,bucketed \
    --rounds-per-call "${RS:-1,2,4,8,16}" --overlap off,on --json "$OUT/e2e-270m-bs1.json" >> "$OUT/270m.log" 2>&1
  timeout ${E2E8_TIMEOUT:-120} python3 -m jaxspec.bench e2e --model /root/gemma-3-270m --assistant "$A" \
    --prompts bench/prompts/270m-heldout.jsonl --bs 8 --requests 16 --new-tokens 128 --modes off,bucketed \
    --rounds-per-call "${RS8:-1,8}" --overlap off,on --json "$OUT/e2e-270m-bs8.json" >> "$OUT/270m.log" 2>&1
  grep "^e2e bs\|Error\|skipped" "$OUT/270m.log" | head -40 ;;
s6-stage)  # keep what this call carried (a part of the GGUF, .whl, .tok, .dist) in /root/carry: a later call's copy of the
  # working tree removes the paths an earlier call carried
  mkdir -p /root/carry; for d in .gg* .whl .tok .dist; do [ -e "$d" ] && cp -r "$d" "/root/carry/"; done
  du -ab /root/carry; df -h /root | tail -1 ;;
s6-tests)  # issue #13's GPU lane again: the round tests against transformers' greedy (Triton kernels, fp32)
  # (TESTS: the files; K: pytest's -k expression, e.g. K="not greedy_equals")
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -rA -p no:cacheprovider -s ${TESTS:-tests/test_rounds.py} \
    ${K:+-k "$K"} > "$OUT/tests.txt" 2>&1
  grep -E "passed|failed|Error" "$OUT/tests.txt" | tail -15 ;;
s6-distill)  # issue #17: assemble and convert the GGUF (tokenizer from .tok), distill a drafter on the mixed corpus
  # (.dist/mixed.jsonl.xz from `python -m jaxspec.corpus`) with early stopping, pack it under $OUT/packed
  cat "$OUT/gpu-s6-distill.txt" > "$OUT/distill.log"; rm -f "$OUT/gpu-s6-distill.txt"  # 8 files come back at most
  bash bench/h200.sh s6-stage > /dev/null 2>&1; rm -f "$OUT/gpu-s6-stage.txt"; cd /root/carry
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl
  cat .gg?/part | python3 -c "import lzma, sys, shutil; shutil.copyfileobj(lzma.LZMAFile(sys.stdin.buffer), \
    open('/tmp/model.gguf', 'wb'))"
  sha256sum /tmp/model.gguf >> "$OUT/distill.log"; cd - > /dev/null
  PYTHONPATH=/tmp/site:. python3 -c "
from jaxspec.model import gguf
gguf._tokenizer = lambda meta: type('NoTokenizer', (), {'save_pretrained': lambda self, d: None})()
gguf.convert_gguf('/tmp/model.gguf', '/root/gemma-3-270m')" >> "$OUT/distill.log" 2>&1
  tar xJf /root/carry/.tok/tok.tar.xz -C /root/gemma-3-270m  # the tokenizer converted where transformers 5.24 is
  xz -dc /root/carry/.dist/mixed.jsonl.xz > /root/mixed.jsonl
  timeout ${DISTILL_TIMEOUT:-480} python3 -m jaxspec.distill --model /root/gemma-3-270m --out /root/asst \
    --packed-out "$OUT/packed" --prompts /root/mixed.jsonl --quiet ${DISTILL_ARGS:---k 4 --num-prompts 8000 \
    --num-heldout 384 --gen-batch 512 --eval-every 500 --patience 3 --time-limit 400} >> "$OUT/distill.log" 2>&1
  grep -v "^ *$" "$OUT/distill.log" | tail -30 ;;
s6-bench)  # issues #16 and #17 with the drafter s6-distill left in /root/asst: the server under 1, 8, 32 streaming
  # clients, then the engine at bs 1 (16 held-out prompts one at a time, 128 new tokens) for k = 1..6
  # the image has no ASGI stack: carry .whl from `python3 -m pip download --only-binary=:all: --python-version 3.12
  # --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl fastapi==0.165.0
  # uvicorn==0.54.0 httpx` (with their dependencies: 3.9 MB)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-serve \
    $(ls .whl/*.whl /root/carry/.whl/*.whl 2>/dev/null | grep -v gguf) > "$OUT/serve.log" 2>&1
  python3 -c "from transformers import AutoTokenizer as T; print(T.from_pretrained('/root/gemma-3-270m'))" \
    >> "$OUT/serve.log" 2>&1 || rm -f /root/gemma-3-270m/tokenizer*  # this transformers cannot read it: ids in
  PYTHONPATH=/tmp/site-serve:. timeout ${SERVE_TIMEOUT:-330} python3 -m jaxspec.bench serve --model /root/gemma-3-270m --assistant /root/asst \
    --server-args "--max-running-requests 32 ${SERVE_ARGS:-}" --clients 1,8,32 \
    --prompts bench/prompts/270m-heldout.jsonl --json "$OUT/serve-270m.json" >> "$OUT/serve.log" 2>&1
  timeout ${E2E_TIMEOUT:-330} python3 -m jaxspec.bench e2e --model /root/gemma-3-270m --assistant /root/asst \
    --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 --modes off,bucketed \
    -k "${KS:-1,2,3,4,5,6}" --rounds-per-call "${RS:-1,16}" --overlap on --json "$OUT/e2e-270m-k.json" \
    > "$OUT/e2e.log" 2>&1
  grep -v "^ *$" "$OUT/serve.log" | tail -12; grep "^e2e bs\|Error" "$OUT/e2e.log" | head -30 ;;
s7-tests)  # issue #14's GPU lane for the fused drafter step: its kernels against their references, the drafter against
  # the eager path (every batch size, bf16 seed rule), the attention kernels, the engine's lossless sweep (Triton, fp32)
  timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -s ${TESTS:-tests/test_draft_layer.py \
    tests/test_drafter.py tests/test_kernels.py tests/test_engine.py::test_speculative_greedy_is_lossless} \
    > "$OUT/tests.txt" 2>&1
  grep -E "^bf16|passed|failed|Error" "$OUT/tests.txt" | tail -15 ;;
s7-propose)  # issue #14: E4B propose at 4K, the fused step against the default (bucketed) step and eager, side by
  # side; the fused bs-1 propose traced (launches, kernel time), then the default one
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout 330 python3 -m jaxspec.bench propose \
    --bs 1,4,16,64 --ctx 4096 --variants fused,bucketed,eager --eager-iters 3 --profile-dir /tmp/pp \
    --json "$OUT/propose.json" > "$OUT/propose.log" 2>&1
  timeout 60 python3 -m jaxspec.bench trace /tmp/pp --rounds 20 --top 30 --json "$OUT/propose-trace.json" \
    >> "$OUT/propose.log" 2>&1
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout 120 python3 -m jaxspec.bench propose --bs 1 \
    --ctx 4096 --variants bucketed --profile-dir /tmp/pp2 --json "$OUT/propose-default.json" \
    > "$OUT/propose-default.log" 2>&1
  timeout 60 python3 -m jaxspec.bench trace /tmp/pp2 --rounds 20 --top 10 --json "$OUT/propose-default-trace.json" \
    >> "$OUT/propose-default.log" 2>&1
  grep -A7 "^ctx  bs" "$OUT/propose.log"; grep -h "all kernels\|launches\|Error" "$OUT"/propose*.log | head ;;
s7-e4b)  # issue #13/#14: the engine on the E4B random pair, bs 1, 1K prompt: plain, the default draft and the fused one
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout ${E2E_TIMEOUT:-400} python3 -m jaxspec.bench \
    e2e --bs 1 --prompt-len 1024 --modes off,bucketed,bucketed-fused --rounds-per-call 1 --overlap on \
    --profile-dir /tmp/prof --json "$OUT/e2e-e4b-1k-bs1.json" > "$OUT/e2e-e4b.log" 2>&1
  grep "^e2e bs\|^trace\|Error" "$OUT/e2e-e4b.log" | head -20 ;;
s8-propose)  # issue #14: the fused drafter step's second version against the default, E4B drafter, k 3, 4K, both traced
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout 200 python3 -m jaxspec.bench propose \
    --bs ${PBS:-1,16} --ctx 4096 --variants fused,bucketed --profile-dir /tmp/pp \
    --json "$OUT/propose.json" > "$OUT/propose.log" 2>&1
  timeout 60 python3 -m jaxspec.bench trace /tmp/pp --rounds 20 --top 30 --json "$OUT/propose-fused-trace.json" \
    >> "$OUT/propose.log" 2>&1
  [ -z "${SKIP_DEFAULT:-}" ] && XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout 100 \
    python3 -m jaxspec.bench propose --bs 1 --ctx 4096 --variants bucketed --profile-dir /tmp/pp2 --json "$OUT/propose-default.json" \
    > "$OUT/propose-default.log" 2>&1
  [ -z "${SKIP_DEFAULT:-}" ] && timeout 60 python3 -m jaxspec.bench trace /tmp/pp2 --rounds 20 --top 10 \
    --json "$OUT/propose-default-trace.json" >> "$OUT/propose-default.log" 2>&1
  grep -A5 "^ctx  bs" "$OUT"/propose*.log; grep -h "all kernels\|launches\|Error" "$OUT"/propose*.log | head ;;
s8-data)  # issue #17: the target's greedy continuations of the mixed corpus (carried in .dist) into /root/conts.npz,
  # until DATA_LIMIT seconds (after s7-convert); a later call adds to the same file
  [ -e .dist ] && xz -dc .dist/mixed.jsonl.xz > /root/mixed.jsonl
  timeout 590 python3 -m jaxspec.distill --model /root/gemma-3-270m --out /root/asst --prompts /root/mixed.jsonl \
    --continuations /root/conts.npz --data-only --time-limit ${DATA_LIMIT:-480} ${DISTILL_ARGS:-} \
    > "$OUT/data.log" 2>&1
  tail -4 "$OUT/data.log" ;;
s8-train)  # issue #17: distill on the continuations in /root/conts.npz (missing ones generated), early stopping on
  # the held-out accept length; the drafter in /root/asst, its packed form under $OUT/packed
  timeout 590 python3 -m jaxspec.distill --model /root/gemma-3-270m --out /root/asst --packed-out "$OUT/packed" \
    --prompts /root/mixed.jsonl --continuations /root/conts.npz --quiet ${DISTILL_ARGS:-} \
    --time-limit ${TRAIN_LIMIT:-500} > "$OUT/distill.log" 2>&1
  cp /root/asst/distill.json "$OUT/" 2>/dev/null; tail -4 "$OUT/distill.log" ;;
s8-e2e)  # issues #13, #17: the engine at bs 1 on 16 held-out prompts, 128 new tokens: plain, the shipped drafter and
  # the new one (/root/asst) at each k in KS, side by side in one call
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  for a in /root/asst $A; do n=$([ "$a" = /root/asst ] && echo new || echo shipped)
    timeout ${E2E_TIMEOUT:-270} python3 -m jaxspec.bench e2e --model /root/gemma-3-270m --assistant "$a" \
      --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 \
      --modes $([ $n = new ] && echo "${MODES:-off,bucketed}" || echo bucketed) -k ${KS:-3,4} --rounds-per-call 16 \
      --overlap on --json "$OUT/e2e-270m-$n.json" > "$OUT/e2e-270m-$n.log" 2>&1
  done
  grep -h "^e2e bs\|Error" "$OUT"/e2e-270m-*.log | head -30 ;;
s8-serve)  # issue #16: the server (default pair, s7-convert first) under 1, 8 and 32 streaming clients, with the
  # engine thread's time by phase and the GC pauses from /metrics (session 8 ran it with a GIL switch-interval flag,
  # since removed: no effect)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-serve \
    $(ls /root/carry/.whl/*.whl | grep -v gguf) > "$OUT/serve.log" 2>&1
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  PYTHONPATH=/tmp/site-serve:. timeout ${SERVE_TIMEOUT:-420} python3 -m jaxspec.bench serve --model /root/gemma-3-270m \
    --assistant "$A" --server-args "--max-running-requests 32 --draft-bs 1,8,32 ${SERVE_ARGS:-}" \
    --clients ${CLIENTS:-1,8,32} --prompts bench/prompts/270m-heldout.jsonl --json "$OUT/serve-270m.json" \
    >> "$OUT/serve.log" 2>&1
  grep -v "^ *$" "$OUT/serve.log" | grep -v "^Finished\|^Compiling\|^W1" | tail -16 ;;
s8-prefill)  # issue #16: the XLA prefill attention over live key blocks on the GPU: a bs-8 prefill of 64-token prompts
  # (E2B random pair, TTFT) at max_context 32768 with it and with the whole-width path it replaced
  # (.dist/cache_before.py: jaxspec/paged_kv/cache.py of 35a8dcb), its kernel tests, then at max_context 1024
  # (session 8: at 100 s a run, both 32768 runs were cut before printing anything; 1024 took 372 ms TTFT)
  run() { timeout ${PREFILL_TIMEOUT:-300} python3 -m jaxspec.bench e2e --preset E2B --bs 8 --prompt-len 64 --new-tokens 8 --modes off \
    --max-context $1 --json "$OUT/prefill-$1${2:-}.json" > "$OUT/prefill-$1${2:-}.log" 2>&1; }
  run 32768; cp jaxspec/paged_kv/cache.py /tmp/cache_after.py
  [ -e .dist/cache_before.py ] && cp .dist/cache_before.py jaxspec/paged_kv/cache.py && run 32768 -before
  cp /tmp/cache_after.py jaxspec/paged_kv/cache.py
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "blocked or matches_reference" \
    > "$OUT/tests.txt" 2>&1; tail -1 "$OUT/tests.txt"
  run 1024
  python3 -c "import json, glob
for f in sorted(glob.glob('$OUT/prefill-*.json')): print(f, [round(r['ttft_ms_mean'], 1) for r in json.load(open(f))['rows']])"
  grep -h "Error" "$OUT"/prefill-*.log | head -5 ;;
s9-serve)  # issue #16: the server (default pair, s7-convert first) with every program run once at start-up (the
  # default on a GPU) against JAXSPEC_PRIME=0, each with a per-step log of the engine thread (JAXSPEC_STEP_LOG)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-serve \
    $(ls /root/carry/.whl/*.whl | grep -v gguf) > /dev/null 2>&1
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  for v in ${SERVE_VARIANTS:-primed unprimed}; do
    JAXSPEC_PRIME=$([ $v = primed ] && echo 1 || echo 0) JAXSPEC_STEP_LOG="$OUT/steps-$v.jsonl" \
    PYTHONPATH=/tmp/site-serve:. timeout $([ $v = primed ] && echo ${SERVE_TIMEOUT:-360} || echo 150) \
      python3 -m jaxspec.bench serve --model /root/gemma-3-270m --assistant "$A" \
      --server-args "--max-running-requests 32 --draft-bs 1,8,32 ${SERVE_ARGS:-}" \
      --clients $([ $v = primed ] && echo ${CLIENTS:-1,8,32} || echo 8,32) --prompts bench/prompts/270m-heldout.jsonl \
      --json "$OUT/serve-$v.json" > "$OUT/serve-$v.log" 2>&1
    echo "== $v"; grep -v "^ *$" "$OUT/serve-$v.log" | grep -v "^Finished\|^Compiling\|^W1" | tail -12
    python3 -c "import json; s = [json.loads(x) for x in open('$OUT/steps-$v.jsonl')]
print(len(s), 'steps,', round(sum(x['step_s'] for x in s), 2), 's; the 8 longest:')
for x in sorted(s, key=lambda x: -x['step_s'])[:8]: print(x)" 2>&1 | tail -9
  done ;;
s9-diag)  # issue #16: one prefill call's wall time by rows and kernels on/off, one profiled call each and its top
  # kernels (bench/diag_prefill.py); DIAG_MODEL: a model folder or a preset name (default: the converted 270M)
  m=${DIAG_MODEL:-/root/gemma-3-270m}
  timeout ${DIAG_TIMEOUT:-300} python3 bench/diag_prefill.py $m --rows ${DIAG_ROWS:-1,8,32} \
    --kernels ${DIAG_KERNELS:-on,off} --profile /tmp/pf > "$OUT/diag-$(basename $m).log" 2>&1
  grep -v "^W1\|^I1\|^ *$" "$OUT/diag-$(basename $m).log" | tail -60 ;;
s10-launch)  # issues #14/#17: the host's cost per call of an N-kernel program and of the bs-1 propose under XLA's
  # command-buffer update modes (bench/diag_launch.py; FLAGSETS: `;`-separated XLA_FLAGS sets, "default" = none)
  IFS=';' read -ra sets <<< "${FLAGSETS:-default;--xla_gpu_command_buffer_update_mode=SKIP_TEMP;--xla_gpu_command_buffer_update_mode=SKIP_PROFILED;--xla_gpu_temp_buffer_use_separate_color=true;--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_command_buffer_update_mode=SKIP_TEMP}"
  i=0; for f in "${sets[@]}"; do i=$((i+1)); [ "$f" = default ] && f=""
    XLA_FLAGS="$f" timeout 120 python3 bench/diag_launch.py --kernels ${LAUNCH_N:-50,400} --json "$OUT/launch-$i.json" \
      > "$OUT/launch-$i.log" 2>&1; grep -v "^W\|^I" "$OUT/launch-$i.log" | tail -4; done
  [ -n "${PROPOSE_SETS:-}" ] && IFS=';' read -ra psets <<< "$PROPOSE_SETS" && i=0 && for f in "${psets[@]}"; do
    i=$((i+1)); [ "$f" = default ] && f=""
    XLA_FLAGS="$f" timeout 150 python3 -m jaxspec.bench propose --bs 1,16 --ctx 4096 --variants bucketed \
      --json "$OUT/propose-$i.json" > "$OUT/propose-$i.log" 2>&1; echo "== $f"; grep -A3 "^ctx  bs" "$OUT/propose-$i.log"
    grep "Error" "$OUT/propose-$i.log" | head -3; done ;;
s10-propose)  # issues #14/#17: the bs-1 propose, E4B drafter, k 3, 4K: this tree against the one before the donated
  # outputs (.before, carried: `git archive` of that commit's jaxspec/), side by side, the new one traced. (`python3 -P`:
  # `-m` puts the working directory first on sys.path, ahead of PYTHONPATH, so until session 40 the "before" runs of
  # s10-propose and s10-ab270 imported this tree's jaxspec too)
  for t in before now; do pp=$([ $t = before ] && echo .before || echo .)
    PYTHONPATH=$pp XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout 200 python3 -P -m jaxspec.bench \
      propose --bs ${PBS:-1,16} --ctx 4096 --variants bucketed $([ $t = now ] && echo --profile-dir /tmp/pp) \
      --json "$OUT/propose-$t.json" > "$OUT/propose-$t.log" 2>&1
    echo "== $t"; grep -A4 "^ctx  bs" "$OUT/propose-$t.log"; grep "Error" "$OUT/propose-$t.log" | head -3; done
  timeout 60 python3 -m jaxspec.bench trace /tmp/pp --rounds 20 --top 10 --json "$OUT/propose-trace.json" \
    > "$OUT/propose-trace.log" 2>&1; grep -h "all kernels\|launches\|busy" "$OUT/propose-trace.log" | head -5 ;;
s10-ab270)  # issue #17: the default pair at bs 1 (s7-convert first), this tree against .before, plain and k 4 at R 1
  # and 16 (overlap on) side by side in one call; then this tree's R-1 rows traced
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  for t in before now; do pp=$([ $t = before ] && echo .before || echo .)
    PYTHONPATH=$pp timeout ${AB_TIMEOUT:-240} python3 -P -m jaxspec.bench e2e --model /root/gemma-3-270m --assistant "$A" \
      --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 --modes off,bucketed -k 4 \
      --rounds-per-call ${RS:-1,16} --overlap on --json "$OUT/e2e-270m-$t.json" > "$OUT/e2e-270m-$t.log" 2>&1
    echo "== $t"; grep "^e2e bs\|Error" "$OUT/e2e-270m-$t.log" | head -8; done ;;
s11-alloc)  # issues #14/#17 (next): which buffer slots move between calls, so that XLA re-records ~140 of the bs-1
  # propose graph's 207 commands every call (session 10), and whether SKIP_TEMP / SKIP_PROFILED (VMM allocator, set
  # through XLA_FLAGS before jax starts) stop it. XLA's own lines name the slots (gpu_executable=5: "Buffer
  # allocations changed address between module ... executions: [N:temp, M:live-out]"); the dump's
  # *buffer-assignment.txt says what each allocation index holds. No compile cache (a cached executable may drop
  # the update mode). E4B random weights, no GGUF.
  export JAX_ENABLE_COMPILATION_CACHE=false TF_CPP_MIN_LOG_LEVEL=0
  vm=gpu_executable=5,gpu_executable_buffer_allocator=3,gpu_executable_va_remap_allocator=3,command_buffer_thunk=3
  i=0; for mode in ${MODES_U:-ALWAYS_UPDATE SKIP_TEMP SKIP_PROFILED}; do i=$((i+1))
    d=$([ $i = 1 ] && echo "--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*program.*" || echo "")
    TF_CPP_VMODULE=$vm XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$mode $d" timeout 120 python3 -m jaxspec.bench \
      propose --bs 1 --ctx 4096 --variants bucketed --iters 20 --json "$OUT/propose-$mode.json" > /tmp/v.log 2>&1
    echo "== $mode: $(grep -A2 '^ ctx' /tmp/v.log | tail -1)"
    grep -oE "changed address between module [^ ]* executions: .*|copy-protection.*|Overriding allocator.*|Using (BFC|VMM).*|allocation policy.*|profile (selected|found).*" /tmp/v.log | cut -c1-200 | sort | uniq -c | sort -rn | head -8
    grep -o 'updated_allocs=[0-9]*' /tmp/v.log | sort | uniq -c; grep -i "error" /tmp/v.log | head -2
    grep -E "changed address|updated_allocs|Updated [0-9]+ commands" /tmp/v.log | tail -400 > "$OUT/vlog-$mode.txt"; done
  # one file back (at most 8 come back): the propose program's buffer assignment, whose allocations the log names
  f=$(ls -S /tmp/dump/*jit__program*buffer-assignment.txt 2>/dev/null | head -1); [ -n "$f" ] && cp "$f" "$OUT/buffer-assignment.txt"
  grep -hE "^allocation [0-9]+:" "$OUT/buffer-assignment.txt" 2>/dev/null | cut -c1-160 | tail -30 ;;
s11-unroll)  # issues #17/#13 (next): R rounds a call as a device `while` loop against unrolled (JAXSPEC_UNROLL_ROUNDS=1),
  # the default pair at bs 1 (s7-convert first; UNROLL_MODEL=E4B for the random E4B pair at a 1K prompt instead)
  if [ "${UNROLL_MODEL:-270m}" = E4B ]; then what="--bs 1 --prompt-len 1024"; else
    what="--model /root/gemma-3-270m --assistant $(python3 -c 'from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())') --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128"; fi
  for u in 0 1; do JAXSPEC_UNROLL_ROUNDS=$u timeout ${UNROLL_TIMEOUT:-250} python3 -m jaxspec.bench e2e $what \
      --modes off,bucketed -k 4 --rounds-per-call $([ $u = 0 ] && echo ${RS_WHILE:-1,4,16} || echo ${RS_UNROLL:-4,8}) --overlap on \
      --json "$OUT/e2e-unroll$u.json" > "$OUT/e2e-unroll$u.log" 2>&1
    echo "== JAXSPEC_UNROLL_ROUNDS=$u"; grep "^e2e bs\|Error" "$OUT/e2e-unroll$u.log" | head -8; done ;;
s12-gather)  # issue #14 (next): JAXSPEC_ATTN_GATHER_Q=0 against 1 side by side (the attention kernel reading its query
  # rows from q as it is: no transposed, padded copy of q before each call; session 10's k-4 round had 27 pad fusions),
  # the default pair at bs 1, plain and k 4 at R 4 (s7-convert first); then the GPU lane's test of the switch
  switch_ab_270m JAXSPEC_ATTN_GATHER_Q gq ${GQ_TIMEOUT:-200}
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "matches_reference" \
    "tests/test_rounds.py::test_kernels_gathering_q_equal_transformers_greedy" > "$OUT/tests-gather.txt" 2>&1
  tail -2 "$OUT/tests-gather.txt" ;;
s12-sweep)  # issues #17/#14: the default pair at bs 1, R 4 (unrolled, device-paced): plain against k 4 and 5, the default
  # draft step and the fused one (bucketed-fused) side by side in one call (s7-convert first)
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  timeout ${SWEEP_TIMEOUT:-330} python3 -m jaxspec.bench e2e --model /root/gemma-3-270m --assistant "$A" \
    --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 \
    --modes ${SWEEP_MODES:-off,bucketed,bucketed-fused} -k ${SWEEP_K:-4,5} --rounds-per-call ${RS:-4} --overlap on \
    --json "$OUT/e2e-270m-sweep.json" > "$OUT/e2e-270m-sweep.log" 2>&1
  grep "^e2e bs\|Error" "$OUT/e2e-270m-sweep.log" | head -12 ;;
s13-qkv)  # issue #14 (next): JAXSPEC_FUSE_QKV=0 against 1 side by side (one q/k/v stack per layer group: no weight-slice
  # copies for the verify's merged product; session 12's R-4 trace: 54 a call), the default pair at bs 1, plain and
  # k 4 at R 4 (s7-convert first); then the fused-stack tests on the GPU (Triton kernels)
  switch_ab_270m JAXSPEC_FUSE_QKV fq ${FQ_TIMEOUT:-200}
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -k fused_qkv \
    "tests/test_rounds.py::test_fused_qkv_engine_equals_transformers_greedy" > "$OUT/tests-qkv.txt" 2>&1
  tail -2 "$OUT/tests-qkv.txt" ;;
s14-ab)  # issue #14: JAXSPEC_FUSE_QKV x JAXSPEC_ATTN_GATHER_Q (q read and, since session 13, the attention output
  # written in q's own layout: no pad before the kernel, no un-padding slice after it), the four side by side, the
  # default pair at bs 1, plain and k 4 at R 4 (s7-convert first)
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  for fq in 0 1; do for gq in 0 1; do
    JAXSPEC_FUSE_QKV=$fq JAXSPEC_ATTN_GATHER_Q=$gq timeout ${AB_TIMEOUT:-140} python3 -m jaxspec.bench e2e \
      --model /root/gemma-3-270m --assistant "$A" --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 \
      --new-tokens 128 --modes off,bucketed -k 4 --rounds-per-call ${RS:-4} --overlap on \
      --json "$OUT/e2e-270m-fq$fq-gq$gq.json" > "$OUT/e2e-270m-fq$fq-gq$gq.log" 2>&1
    echo "== FUSE_QKV=$fq GATHER_Q=$gq"; grep "^e2e bs\|Error" "$OUT/e2e-270m-fq$fq-gq$gq.log" | head -4; done; done ;;
s15-inv)  # issue #14: batch-invariant decoding (--batch-invariant P): its GPU lane (the kernels' fixed splits, engine
  # against transformers' greedy, bf16 speculative = plain), then the E4B random pair's fraction of requests whose
  # bf16 speculative greedy output equals plain (s12-same's run, every row at P 5; session 12 without: 0 of 64)
  timeout ${TEST_TIMEOUT:-140} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_rounds.py \
    -k "fixed_splits or batch_invariant" > "$OUT/tests-invariant.txt" 2>&1
  grep -E "passed|failed|Error" "$OUT/tests-invariant.txt" | tail -8
  timeout ${SAME_TIMEOUT:-400} python3 -m jaxspec.bench e2e --bs 16 --requests 64 --prompt-len 1024 --new-tokens 64 \
    --modes off,bucketed -k 4 --batch-invariant 5 --json "$OUT/e2e-e4b-same-inv.json" > "$OUT/e2e-e4b-same-inv.log" 2>&1
  grep "^e2e bs\|Error" "$OUT/e2e-e4b-same-inv.log"; grep -A4 "^bs " "$OUT/e2e-e4b-same-inv.log" ;;
s15-ab)  # issue #14: the default pair at bs 1, plain and k 4 at R 4, without and with --batch-invariant 5 side by side
  # (the mode's cost, and spec = plain on the held-out prompts; s7-convert first)
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  for p in 0 5; do
    timeout ${AB_TIMEOUT:-150} python3 -m jaxspec.bench e2e --model /root/gemma-3-270m --assistant "$A" \
      --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 --modes off,bucketed -k 4 \
      --rounds-per-call ${RS:-4} --overlap on --batch-invariant $p --json "$OUT/e2e-270m-inv$p.json" \
      > "$OUT/e2e-270m-inv$p.log" 2>&1
    echo "== batch-invariant $p"; grep "^e2e bs\|Error" "$OUT/e2e-270m-inv$p.log" | head -4
    grep -A4 "^bs " "$OUT/e2e-270m-inv$p.log" | head -5; done ;;
s16-merged)  # issue #14: the attention's split merge inside the attention kernel (the last piece of a query block to
  # finish merges, after an atomic count; JAXSPEC_ATTN_MERGED, off by default since this part ran). PARTS (default "lane verify rest"): its GPU
  # lane (the kernels against the reference, the count's teeth, the engine against transformers' greedy, bucketed =
  # eager drafts; Triton), the E4B verify at bs 1 traced (launches a step), then decode and propose at bs 1, 4K; each
  # E4B benchmark with the switch 0 and 1 side by side
  for part in ${PARTS:-lane verify rest}; do case $part in
  lane)
    timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_rounds.py \
      tests/test_drafter.py -k "matches_reference or teeth or gathering_q or batch_invariant or bucketed_equals_eager \
      or bf16_drafts" > "$OUT/tests-merged.txt" 2>&1
    grep -E "passed|failed|Error" "$OUT/tests-merged.txt" | tail -6 ;;
  verify)
    for v in 0 1; do
      JAXSPEC_ATTN_MERGED=$v XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true \
        timeout ${VERIFY_TIMEOUT:-100} python3 -m jaxspec.bench verify --bs 1 --profile-dir /tmp/v$v \
        --json "$OUT/verify-m$v.json" > "$OUT/verify-m$v.log" 2>&1
      timeout 60 python3 -m jaxspec.bench trace /tmp/v$v --rounds 20 --json "$OUT/trace-verify-m$v.json" \
        >> "$OUT/verify-m$v.log" 2>&1
      echo "== JAXSPEC_ATTN_MERGED=$v"; grep "^step of\|launches\|Error" "$OUT/verify-m$v.log" | head -4; done ;;
  rest)
    for v in 0 1; do
      JAXSPEC_ATTN_MERGED=$v timeout ${DECODE_TIMEOUT:-90} python3 -m jaxspec.bench decode \
        --json "$OUT/decode-m$v.json" > "$OUT/decode-m$v.log" 2>&1
      JAXSPEC_ATTN_MERGED=$v timeout ${PROPOSE_TIMEOUT:-90} python3 -m jaxspec.bench propose --bs 1 --ctx 4096 \
        --variants bucketed --json "$OUT/propose-m$v.json" > "$OUT/propose-m$v.log" 2>&1
      echo "== JAXSPEC_ATTN_MERGED=$v"; grep -h "^step of\|Error" "$OUT/decode-m$v.log"
      grep -h "^propose ctx\|Error" "$OUT/propose-m$v.log" | head -3; done ;;
  esac; done ;;
s16-splits)  # issue #14: piece counts 1, 2, 4, 8 and the default rule, each with the merge kernel and with the merge
  # in the attention kernel, and 2, 4, default with 64-key blocks, on chains of 16 layers at the 270M pair's shapes
  # (bench/diag_splits.py; no GGUF)
  timeout ${SPLITS_TIMEOUT:-520} python3 bench/diag_splits.py --splits ${SPLITS:-1,2,4,8,0} --merged 0,1 \
    --wide-splits ${WIDE:-2,4,0} --cases ${CASES:-512:200,512:512,4096:1024} --tq 1,5 --iters 100 \
    --json "$OUT/diag-splits.json" \
    > "$OUT/diag-splits.log" 2>&1
  grep -v Warning "$OUT/diag-splits.log" | grep "^{\|Error" | cut -c1-400 ;;
s17-prefetch)  # issue #14: the attention's key walk pipelined by hand (JAXSPEC_ATTN_PREFETCH, off by default). PARTS
  # (default "lane diag verify decode"): its GPU lane (the kernel against the reference, the engine against
  # transformers' greedy), the diagnosis at 1, 2, 4 pieces and the default rule with and without it, then E4B's verify
  # (bs 1, traced: every kernel listed) and decode, the switch 0 and 1 side by side (no GGUF)
  for part in ${PARTS:-lane diag verify decode}; do case $part in
  lane)
    timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_rounds.py \
      -k "prefetch or gathering_q" > "$OUT/tests-prefetch.txt" 2>&1
    grep -E "passed|failed|Error" "$OUT/tests-prefetch.txt" | tail -4 ;;
  diag)
    timeout ${SPLITS_TIMEOUT:-200} python3 bench/diag_splits.py --splits 1,2,4,0 --prefetch-splits 1,2,4,0 \
      --cases ${CASES:-512:200,4096:1024,512:512} --tq 1,5 --iters 100 --json "$OUT/diag-prefetch.json" \
      > "$OUT/diag-prefetch.log" 2>&1
    grep "^{\|Error" "$OUT/diag-prefetch.log" | cut -c1-400 ;;
  verify)
    ab_verify JAXSPEC_ATTN_PREFETCH pf ${VERIFY_TIMEOUT:-100} ;;
  decode)
    for v in 0 1; do
      JAXSPEC_ATTN_PREFETCH=$v timeout ${DECODE_TIMEOUT:-120} python3 -m jaxspec.bench decode \
        --json "$OUT/decode-pf$v.json" > "$OUT/decode-pf$v.log" 2>&1
      echo "== JAXSPEC_ATTN_PREFETCH=$v"; grep -h "^step of\|Error" "$OUT/decode-pf$v.log"; done ;;
  esac; done ;;
s17-norms)  # issue #14: the residual stream's norms, one kernel a site (jaxspec/pallas/row_norms.py; JAXSPEC_FUSED_NORMS,
  # off by default since this part ran in session 16; the v2 kernel's lane is in s18).
  # PARTS (default "perf lane"): E4B's verify (bs 1, 4K, traced, every kernel listed; the switch-0 run with XLA's
  # optimized HLO to name them), decode (bs 1, paged) and propose (bs 1, 4K), the switch 0 and 1 side by side; then the
  # GPU lane (the kernel against its reference, the engine against transformers' greedy, bucketed = eager drafts)
  for part in ${PARTS:-perf lane}; do case $part in
  perf)
    ab_e4b JAXSPEC_FUSED_NORMS fn ;;
  lane)
    timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_row_norms.py tests/test_rounds.py \
      tests/test_drafter.py -k "add_norm or fused_norms or gathering_q or batch_invariant or bucketed_equals_eager \
      or bf16_drafts" > "$OUT/tests-norms.txt" 2>&1
    grep -E "passed|failed|Error" "$OUT/tests-norms.txt" | tail -6 ;;
  esac; done ;;
s18-sweep)  # issue #14: the small products' kernel cut by cut (gemv.Config) against XLA's product at E4B's shapes,
  # rows 4 (verify, bs 1) for every shape and cut, then rows 1 for XLA and the dot cuts (bench/diag_gemv.py)
  timeout ${SWEEP_TIMEOUT:-330} python3 bench/diag_gemv.py --rows 4 --shapes qkv,o,ple_gate,ple_proj,qkv_global --profile \
    --json "$OUT/gemv-sweep4.json" > "$OUT/gemv-sweep4.log" 2>&1
  grep "^==\|Error" "$OUT/gemv-sweep4.log"
  timeout ${SWEEP1_TIMEOUT:-120} python3 bench/diag_gemv.py --rows 1 --shapes qkv,o,ple_gate,ple_proj --profile \
    --configs xla,dot-16x256-s3,dot-16x512-s3,dot-32x128-s4 \
    --json "$OUT/gemv-sweep1.json" > "$OUT/gemv-sweep1.log" 2>&1
  grep "^==\|Error" "$OUT/gemv-sweep1.log" ;;
s18-cublas)  # issue #14: XLA's small products through cuBLAS instead of its Triton GEMMs (no split-K reduction kernel?):
  # the products alone at E4B's shapes (bench/diag_gemv.py, XLA only), then E4B's verify (traced) and decode (bs 1, 4K)
  # with the XLA flag off and on, side by side in one call (decode only with DECODE=1)
  local_flag=--xla_gpu_enable_triton_gemm=false
  for v in 0 1; do f=$([ $v = 1 ] && echo $local_flag)
    XLA_FLAGS="$f" timeout 60 python3 bench/diag_gemv.py --configs xla --rows 4,1 --shapes qkv,o,ple_gate,ple_proj \
      --profile --json "$OUT/gemv-xla-cublas$v.json" 2>&1 | grep "^[a-z]" | cut -c1-150
    XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true $f" timeout 100 python3 -m jaxspec.bench verify \
      --bs 1 --profile-dir /tmp/cb$v --json "$OUT/verify-cublas$v-experiment.json" > "$OUT/verify-cublas$v.log" 2>&1
    timeout 60 python3 -m jaxspec.bench trace /tmp/cb$v --rounds 20 --top 900 --json "$OUT/trace-verify-cublas$v.json" \
      >> "$OUT/verify-cublas$v.log" 2>&1
    [ -n "${DECODE:-}" ] && XLA_FLAGS="$f" timeout 90 python3 -m jaxspec.bench decode --bs 1 --cache paged \
      --json "$OUT/decode-cublas$v-experiment.json" > "$OUT/decode-cublas$v.log" 2>&1
    echo "== triton gemm off: $v"; grep -h "^step of\|launches\|Error" "$OUT/verify-cublas$v.log" "$OUT/decode-cublas$v.log"
  done ;;
s19-data)  # issue #17 (next): the target's greedy continuations of a corpus ~3.9x session 8's (after s7-convert), carried
  # as .dist/mixed.jsonl.xz from `python -m jaxspec.corpus --model <the 270M> --out mixed.jsonl --max-per-source 0
  # --stride 32` (every source whole, prompts every 32 tokens), into /root/conts.npz; a later call adds to the file
  [ -e .dist ] && xz -dc .dist/mixed.jsonl.xz > /root/mixed.jsonl
  timeout ${DATA_TIMEOUT:-590} python3 -m jaxspec.distill --model /root/gemma-3-270m --out /root/asst \
    --prompts /root/mixed.jsonl --continuations /root/conts.npz --data-only --time-limit ${DATA_LIMIT:-540} \
    --num-prompts 1000000 --num-heldout 384 --gen-batch 1024 > "$OUT/data.log" 2>&1
  tail -3 "$OUT/data.log" ;;
s19-train)  # issue #17 (next): a drafter TAG (DISTILL_ARGS: e.g. "--assistant-layers 2") trained on every prompt of
  # s19-data's continuations, early stopping on the held-out accept length; its training state in /root/ckpt-TAG (a
  # later call with the same TAG resumes), the drafter in /root/asst-TAG, its packed form under $OUT/packed-TAG
  t=${TAG:-l4}
  timeout ${TRAIN_TIMEOUT:-590} python3 -m jaxspec.distill --model /root/gemma-3-270m --out /root/asst-$t \
    --packed-out "$OUT/packed-$t" --prompts /root/mixed.jsonl --continuations /root/conts.npz --num-prompts 1000000 \
    --num-heldout 384 --gen-batch 1024 --k 4 --batch 64 --eval-every 1000 --patience 3 --steps 60000 \
    --ckpt-dir /root/ckpt-$t --ckpt-every 2000 --quiet ${DISTILL_ARGS:-} --time-limit ${TRAIN_LIMIT:-520} \
    > "$OUT/distill-$t.log" 2>&1
  cp /root/asst-$t/distill.json "$OUT/distill-$t.json" 2>/dev/null; tail -4 "$OUT/distill-$t.log" ;;
s19-e2e)  # issue #17 (next): the default pair at bs 1 on 16 held-out prompts, 128 new tokens, R 4: plain, the shipped
  # drafter and each trained one (TAGS, from s19-train) at each k in KS, side by side in one call
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  for t in shipped ${TAGS:-l2 l4}; do a=$([ $t = shipped ] && echo "$A" || echo /root/asst-$t)
    timeout ${E2E_TIMEOUT:-200} python3 -m jaxspec.bench e2e --model /root/gemma-3-270m --assistant "$a" \
      --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 \
      --modes $([ $t = shipped ] && echo off,bucketed || echo bucketed) -k ${KS:-4,5} --rounds-per-call 4 \
      --overlap on --json "$OUT/e2e-270m-$t$([ $t = shipped ] || echo -experiment).json" > "$OUT/e2e-270m-$t.log" 2>&1
    echo "== $t"; grep -h "^e2e bs\|Error" "$OUT/e2e-270m-$t.log" | head -8
  done ;;
s20-fused)  # issue #14: with stable addresses (s20-io), does the fused drafter step's smaller graph (114 nodes against
  # 211) now show in the wall time? E4B drafter, k 3, 4K, bs 1: stable, fused_stable, bucketed, fused side by side;
  # the first (stable) traced: its kernels and launches a propose
  rm -rf /tmp/ps; XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout ${FUSED_TIMEOUT:-300} \
    python3 -m jaxspec.bench propose --bs 1 --ctx 4096 --variants stable,fused_stable,bucketed,fused \
    --profile-dir /tmp/ps --json "$OUT/propose-fused-stable.json" > "$OUT/propose-fused-stable.log" 2>&1
  timeout 60 python3 -m jaxspec.bench trace /tmp/ps --rounds 20 --json "$OUT/trace-propose-stable.json" \
    >> "$OUT/propose-fused-stable.log" 2>&1
  grep "^propose ctx\|launches\|busy\|Error\|error:" "$OUT/propose-fused-stable.log" | head -8 ;;
s21-pin)  # issue #14 (next): JAXSPEC_PIN_OUTPUT 0 against 1 (the decode call's output made at the program's start, so that
  # no temporary shares its buffer). First XLA's count of re-recorded graph nodes a call (E2B, bs 1, R 1, overlap:
  # session 20 saw 154 of 819 a plain call, 114 of 892 a k-3 round), then E4B end to end at bs 1 (R 1 and 4) with each
  # value, then, where s7-convert left it, the default pair (switch_ab_270m at R 1). PIN_STEPS: any of "vlog e4b 270m"
  vm=command_buffer_thunk=3,command_executor=2; steps=" ${PIN_STEPS:-vlog e4b 270m} "
  [[ $steps == *" vlog "* ]] && for v in 0 1; do
    JAXSPEC_PIN_OUTPUT=$v TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=$vm timeout ${PIN_TIMEOUT:-250} python3 -m jaxspec.bench \
      e2e --preset E2B --bs 1 --prompt-len 256 --new-tokens 64 --modes off,bucketed -k 3 --rounds-per-call 1 \
      --overlap on --json "$OUT/e2e-e2b-pin$v-vlog-experiment.json" > /tmp/pin$v.log 2>&1
    echo "== JAXSPEC_PIN_OUTPUT=$v: $(grep -h '^e2e bs' /tmp/pin$v.log | tr '\n' ' ')"
    grep -oE "Updated [0-9]+ commands in [0-9]+" /tmp/pin$v.log | awk '{n[$2]++; s[$2]+=$NF} END {for (k in n) \
      printf "  graph %s: %d updates, mean %.0f us\n", k, n[k], s[k]/n[k]}' | sort -t: -k2 -rn | head -4 \
      | tee "$OUT/pin$v-updates.txt"; done
  [[ $steps == *" e4b "* ]] && for v in ${PIN_VALUES:-0 1}; do JAXSPEC_PIN_OUTPUT=$v \
      timeout ${E2E_TIMEOUT:-300} python3 -m jaxspec.bench e2e --bs 1 --prompt-len 1024 \
      --modes off,bucketed -k 3 --rounds-per-call 1,4 --overlap on --json "$OUT/e2e-e4b-pin$v.json" \
      > "$OUT/e2e-e4b-pin$v.log" 2>&1; echo "== E4B JAXSPEC_PIN_OUTPUT=$v"; grep -h "^e2e bs" "$OUT/e2e-e4b-pin$v.log"; done
  [[ $steps == *" 270m "* ]] && [ -d /root/gemma-3-270m ] && RS=1 switch_ab_270m \
    JAXSPEC_PIN_OUTPUT pin ${AB_TIMEOUT:-200}; true ;;
s38-gelu)  # issue #14: the one-row PLE gate's gelu written x / (1 + exp(-2u)) (`layers.gated_ple`, session 38: XLA then
  # fuses gelu * ple into the ple_proj reduction, -42 launches a bs-1 decode step) against the tanh form (carry
  # .before/layers.py and .before/gemma4.py: `git show <before>:jaxspec/model/{layers,gemma4}.py`), one process a run
  # in GELU_SEQ's order (default "new old new old"), decode bs 1 (paged, E4B, 4K); GELU_LANE=1 (default) first runs
  # the GPU tests of test_model and test_draft_layer (Triton kernels, -n 8; xdist from .whl/)
  if [[ ${GELU_LANE:-1} == 1 ]]; then
    need_xdist
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-240} python3 -m pytest -v -p no:cacheprovider --tb=short \
      -rfE -n ${WORKERS:-8} --dist loadgroup tests/test_model.py tests/test_draft_layer.py > "$OUT/tests-gelu.txt" 2>&1
    grep -E "(passed|failed).* in |^FAILED|^ERROR" "$OUT/tests-gelu.txt" | tail -12; fi
  files="jaxspec/model/layers.py jaxspec/model/gemma4.py"; ab_save $files; i=0
  for v in ${GELU_SEQ:-new old new old}; do i=$((i + 1))
    [ $SECONDS -lt ${GELU_BUDGET:-500} ] || { echo "== time: stopped before run $i"; break; }
    ab_use $v $files; tag=$([[ $v == old ]] && echo old-experiment || echo new)
    timeout ${DECODE_TIMEOUT:-150} python3 -m jaxspec.bench decode --bs 1 --cache paged \
      --json "$OUT/decode-gelu-$tag-run$i.json" > /tmp/gelu-$i.log 2>&1
    cat /tmp/gelu-$i.log >> "$OUT/gelu.log"
    echo "== $v run $i (${SECONDS}s): $(grep -hE '^step of|Error' /tmp/gelu-$i.log | tr '\n' ' ')"; done
  ab_use new $files ;;
s39-rows)  # issue #14: the split attention kernel stores, and its merge reads, only the real query rows' fp32 partials
  # (a bs-1 decode step: 4 of 16 rows), the merge in about one program per SM (`merge_block_d`), against the tree before
  # (carry .before/paged_attention.py and .before/cache.py: `git show <before>:jaxspec/{pallas/paged_attention,
  # paged_kv/cache}.py`). ROWS_LANE=1 (default) first runs the GPU tests of ROWS_TESTS (default test_kernels,
  # test_draft_layer and test_paged; Triton, -n 8; xdist from .whl/); then ROWS_STEPS (default "decode verify": bs 1, E4B, 4K) traced, one
  # process a run, in ROWS_SEQ's order (default "new old new old"): kernels and launches a step from `bench trace`
  for f in paged_attention.py cache.py; do [ -f .before/$f ] || { echo "carry .before/$f"; exit 2; }; done
  if [[ ${ROWS_LANE:-1} == 1 ]]; then
    need_xdist
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider --tb=short \
      -rfE -n ${WORKERS:-8} --dist loadgroup ${ROWS_TESTS:-tests/test_kernels.py tests/test_draft_layer.py \
      tests/test_paged.py} > "$OUT/tests-rows.txt" 2>&1
    grep -E "(passed|failed).* in |^FAILED|^ERROR" "$OUT/tests-rows.txt" | tail -12; fi
  files="jaxspec/pallas/paged_attention.py jaxspec/paged_kv/cache.py"; ab_save $files; i=0
  for v in ${ROWS_SEQ:-new old new old}; do i=$((i + 1))
    [ $SECONDS -lt ${ROWS_BUDGET:-480} ] || { echo "== time: stopped before run $i"; break; }
    ab_use $v $files; tag=$([[ $v == old ]] && echo old-experiment || echo new)
    for step in ${ROWS_STEPS:-decode verify}; do
      args="--bs 1"; [[ $step == decode ]] && args="--bs 1 --cache paged"; rm -rf /tmp/rows-prof
      [[ $step == propose ]] && args="--bs ${ROWS_BS:-1} --ctx 4096 --variants bucketed"
      XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout ${ROWS_TIMEOUT:-150} python3 -m jaxspec.bench \
        $step $args --profile-dir /tmp/rows-prof --json /tmp/rows-$step-$i.json > /tmp/rows-$step-$i.log 2>&1
      timeout 90 python3 -m jaxspec.bench trace /tmp/rows-prof --rounds 20 --top 40 \
        --json "$OUT/trace-$step-rows-$tag-run$i.json" >> /tmp/rows-$step-$i.log 2>&1
      cat /tmp/rows-$step-$i.log >> "$OUT/rows.log"
      echo "== $step $v run $i (${SECONDS}s): $(grep -hE '^(paged|step of|bucketed)|all kernels|Error' /tmp/rows-$step-$i.log \
        | head -4 | tr '\n' ' ')"; done; done
  ab_use new $files ;;
s39-attn)  # issue #14 (next): E4B's attention kernels one by one in chains of 16 layers (bench/diag_splits.py, one
  # process a shape): the global layers' (head_dim 512, 2 kv heads, 4K live keys; 14.2 us for 16.8 MB on the H100 in
  # session 37's trace, ~35% of HBM) and the sliding layers' (256, 640-wide table, 513 live keys), decode (tq 1) and
  # verify (tq 4): the default kernel, only the real rows' partials (--real-rows, session 39), ATTN_TUNINGS knobs
  # (session 40's H100 run: 64-key blocks -10% at 4K live keys, +12% at 1K; the default (bk32w8st1r) against 64-key
  # blocks whose pieces are cut at 32 keys (g32), with and without the real rows (r)), and
  # (global) ATTN_SPLITS_GLOBAL piece counts (the default rule gives 64 at 4K: 128 programs; 32, 128 slower); sliding:
  # ATTN_SPLITS_SLIDING (default 0: the rule's 32) and ATTN_WIDE_SLIDING (the same in 64-key blocks, e.g. 8,16)
  timeout ${ATTN_TIMEOUT:-250} python3 bench/diag_splits.py --head-dim 512 --kv-heads 2 --cases ${ATTN_CASES_GLOBAL:-4096:4096,4096:1024} \
    --tq 1,4 --splits ${ATTN_SPLITS_GLOBAL:-0} --real-rows \
    --tunings ${ATTN_TUNINGS_GLOBAL:-bk32w8st1r,bk64w8st1,bk64w8st1r,bk64w8st1g32,bk64w8st1g32r} \
    --json "$OUT/diag-attn-global.json" > "$OUT/diag-attn.log" 2>&1
  timeout ${ATTN_TIMEOUT:-250} python3 bench/diag_splits.py --head-dim 256 --kv-heads 2 --cases 640:513 --tq 1,4 \
    --splits ${ATTN_SPLITS_SLIDING:-0} --wide-splits "${ATTN_WIDE_SLIDING:-}" --real-rows --tunings ${ATTN_TUNINGS_SLIDING:-bk32w4st2r,bk64w8st2r,bk64w8st2g32r,bk64w4st2g32r} \
    --json "$OUT/diag-attn-sliding.json" >> "$OUT/diag-attn.log" 2>&1
  grep -E '^\{|Error|error:' "$OUT/diag-attn.log" | head -8 ;;
s38-tiling)  # issue #14: XLA's exhaustive GEMM tiling search (`--xla_gpu_exhaustive_tiling_search=true`: the autotuner
  # tries every Triton tiling, not its short list) against the default, one process a run, in TILING_SEQ's order
  # (default "1 0 1 0"; 1: the flag), for each step of TILING_STEPS (default "decode verify": bs 1, E4B, 4K). The MLP's
  # one-row GEMMs run at 78-84% of the HBM rate (session 37: gate/up 37.8 us, 2.8 TB/s on the H100)
  i=0; for v in ${TILING_SEQ:-1 0 1 0}; do i=$((i + 1))
    [ $SECONDS -lt ${TILING_BUDGET:-470} ] || { echo "== time: stopped before run $i"; break; }
    f=""; [[ $v == 1 ]] && f="--xla_gpu_exhaustive_tiling_search=true"
    for step in ${TILING_STEPS:-decode verify}; do
      args="--bs 1"; [[ $step == decode ]] && args="--bs 1 --cache paged"
      XLA_FLAGS="$f" timeout ${TILING_TIMEOUT:-240} python3 -m jaxspec.bench $step $args \
        --json "$OUT/$step-tiling$v-run$i.json" > /tmp/tiling-$step-$i.log 2>&1
      cat /tmp/tiling-$step-$i.log >> "$OUT/tiling.log"
      echo "== $step exhaustive=$v run $i (${SECONDS}s): $(grep -hE '^(paged|step of)|Error' /tmp/tiling-$step-$i.log \
        | tr '\n' ' ')"; done; done ;;
s40-since29)  # issue #14: E4B's bs-1 decode and verify steps (4K) with this tree against session 29's (8320756, the
  # tree of the H200 goal rows until session 40: `git archive 8320756 jaxspec | tar -x -C .before/s29`, carried), one
  # process a run in SINCE_SEQ's order (default "new old new old"): sessions 30-39 were timed on H100s only
  [ -f .before/s29/jaxspec/__init__.py ] || { echo "carry .before/s29/jaxspec"; exit 2; }
  i=0; for v in ${SINCE_SEQ:-new old new old}; do i=$((i + 1))
    [ $SECONDS -lt ${SINCE_BUDGET:-450} ] || { echo "== time: stopped before run $i"; break; }
    pp=$([[ $v == old ]] && echo .before/s29 || echo .)
    for step in ${SINCE_STEPS:-decode verify}; do
      args="--bs 1"; [[ $step == decode ]] && args="--bs 1 --cache paged"
      PYTHONPATH=$pp timeout ${SINCE_TIMEOUT:-200} python3 -P -m jaxspec.bench $step $args \
        --json "$OUT/$step-since29-$v-run$i.json" > /tmp/since-$step-$i.log 2>&1
      cat /tmp/since-$step-$i.log >> "$OUT/since29.log"
      echo "== $step $v run $i (${SECONDS}s, $(PYTHONPATH=$pp python3 -P -c 'import jaxspec; print(jaxspec.__file__)')):" \
        "$(grep -hE '^step of|Error' /tmp/since-$step-$i.log | tr '\n' ' ')"; done; done ;;
s44-one)  # issue #14, session 44's first call: the GPU lane of session 43's long walks (the kernel's bit-equality
  # test, the verify's in-kernel q/k/v step in the long form and in the engine), then on an H200 the goal
  # rows and, time left, s43-attn-ab; on another card s43-attn-ab with the verify rows (bs 1 and 16) in
  # S44_SEQ's order. S44_LIMIT: the call's seconds (default 570). Every file comes back in one archive (all.tgz)
  R=$OUT; mkdir -p "$R/a" "$R/b"; g="$(nvidia-smi --query-gpu=name --format=csv,noheader)"; need_xdist
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-170} python3 -m pytest -v -p no:cacheprovider --tb=short \
    -rfEs -n ${WORKERS:-8} ${S44_TESTS:-tests/test_kernels.py::test_long_walk_knobs_match_reference \
    tests/test_kernels.py::test_walk_knobs_leave_the_bs1_steps_as_tuned \
    tests/test_kernels.py::test_qkv_in_the_attention_kernel_long_walk_matches_reference \
    tests/test_rounds.py::test_verify_steps_norm_and_rotate_in_the_attention_kernel} > "$R/tests-s44.txt" 2>&1
  grep -E "(passed|failed).* in |^FAILED|^ERROR|^SKIPPED" "$R/tests-s44.txt" | tail -12; echo "== tests (${SECONDS}s)"
  case "$g" in
    *H200*) OUT=$R/a PROPOSE_TIMEOUT=150 VERIFY_TIMEOUT=150 DECODE_TIMEOUT=90 goal_rows
            echo "== goal rows (${SECONDS}s)"
            OUT=$R/b AB_SEQ="${S44_SEQ:-new old}" AB_BUDGET=$((${S44_LIMIT:-570} - 150 - SECONDS)) AB_MORE=none \
              bash bench/h200.sh s43-attn-ab ;;
    *) OUT=$R/b AB_SEQ="${S44_SEQ:-new old new old}" AB_BUDGET=$((${S44_LIMIT:-570} - 130 - SECONDS)) VERIFY_TIMEOUT=130 \
         bash bench/h200.sh s43-attn-ab ;;
  esac
  echo "== $g, end (${SECONDS}s)"; (cd "$R" && tar czf all.tgz a b && rm -rf a b); OUT=$R ;;
s44-apart)  # issue #14: JAXSPEC_STEP_KEYS_APART (session 44; on by default since session 46; retired in session 47 with
  # the swapped walk: the A/B below needs commit 51c8dbd's tree, its test step runs on any tree): the in-kernel q/k/v
  # step's walk scores the step's own keys apart from each block's K and adds their values after the walk, so K goes
  # from its loads to the product untouched (the swap into every block made the bs-16 verify's non-shared global layers 226 us
  # a call against 99 for the KV-shared ones, whose kernel is the same walk without it; session 44's call 3). First
  # the GPU tests (Triton, fp32, -n 8), then E4B's steps traced (4K), one process a run, each of APART_STEPS (default
  # "verify-1 verify-16 decode-1") with the switch in APART_SEQ's order (default "1 0 1 0") while APART_BUDGET s allow
  need_xdist
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --tb=short \
    -rfE -n ${WORKERS:-8} tests/test_kernels.py -k "qkv or long_walk or walk_knobs" \
    tests/test_rounds.py::test_verify_steps_norm_and_rotate_in_the_attention_kernel > "$OUT/tests-apart.txt" 2>&1
  tail -2 "$OUT/tests-apart.txt"; i=0
  for step in ${APART_STEPS:-verify-1 verify-16 decode-1}; do
    for v in ${APART_SEQ:-1 0 1 0}; do i=$((i + 1))
      [ $SECONDS -lt ${APART_BUDGET:-480} ] || { echo "== time: stopped before $step run $i"; break 2; }
      t=$step-apart$v-run$i; traced_step $t "JAXSPEC_STEP_KEYS_APART=$v" ${STEP_TIMEOUT:-130} ${step%-*} --bs ${step#*-} \
        $([[ $step == decode* ]] && echo --cache paged)
      echo "== $step apart=$v run $i (${SECONDS}s): $(grep -hE '^step of|all kernels|Error' /tmp/$t.log | tr '\n' ' ')"
    done
  done ;;
s46-vsel)  # issue #14: the V select every walk without step keys apart makes (`where(live, v, 0)`, the NaN guard for
  # dead entries, which read slot 0) taken out, an experiment: the variant is made here from the tree's kernel
  # (/tmp/s46v). Session 46's call 5 timed the kernel alone (`bench kernels --part attention`, wall medians) and saw
  # nothing beyond the spread; this traces E4B's bs-16 verify, one process a run in VSEL_SEQ's order (default "tree
  # novsel tree novsel") while VSEL_BUDGET s allow: the KV-shared layers' kernel (session 44: ~101 us a call at d 512)
  # is the one to read. Not shippable as is: tests/test_paged.py::test_free_pages_poisoned_outputs_unchanged poisons
  # the dummy page too. Session 48: VSEL_ARGS (default "verify --bs 16") and VSEL_TAG (default verify16) time another
  # step
  ab_save jaxspec/pallas/paged_attention.py; mkdir -p /tmp/s46v
  python3 - <<'PY'
s = open("jaxspec/pallas/paged_attention.py").read()
a = "        v = jnp.where(live[:, None], v, jnp.zeros((), v.dtype))  # 0 * NaN would leak through P.V\n"
assert a in s, "the V select moved: update s46-vsel"
open("/tmp/s46v/paged_attention.py", "w").write(s.replace(a, "        if apart:\n    " + a))
PY
  i=0
  for v in ${VSEL_SEQ:-tree novsel tree novsel}; do i=$((i + 1))
    [ $SECONDS -lt ${VSEL_BUDGET:-420} ] || { echo "== time: stopped before run $i"; break; }
    if [ $v = novsel ]; then AB_OLD=/tmp/s46v ab_use old jaxspec/pallas/paged_attention.py; x=-experiment
    else ab_use new jaxspec/pallas/paged_attention.py; x=; fi
    t=${VSEL_TAG:-verify16}-vsel-$v-run$i$x; traced_step $t "" ${VERIFY_TIMEOUT:-150} ${VSEL_ARGS:-verify --bs 16}
    echo "== $v run $i (${SECONDS}s): $(grep -hE '^step of|all kernels|Error' /tmp/$t.log | tr '\n' ' ')"
  done; ab_use new jaxspec/pallas/paged_attention.py ;;
s44-verify16)  # issue #14: E4B's bs-16 verify (4K, 4 positions) traced, the tree's attention kernel against
  # .before/s43/paged_attention.py (carried; before the long walks), one process a run in S44_SEQ's order (default
  # "new old new old"; any other token names a directory .before/<token> holding the kernel file, carried) while
  # S44_BUDGET s allow: session 44's call 1 timed it level (8.031 against 7.910 / 7.981 ms) where the kernel alone
  # at its shape ran 32-39% faster
  ab_save jaxspec/pallas/paged_attention.py; i=0
  for v in ${S44_SEQ:-new old new old}; do i=$((i + 1))
    [ $SECONDS -lt ${S44_BUDGET:-420} ] || { echo "== time: stopped before run $i"; break; }
    case $v in new) ab_use new jaxspec/pallas/paged_attention.py ;;
               old) AB_OLD=.before/s43 ab_use old jaxspec/pallas/paged_attention.py ;;
               *) AB_OLD=.before/$v ab_use old jaxspec/pallas/paged_attention.py ;; esac
    t=verify16-$v-run$i; traced_step $t "" ${VERIFY_TIMEOUT:-150} verify --bs 16
    cp /tmp/$t.log "$OUT/$t.log"
    echo "== $v run $i (${SECONDS}s): $(grep -hE '^step of|all kernels|^trace|Error' /tmp/$t.log | tr '\n' ' ')"
  done; ab_use new jaxspec/pallas/paged_attention.py ;;
s43-attn-ab)  # issue #14: the tree's attention kernel against .before/s43/paged_attention.py (carried: the kernel
  # before session 43's long walks, 8 warps at head_dim 256 and 512 and 1 stage at 512 in every call; session 43's
  # call 5 ran it with 4 warps and 2 stages in every call, the tree now takes them in long walks only, `walk_knobs`),
  # each program in its own process in AB_SEQ's order (default "new old new old"), as long as AB_BUDGET s allow: the
  # bs-64 propose (the goal row's command), then AB_MORE's rows (default the verify goal rows, bs 1 and 16)
  ab_save jaxspec/pallas/paged_attention.py; i=0
  for v in ${AB_SEQ-new old new old}; do i=$((i + 1))
    [ $SECONDS -lt ${AB_BUDGET:-200} ] || { echo "== time: stopped before run $i"; break; }
    AB_OLD=.before/s43 ab_use $v jaxspec/pallas/paged_attention.py
    timeout ${PROPOSE_TIMEOUT:-120} python3 -m jaxspec.bench propose --bs 64 --ctx 4096 --variants bucketed \
      --json "$OUT/propose-attn-$v-run$i.json" > /tmp/ab.log 2>&1
    echo "== $v run $i (${SECONDS}s): $(grep -h '^propose ctx\|Error' /tmp/ab.log | tr '\n' ' ')"
    [ "${AB_MORE-verify}" = verify ] && [ $SECONDS -lt ${AB_BUDGET:-200} ] && { timeout ${VERIFY_TIMEOUT:-120} python3 -m \
      jaxspec.bench verify --bs 1,16 --json "$OUT/verify-attn-$v-run$i.json" > /tmp/ab.log 2>&1
      echo "== $v run $i verify (${SECONDS}s): $(grep -h '^verify\|^step\|Error' /tmp/ab.log | tr '\n' ' ')"; }
  done; ab_use new jaxspec/pallas/paged_attention.py ;;
s43-bs64)  # issue #14: the bs-64 propose, the goal row missed by a few percent (session 40's H200: 3 463 us against
  # <= 3 276), never traced. First the attention kernel alone at the drafter's batch, its K/V bytes against the HBM
  # bound (8 q / 2 kv heads), with other knobs beside the default (`bench kernels --knobs`): the global layer's 4K
  # keys (at bs 1 too), then a sliding layer's 512; then the propose (E4B drafter, k 3, 4K, the default program as
  # the goal row runs it, fresh host inputs a call) traced with XLA's optimized HLO beside it, every kernel named
  timeout ${KERNELS_TIMEOUT:-150} python3 -m jaxspec.bench kernels --part attention --bs ${KNOBS_BS:-1,64} --ctx 4096 --head-dim 512 \
    --tq 1 --iters 20 --knobs ${KNOBS_GLOBAL:-bk32w8st2,bk32w8st2s4,bk32w4st2,bk32w4st2s4,bk16w4st2,bk16w4st2s4,bk32w8st1s4,bk64w8st2,bk16w8st3s4} \
    --json "$OUT/kernels-attention-bs64-global.json" > "$OUT/kernels-attention-bs64.log" 2>&1
  timeout ${KERNELS_TIMEOUT:-150} python3 -m jaxspec.bench kernels --part attention --bs 64 --ctx 512 --head-dim 256 \
    --tq 1 --iters 20 --knobs ${KNOBS_SLIDING:-bk64w4st2s4,bk32w4st2,bk32w4st2s4,bk64w8st2s2,bk32w8st3} \
    --json "$OUT/kernels-attention-bs64-sliding.json" >> "$OUT/kernels-attention-bs64.log" 2>&1
  grep -E "^attention|Error|error" "$OUT/kernels-attention-bs64.log" | head -8
  named_propose propose-bs64-hlo 64 bucketed ${PROPOSE_TIMEOUT:-200} ;;
s42-one)  # issue #14, session 42's one call: on an H200 the verify change's kernel tests and one A/B pair
  # (s42-verify-attn, VERIFY_SEQ "1 0"), then the goal rows if time is left; on another card s42-verify-attn in full
  # (its tests, "1 0 1 0"). S42_LIMIT: the seconds the call may take (default 580). Every file comes back in one
  # archive (all.tgz)
  R=$OUT; mkdir -p "$R/a" "$R/b"; g="$(nvidia-smi --query-gpu=name --format=csv,noheader)"
  kt="tests/test_kernels.py::test_qkv_in_the_attention_kernel_matches_reference
      tests/test_kernels.py::test_shared_q_norm_rope_in_the_kernel_matches_reference"
  et="tests/test_rounds.py::test_verify_steps_norm_and_rotate_in_the_attention_kernel
      tests/test_rounds.py::test_one_position_steps_norm_and_rotate_in_the_attention_kernel"
  case "$g" in
    *H200*) OUT=$R/a TEST_TIMEOUT=100 VERIFY_SEQ="1 0" VERIFY_TIMEOUT=100 VERIFY_BUDGET=200 VERIFY_TESTS="$kt" \
              bash bench/h200.sh s42-verify-attn
            echo "== A/B done (${SECONDS}s)"
            if [ $SECONDS -lt $((${S42_LIMIT:-580} - 250)) ]; then OUT=$R/b PROPOSE_TIMEOUT=150 VERIFY_TIMEOUT=120 DECODE_TIMEOUT=80 \
              bash bench/h200.sh goal-rows; fi ;;
    *) OUT=$R/a TEST_TIMEOUT=150 VERIFY_TIMEOUT=110 VERIFY_BUDGET=$((${S42_LIMIT:-580} - 200)) VERIFY_TESTS="$kt $et" \
         bash bench/h200.sh s42-verify-attn ;;
  esac
  echo "== $g, end (${SECONDS}s)"; (cd "$R" && tar czf all.tgz a b && rm -rf a b); OUT=$R ;;
s42-verify-attn)  # issue #14: a verify step's q/k/v norms, RoPE and K/V write (non-shared layers) and q norm and RoPE
  # (KV-shared layers) inside the attention kernels (JAXSPEC_VERIFY_IN_ATTENTION, session 42) against XLA's fusions and
  # scatters. VERIFY_LANE=1 (default) first runs the GPU tests (Triton, fp32, -n 8: the kernels' multi-position
  # cases, the engine against transformers' greedy with the switch on and off, test_paged); then E4B verify (4K,
  # 4 positions) at VERIFY_BS (default 1) traced, one process a run, in VERIFY_SEQ's order (default "1 0 1 0")
  if [[ ${VERIFY_LANE:-1} == 1 ]]; then
    need_xdist
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider --tb=short \
      -rfE -n ${WORKERS:-8} ${VERIFY_TESTS:-tests/test_kernels.py::test_qkv_in_the_attention_kernel_matches_reference \
      tests/test_kernels.py::test_shared_q_norm_rope_in_the_kernel_matches_reference \
      tests/test_rounds.py::test_verify_steps_norm_and_rotate_in_the_attention_kernel tests/test_paged.py} \
      > "$OUT/tests-verify-attn.txt" 2>&1
    grep -E "(passed|failed).* in |^FAILED|^ERROR" "$OUT/tests-verify-attn.txt" | tail -12; fi
  i=0; for v in ${VERIFY_SEQ-1 0 1 0}; do i=$((i + 1))
    [ $SECONDS -lt ${VERIFY_BUDGET:-480} ] || { echo "== time: stopped before run $i"; break; }
    t=verify-attn-$v-run$i; traced_step $t "JAXSPEC_VERIFY_IN_ATTENTION=$v" ${VERIFY_TIMEOUT:-150} verify --bs ${VERIFY_BS:-1}
    cat /tmp/$t.log >> "$OUT/verify-attn.log"
    echo "== VERIFY_IN_ATTENTION=$v run $i (${SECONDS}s): $(grep -hE '^step of|^trace|Error' /tmp/$t.log | tr '\n' ' ')"
  done ;;
s41-qkv-attn)  # issue #14: a non-shared layer's q/k/v norms, RoPE and K/V write inside its attention kernel
  # (JAXSPEC_QKV_IN_ATTENTION, session 41: 24 launches fewer an E4B decode step; on by default since its H100 runs,
  # kernels -0.9% a step) and session 40's
  # KV-shared q in the kernel (JAXSPEC_SHARED_Q_IN_ATTENTION, on by default) against neither. QKV_LANE=1 (default)
  # first runs their GPU tests (Triton, fp32, -n 8); then decode bs 1 (paged, 4K) traced, one process a run, in
  # QKV_SEQ's order (default "qkv shared base qkv shared base": both on / the default / both off)
  if [[ ${QKV_LANE:-1} == 1 ]]; then
    need_xdist
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-170} python3 -m pytest -v -p no:cacheprovider --tb=short \
      -rfE -n ${WORKERS:-8} ${QKV_TESTS:-tests/test_kernels.py::test_qkv_in_the_attention_kernel_matches_reference \
      tests/test_kernels.py::test_shared_q_norm_rope_in_the_kernel_matches_reference \
      tests/test_rounds.py::test_one_position_steps_norm_and_rotate_in_the_attention_kernel tests/test_paged.py} > "$OUT/tests-qkv-attn.txt" 2>&1
    grep -E "(passed|failed).* in |^FAILED|^ERROR" "$OUT/tests-qkv-attn.txt" | tail -12; fi
  i=0; for v in ${QKV_SEQ:-qkv shared base qkv shared base}; do i=$((i + 1))
    [ $SECONDS -lt ${QKV_BUDGET:-480} ] || { echo "== time: stopped before run $i"; break; }
    case $v in qkv) sq=1; qa=1 ;; shared) sq=1; qa=0 ;; *) sq=0; qa=0 ;; esac
    t=decode-qkv-attn-$v-run$i
    traced_step $t "JAXSPEC_SHARED_Q_IN_ATTENTION=$sq JAXSPEC_QKV_IN_ATTENTION=$qa" ${QKV_TIMEOUT:-150} decode --bs 1 \
      --cache paged
    cat /tmp/$t.log >> "$OUT/qkv-attn.log"
    echo "== $v run $i (${SECONDS}s): $(grep -hE '^step of|^trace|Error' /tmp/$t.log | tr '\n' ' ')"
  done ;;
s40-shared-q)  # issue #14: a KV-shared layer's q norm and RoPE inside its attention kernel (session 40: 18 launches
  # fewer an E4B decode step) against `q_rope` then the attention (JAXSPEC_SHARED_Q_IN_ATTENTION=0). SHARED_LANE=1
  # (default) first runs its GPU tests (Triton, fp32, -n 8: the kernel's, test_rounds' engine cases, test_paged); then
  # decode bs 1 (paged, 4K) traced, one process a run, in SHARED_SEQ's order (default "1 0 1 0": the switch)
  if [[ ${SHARED_LANE:-1} == 1 ]]; then
    need_xdist
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider --tb=short \
      -rfE -n ${WORKERS:-8} --dist loadgroup ${SHARED_TESTS:-tests/test_kernels.py::test_shared_q_norm_rope_in_the_kernel_matches_reference \
      tests/test_rounds.py::test_one_position_steps_norm_and_rotate_in_the_attention_kernel \
      tests/test_paged.py} > "$OUT/tests-shared-q.txt" 2>&1
    grep -E "(passed|failed).* in |^FAILED|^ERROR" "$OUT/tests-shared-q.txt" | tail -12; fi
  i=0; for v in ${SHARED_SEQ:-1 0 1 0}; do i=$((i + 1))
    [ $SECONDS -lt ${SHARED_BUDGET:-480} ] || { echo "== time: stopped before run $i"; break; }
    t=decode-shared-q$v-run$i
    traced_step $t "JAXSPEC_SHARED_Q_IN_ATTENTION=$v" ${SHARED_TIMEOUT:-150} decode --bs 1 --cache paged
    cat /tmp/$t.log >> "$OUT/shared-q.log"
    echo "== switch $v run $i (${SECONDS}s): $(grep -hE '^step of|all kernels|Error' /tmp/$t.log | tr '\n' ' ')"
  done ;;
goal-rows)  # issue #14: every goal row of the target's and the drafter's steps in one call (goal_rows)
  goal_rows ;;
s26-goals)  # issue #14: goal-rows after warm compiles (its three programs compiled side by side into the persistent
  # cache), so the timed processes run one at a time in well under a call
  export WARM_MEM=${WARM_MEM:-.3}  # three side by side (session 26 ran them unbounded, without running out)
  warm goals-propose propose --bs 1,64 --ctx 4096 --variants bucketed & warm goals-verify verify --bs 1,16 &
  warm goals-decode decode --bs 1 --cache paged & wait
  goal_rows ;;
s27-first)  # issue #14 (next, one call): the layer products kernel's GPU lane alone (session 26 ran it beside six
  # compiles that ran the GPU out of memory; four cases failed, cause not seen), then the bs-64 propose (0.5% from its
  # goal, never traced) traced with every kernel listed
  TEST_TIMEOUT=${TEST_TIMEOUT:-240} lp_lane
  traced_propose bs64-experiment 64 bucketed ${PROPOSE_TIMEOUT:-220} 80 ;;
s35-pinned-default)  # issue #14: the pinned input as shipped (on by default on a GPU, session 35): the GPU lane of the
  # drafter and staging files and the propose bench's test, then the goal rows' propose (bs 1 and 64, as goal-rows
  # runs it) twice, one process each
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_staging.py \
    tests/test_drafter.py tests/test_bench.py -k "not test_bench or test_propose" > "$OUT/tests-pinned-default.txt" 2>&1
  grep -E "passed|failed|^FAILED" "$OUT/tests-pinned-default.txt" | tail -8
  for run in 1 2; do [ $SECONDS -lt ${PINNED_BUDGET:-450} ] || break
    timeout ${PROPOSE_TIMEOUT:-200} python3 -m jaxspec.bench propose --bs 1,64 --ctx 4096 --variants bucketed \
      --json "$OUT/propose-pinned-default-run$run.json" >> "$OUT/propose-pinned-default.log" 2>&1
    echo "== run $run: $(grep -h '^propose ctx\|Error' "$OUT/propose-pinned-default.log" | tail -2 | tr '\n' ' ')"; done; true ;;
s35-pinned-ab)  # issue #14: the pinned input against the default in one process (`bench propose --variants
  # bucketed,pinned`, then the other order, and so on: PINNED_ORDERS runs, default 4), the bs-1 and bs-64 propose
  run=0
  for order in ${PINNED_ORDERS:-bucketed,pinned pinned,bucketed bucketed,pinned pinned,bucketed}; do run=$((run + 1))
    [ $SECONDS -lt ${PINNED_BUDGET:-450} ] || { echo "== time: stopped before run $run"; break; }
    timeout ${PROPOSE_TIMEOUT:-200} python3 -m jaxspec.bench propose --bs 1,64 --ctx 4096 --variants $order \
      --json "$OUT/propose-pinned-ab-run$run.json" > /tmp/propose-ab-run$run.log 2>&1
    cat /tmp/propose-ab-run$run.log >> "$OUT/propose-pinned-ab.log"
    echo "== $order: $(grep -h '^propose ctx\|Error' /tmp/propose-ab-run$run.log | tr '\n' ' ')"
  done; true ;;
s35-pinned)  # issue #14: the propose's host input through persistent pinned host arrays (JAXSPEC_PINNED_INPUTS,
  # `staging.PinnedRing`, session 35): bench/diag_dispatch.py (its pinned_reused row against goal and preput_same, and
  # the drafts through the ring against the default program's), the ring's tests on the GPU, then the bs-1 and bs-64
  # propose with the switch 0 and 1, alternating, one process each, as long as the call's time allows (PINNED_BUDGET s).
  # DIAG=0 skips the diagnosis; PINNED_SEQ (default "0 1 0 1"), PINNED_BS (default 1,64); the device returns 8 files
  [ "${DIAG:-1}" = 1 ] && timeout ${DIAG_TIMEOUT:-150} python3 bench/diag_dispatch.py --iters 200 \
    --json "$OUT/diag-dispatch-pinned.json" > /tmp/diag-dispatch-pinned.log 2>&1  # (the rows are in the JSON)
  [ "${DIAG:-1}" = 1 ] && grep -E "^(goal|exe_numpy|preput_same|put_only|pinned_|trivial)|equal|Error|error" /tmp/diag-dispatch-pinned.log | head -16
  timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_staging.py \
    -k "pinned or ring" > /tmp/tests-pinned.txt 2>&1; grep -E "passed|failed|^FAILED|^E  " /tmp/tests-pinned.txt | tail -8
  run=0
  for v in ${PINNED_SEQ:-0 1 0 1}; do run=$((run + 1))
    [ $SECONDS -lt ${PINNED_BUDGET:-420} ] || { echo "== time: stopped before run $run"; break; }
    JAXSPEC_PINNED_INPUTS=$v timeout ${PROPOSE_TIMEOUT:-200} python3 -m jaxspec.bench propose --bs ${PINNED_BS:-1,64} \
      --ctx 4096 --variants bucketed --json "$OUT/propose-pinned$v-run$run.json" > /tmp/propose-pinned-run$run.log 2>&1
    cat /tmp/propose-pinned-run$run.log >> "$OUT/propose-pinned.log"
    echo "== JAXSPEC_PINNED_INPUTS=$v run $run: $(grep -h '^propose ctx\|Error' /tmp/propose-pinned-run$run.log | tr '\n' ' ')"
  done; true ;;
s34-one-row)  # issue #14 (next): one-row bf16 products with fp32 terms on the GPU (`layers.one_row_product`, session 34)
  # against the tree before (.before/layers.py, carried: `git show a118926:jaxspec/model/layers.py`). ONE_ROW_STEPS, any
  # of "decode checks e2e" ("decode checks" by default): decode bs 1 (paged, 4K) new, before, new, before, one process
  # each; the GPU checks (the diag, the one-row tests); the bs-1 spec = plain fraction (`same_as_plain`, E4B random
  # pair, 16 prompts of 1K, 64 new tokens, k 4) new then before (~4-5 min: a call of its own)
  [ -f .before/layers.py ] || { echo "carry .before/layers.py"; exit 2; }
  steps=" ${ONE_ROW_STEPS:-decode checks} "; cp jaxspec/model/layers.py /tmp/layers-new.py
  use() { if [ "$1" = new ]; then cp /tmp/layers-new.py jaxspec/model/layers.py; else cp .before/layers.py jaxspec/model/layers.py; fi; }
  tail_of() { [ "$1" = before ] && echo -experiment; }
  [[ $steps == *" decode "* ]] && for tag in new before new before; do use $tag
    timeout ${DECODE_TIMEOUT:-120} python3 -m jaxspec.bench decode --bs 1 --cache paged \
      --json "$OUT/decode-one-row-$tag$(tail_of $tag).json" >> "$OUT/one-row.log" 2>&1
    echo "== $tag: $(grep -h '^step of\|Error' "$OUT/one-row.log" | tail -1)"; done
  use new
  [[ $steps == *" checks "* ]] && { timeout 90 python3 bench/diag_one_row_products.py 2>&1 | grep '^rows'
    timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_model.py \
      tests/test_layer_products.py -k "one_row or 1x640" > "$OUT/tests-one-row.txt" 2>&1
    grep -E "passed|failed|^FAILED" "$OUT/tests-one-row.txt" | tail -6; }
  [[ $steps == *" e2e "* ]] && for tag in new before; do use $tag
    timeout ${E2E_TIMEOUT:-280} python3 -m jaxspec.bench e2e --bs 1 --requests 16 --prompt-len 1024 --new-tokens 64 \
      --modes off,bucketed -k 4 --json "$OUT/e2e-one-row-$tag$(tail_of $tag).json" > "$OUT/e2e-one-row-$tag.log" 2>&1
    echo "== $tag: $(grep -h -A3 '^bs ' "$OUT/e2e-one-row-$tag.log" | tr '\n' ' ')"; done
  use new; true ;;
s48-barrier)  # issue #14 (next step's question): a grid-wide barrier inside one Mosaic GPU kernel (GMEM semaphore,
  # every block resident) against an XLA kernel boundary, µs a round (bench/diag_grid_barrier.py; checked against numpy)
  for g in ${BARRIER_BLOCKS:-132 32}; do
    timeout ${BARRIER_TIMEOUT:-150} python3 bench/diag_grid_barrier.py --blocks $g --json "$OUT/barrier-$g.json" \
      > "$OUT/barrier-$g.log" 2>&1; echo "== $g blocks (rc $?): $(grep -E '^rounds|^per round|Error' "$OUT/barrier-$g.log" \
      | tr '\n' ' ')"; done ;;
s48-autotune)  # issue #14: why the lane is compile-bound (session 47): one test's compiles timed as is and with
  # XLA's GEMM autotuning off (`--xla_gpu_autotune_level=0`), each in a fresh process with no compile cache, the sum
  # of JAX_LOG_COMPILES' "Finished XLA compilation" times and the wall; then lane PART ($PART, default 3) in the time
  # left (s34-lane: autotuning off unless LANE_XLA_FLAGS says otherwise)
  t=${AT_TEST:-tests/test_paged.py::test_requests_cannot_read_each_other}
  for v in tuned untuned; do
    fl=$([[ $v == untuned ]] && echo --xla_gpu_autotune_level=0 || echo "")
    s=$SECONDS; XLA_FLAGS="$fl" JAX_LOG_COMPILES=1 timeout ${AT_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider \
      --tb=short -rf -o log_cli=true --log-cli-level=WARNING "$t" > "$OUT/autotune-$v.txt" 2>&1
    echo "== $v: wall $((SECONDS - s)) s, $(grep -E '(passed|failed).* in ' "$OUT/autotune-$v.txt" | tail -1);" \
      "compiles $(grep -c 'Finished XLA compilation' "$OUT/autotune-$v.txt"), their sum" \
      "$(grep -oE 'Finished XLA compilation of .* in [0-9.e-]+ sec' "$OUT/autotune-$v.txt" \
        | awk '{s += $(NF-1)} END {printf "%.1f s", s}')"; done
  PART=${PART:-3} TEST_TIMEOUT=$(( ${CALL_BUDGET:-575} - SECONDS )) bash "$0" s34-lane ;;
s34-lane)  # issue #14: the whole GPU lane of the current tree in four calls (PART 1: the kernels and model files; 2:
  # test_rounds and test_engine; 3: the paged cache and the drafter; 4: the layer kernels, staging and the pool),
  # pytest-xdist workers sharing the GPU (memory not preallocated; xdist carried in .whl/ when the machine lacks it),
  # every test's outcome listed (-v). Session 47: the part is bound by the compiles' ptxas on the 16 cores (load 75
  # with 8 workers, the GPU idle), so session 46's one part 1 (266 tests) did half in 540 s; parts 3 and 4 were in it.
  # Session 48 (s48-autotune): XLA's GEMM autotuning was most of those compiles (one test's 21.4 s of compiles, 9.3 s
  # without), so the lane runs with it off (LANE_XLA_FLAGS, default --xla_gpu_autotune_level=0; set it empty for the
  # tuned GEMMs): what the tests check does not depend on XLA's GEMM tilings, and the Pallas kernels have fixed ones.
  # The four parts took 98, 474, 200 and 33 s on an H100 so
  need_xdist; export XLA_FLAGS="${LANE_XLA_FLAGS---xla_gpu_autotune_level=0}"
  case ${PART:-1} in
    1) files="tests/test_kernels.py tests/test_model.py" ;;
    3) files="tests/test_paged.py tests/test_drafter.py" ;;
    4) files="tests/test_draft_layer.py tests/test_qkv_cache.py tests/test_row_norms.py tests/test_staging.py
        tests/test_pool.py" ;;
    *) files="tests/test_rounds.py tests/test_engine.py" ;;
  esac
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-560} python3 -m pytest -v -p no:cacheprovider --tb=short \
    -rfE -n ${WORKERS:-8} --dist loadgroup $files > "$OUT/tests-s34-part${PART:-1}.txt" 2>&1
  grep -E "(passed|failed).* in |^FAILED|^ERROR" "$OUT/tests-s34-part${PART:-1}.txt" | tail -20
  echo "outcomes: $(grep -cE ' PASSED ' "$OUT/tests-s34-part${PART:-1}.txt") passed, $(grep -cE ' FAILED ' \
    "$OUT/tests-s34-part${PART:-1}.txt") failed, $(grep -cE ' SKIPPED ' "$OUT/tests-s34-part${PART:-1}.txt") skipped" ;;
s32)  # issue #14, session 32 in one call: S32_STEPS any of "lane decode verify" (all by default). lane: the GPU tests of
  # the q/k/v default (session 31) and of the o/down partials summed in the norms kernel (JAXSPEC_SPLIT_PRODUCTS=1);
  # decode: bs 1 and 16 (paged) as shipped, with SPLIT 1, with QKV 0, S32_REPEATS (2) times in that order, one process each (the
  # repeats load their programs from the compile cache); verify: bs 1 and 16 with SPLIT 0, 1, 0, 1. The JSONs come
  # back in one archive (the device returns 8 files a call)
  steps=" ${S32_STEPS:-lane decode verify} "; mkdir -p "$OUT/s32"
  [[ $steps == *" lane "* ]] && { timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
      tests/test_row_norms.py tests/test_qkv_cache.py "tests/test_model.py::test_split_linear_equals_linear" \
      tests/test_rounds.py -k "norm or qkv or split" > "$OUT/tests-s32.txt" 2>&1
    grep -E "passed|failed|^FAILED" "$OUT/tests-s32.txt" | tail -8; }
  if [[ $steps == *" decode "* ]]; then i=0; for r in $(seq ${S32_REPEATS:-2}); do for e in default SPLIT1 QKV0; do i=$((i + 1))
    tag=$([[ $e == default ]] && echo default || echo "${e,,}-experiment")
    ( unset JAXSPEC_QKV_KERNEL JAXSPEC_SPLIT_PRODUCTS
      [[ $e == SPLIT1 ]] && export JAXSPEC_SPLIT_PRODUCTS=1; [[ $e == QKV0 ]] && export JAXSPEC_QKV_KERNEL=0
      timeout ${DECODE_TIMEOUT:-110} python3 -m jaxspec.bench decode --bs 1,16 --cache paged \
        --json "$OUT/s32/decode-run$i-$tag.json" >> "$OUT/s32-decode.log" 2>&1 )
    echo "== decode $e: $(grep -h '^paged\|Error' "$OUT/s32-decode.log" | tail -2 | tr '\n' ' ')"; done; done; fi
  if [[ $steps == *" verify "* ]]; then i=0; for v in 0 1 0 1; do i=$((i + 1))
    tag=$([[ $v == 0 ]] && echo default || echo split1-experiment)
    JAXSPEC_SPLIT_PRODUCTS=$v timeout ${VERIFY_TIMEOUT:-130} python3 -m jaxspec.bench verify --bs 1,16 \
      --json "$OUT/s32/verify-run$i-$tag.json" >> "$OUT/s32-verify.log" 2>&1
    echo "== verify SPLIT $v: $(grep -h '^step of\|Error' "$OUT/s32-verify.log" | tail -2 | tr '\n' ' ')"; done; fi
  tar czf "$OUT/s32.tgz" -C "$OUT" s32 && rm -rf "$OUT/s32"; true ;;
s31-qkv-default)  # issue #14: the q/k/v kernel on by default in one-position steps (plain decoding; session 31: decode bs 1
  # -2.7% on the H100 in six runs side by side, verify bs 1 +3.6%): its GPU lane (test_rounds' q/k/v tests, fp32
  # against transformers), then decode bs 1 and 16 with the switch unset (the default) and 0, twice, one process each
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_rounds.py \
    tests/test_qkv_cache.py -k "qkv" > "$OUT/tests-qkv-default.txt" 2>&1
  grep -E "passed|failed|^FAILED" "$OUT/tests-qkv-default.txt" | tail -6
  i=0; for v in unset 0 unset 0; do i=$((i + 1)); tag=$([[ $v == unset ]] && echo default || echo qkv0-experiment)
    ( [[ $v == unset ]] && unset JAXSPEC_QKV_KERNEL || export JAXSPEC_QKV_KERNEL=$v
      timeout ${DECODE_TIMEOUT:-100} python3 -m jaxspec.bench decode --bs 1,16 --cache paged \
        --json "$OUT/decode-run$i-$tag.json" >> "$OUT/decode-qkv-default.log" 2>&1 )
    echo "== QKV $v: $(grep -h '^paged\|Error' "$OUT/decode-qkv-default.log" | tail -2 | tr '\n' ' ')"; done ;;
s30-nodes)  # issue #14 (next): the graph's nodes a call from a trace of the shipped programs (session 30: `bench propose
  # / verify / decode --profile-dir` put the trace's kernels, copies and kernel us a call in the traced row; goal
  # propose_e4b_bs1_4k_graph_kernels <= 50; compiled for the H200 on the CPU: propose bs 1 115, verify 786, decode 774)
  for g in "propose --bs 1 --ctx 4096 --variants bucketed" "verify --bs 1" "decode --bs 1 --cache paged"; do
    XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout ${NODES_TIMEOUT:-150} python3 -m jaxspec.bench \
      $g --profile-dir "/tmp/nodes-${g%% *}" --json "$OUT/${g%% *}-bs1-traced.json" >> "$OUT/nodes.log" 2>&1
    echo "== ${g%% *}: $(grep -h '^trace:\|^step of\|^propose ctx\|Error' "$OUT/nodes.log" | tail -2 | tr '\n' ' ')"; done ;;
s30-tfrt)  # issue #14 (next): PJRT's newer GPU client (XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1, read by this jaxlib;
  # session 29: with the stream-executor client a bs-1 propose's 1-KB host input costs ~230 us and the graph's launch
  # ~170 us before its first kernel). TFRT_STEPS, any of "diag goals lane" (all by default): diag runs
  # bench/diag_dispatch.py with the client 0 then 1; goals the propose (bs 1, 64), verify (bs 1) and decode (bs 1)
  # goal rows with 1, 0, 1 (-experiment files: not the shipped client); lane the staging and drafter tests with it
  steps=" ${TFRT_STEPS:-diag goals lane} "
  [[ $steps == *" diag "* ]] && for v in 0 1; do XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=$v timeout ${DISPATCH_TIMEOUT:-150} \
      python3 bench/diag_dispatch.py --json "$OUT/diag-dispatch-tfrt$v-experiment.json" > "$OUT/diag-tfrt$v.log" 2>&1
    echo "== client $v"; head -13 "$OUT/diag-tfrt$v.log"; done
  i=0; [[ $steps == *" goals "* ]] && for v in 1 0 1; do i=$((i + 1))
    for g in "propose --bs 1,64 --ctx 4096 --variants bucketed" "verify --bs 1" "decode --bs 1 --cache paged"; do
      XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=$v timeout ${GOAL_TIMEOUT:-150} python3 -m jaxspec.bench $g \
        --json "$OUT/${g%% *}-tfrt$v-run$i-experiment.json" >> "$OUT/goals-tfrt.log" 2>&1
      echo "== client $v: $(grep -h '^step of\|^propose ctx\|Error' "$OUT/goals-tfrt.log" | tail -2 | tr '\n' ' ')"; done; done
  [[ $steps == *" lane "* ]] && { XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q \
    -p no:cacheprovider --tb=short -rf tests/test_staging.py tests/test_drafter.py > "$OUT/tests-tfrt.txt" 2>&1
    grep -E "passed|failed|^FAILED" "$OUT/tests-tfrt.txt" | tail -6; }; true ;;
s30-e2e)  # issues #13/#14 (next): the engine end to end with session 28-29's defaults (staged inputs, the norms kernel)
  # against JAXSPEC_FUSED_NORMS=0: E4B random, bs 1, 1K prompt, plain and k 3 (the e2e goal rows of #13 come from
  # older files); E2E_NORMS picks the values, one process each (~4-5 minutes cold: one value a call)
  for v in ${E2E_NORMS:-1 0}; do JAXSPEC_FUSED_NORMS=$v timeout ${E2E_TIMEOUT:-290} python3 -m jaxspec.bench e2e \
      --preset E4B --bs 1 --prompt-len 1024 --new-tokens 128 --modes off,bucketed -k 3 \
      --json "$OUT/e2e-e4b-1k-norms$v.json" > "$OUT/e2e-e4b-1k-norms$v.log" 2>&1
    echo "== JAXSPEC_FUSED_NORMS=$v"; grep "^e2e bs\|Error" "$OUT/e2e-e4b-1k-norms$v.log" | head -4; done ;;
s30-qkv-lane)  # issue #14 (next): the q/k/v kernel's tests on the GPU again, with session 29's bf16 tolerance (one ulp
  # at the largest compared magnitude: a rotation's cancelling terms), then decode bs 1 with (QKV, NORMS) 11, 01, 11
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_qkv_cache.py \
    > "$OUT/tests-qkv.txt" 2>&1; grep -E "passed|failed|^FAILED" "$OUT/tests-qkv.txt" | tail -6
  LAYER_STEPS=decode LAYER_DECODE="11 01 11" bash "$0" s29-layer ;;
s29-layer)  # issue #14 (session 29): session 24's layer kernels, built and CPU-tested, never timed: the q/k/v kernel
  # (JAXSPEC_QKV_KERNEL: bench graph, decode bs 1 983 -> 867 launches, verify 783 -> 732) and the residual norms kernel
  # (JAXSPEC_FUSED_NORMS: decode 983 -> 773; both 657). LAYER_STEPS, any of "warm lane decode verify" (all by default;
  # chain the calls on one warm machine with JAX_COMPILATION_CACHE_DIR set alike): warm compiles the six programs
  # three at a time (E4B takes ~20 GB a process: three fit an 80-GB card), lane runs their GPU tests (Triton), decode
  # times decode bs 1 (paged) with (QKV, NORMS) = 00 11 10 01 00, verify times verify bs 1 with QKV 0 1 0, each in its
  # own process (-experiment files)
  steps=" ${LAYER_STEPS:-warm lane decode verify} "
  [[ $steps == *" warm "* ]] && { export WARM_MEM=${WARM_MEM:-.3}
    JAXSPEC_QKV_KERNEL=0 JAXSPEC_FUSED_NORMS=0 warm decode00 decode --bs 1 --cache paged &
    JAXSPEC_QKV_KERNEL=1 JAXSPEC_FUSED_NORMS=1 warm decode11 decode --bs 1 --cache paged &
    JAXSPEC_QKV_KERNEL=0 warm verify0 verify --bs 1 & wait
    JAXSPEC_QKV_KERNEL=1 JAXSPEC_FUSED_NORMS=0 warm decode10 decode --bs 1 --cache paged &
    JAXSPEC_QKV_KERNEL=0 JAXSPEC_FUSED_NORMS=1 warm decode01 decode --bs 1 --cache paged &
    JAXSPEC_QKV_KERNEL=1 warm verify1 verify --bs 1 &
    [[ $steps == *" lane "* ]] && { XLA_PYTHON_CLIENT_MEM_FRACTION=.08 timeout ${TEST_TIMEOUT:-300} python3 -m pytest \
      -q -p no:cacheprovider --tb=short -rf tests/test_qkv_cache.py tests/test_row_norms.py tests/test_rounds.py \
      -k "qkv or layer_kernels or norms" > "$OUT/tests-layer.txt" 2>&1; grep -E "passed|failed|^FAILED" \
      "$OUT/tests-layer.txt" | tail -8; } & wait
    grep -h "Error\|error:" "$OUT"/warm-*.log | head -5; ls "$JAX_COMPILATION_CACHE_DIR" | wc -l; }
  i=0; [[ $steps == *" decode "* ]] && for v in ${LAYER_DECODE:-00 11 10 01 00}; do i=$((i + 1))
    JAXSPEC_QKV_KERNEL=${v:0:1} JAXSPEC_FUSED_NORMS=${v:1:1} timeout ${DECODE_TIMEOUT:-100} python3 -m jaxspec.bench \
      decode --bs 1 --cache paged --json "$OUT/decode-layer-$v-run$i-experiment.json" >> "$OUT/decode-layer.log" 2>&1
    echo "== QKV, NORMS = $v: $(grep -h '^step of\|Error' "$OUT/decode-layer.log" | tail -1)"; done
  [[ $steps == *" verify "* ]] && for v in ${LAYER_VERIFY:-0 1 0}; do i=$((i + 1))
    JAXSPEC_QKV_KERNEL=$v timeout ${VERIFY_TIMEOUT:-100} python3 -m jaxspec.bench verify --bs 1 \
      --json "$OUT/verify-layer-qkv$v-run$i-experiment.json" >> "$OUT/verify-layer.log" 2>&1
    echo "== QKV = $v: $(grep -h '^step of\|Error' "$OUT/verify-layer.log" | tail -1)"; done; true ;;
s29-dispatch)  # issue #14 (session 29, first): where the bs-1 propose's host time goes with host inputs (goal row 733 us,
  # 440-490 us of it before the call returns; ~120 us with the inputs on the device): bench/diag_dispatch.py times one
  # bucket called eight ways and traces the host's spans; then (DISPATCH_LANE=1) the staging tests' GPU lane
  rm -rf /tmp/dp; XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout ${DISPATCH_TIMEOUT:-240} \
    python3 bench/diag_dispatch.py --bs ${DISPATCH_BS:-1} \
    --profile-dir /tmp/dp --json "$OUT/diag-dispatch-bs${DISPATCH_BS:-1}.json" > "$OUT/diag-dispatch.log" 2>&1
  head -60 "$OUT/diag-dispatch.log"
  [ -n "${DISPATCH_LANE:-}" ] && STAGE_STEPS="${DISPATCH_LANE_STEPS:-lane}" bash "$0" s27-stage; true ;;
s28-stage-goals)  # issue #14 (session 28, first): the propose goal rows (E4B drafter, k 3, 4K, bs 1 and 64, the
  # bucketed program as the goal rows call it) with JAXSPEC_STAGE_INPUTS 0, 1, 0, 1 in four processes (the first two
  # compile, the others load from the persistent cache): the A/B in goal-row form, so that if the switch ships on its
  # files are that configuration's goal rows; then, as time allows, decode bs 1 paged against paged-staged (one process)
  i=0; for v in ${STAGE_ORDER:-0 1 0 1}; do i=$((i + 1))
    JAXSPEC_STAGE_INPUTS=$v timeout ${PROPOSE_TIMEOUT:-200} python3 -m jaxspec.bench propose --bs 1,64 --ctx 4096 \
      --variants bucketed --json "$OUT/propose-goals-stage$v-run$i.json" >> "$OUT/propose-goals-stage.log" 2>&1
    echo "== JAXSPEC_STAGE_INPUTS=$v (run $i)"; grep "^propose ctx\|Error" "$OUT/propose-goals-stage.log" | tail -2; done
  [ -n "${WITH_DECODE:-}" ] && { timeout ${DECODE_TIMEOUT:-160} python3 -m jaxspec.bench decode --bs 1 --cache \
    paged,paged-staged --json "$OUT/decode-stage-experiment.json" > "$OUT/decode-stage.log" 2>&1
    grep -h "^step of\|paged\|Error" "$OUT/decode-stage.log" | head -8; }; true ;;
s27-stage)  # issue #14 (session 27, first in the queue): JAXSPEC_STAGE_INPUTS — each program copies its per-call inputs
  # into one buffer of its own first (jaxspec/staging.py), so that fresh input arrays move one CUDA-graph node; the
  # drafter's inputs also travel packed (one transfer) and its outputs' buffers are made at the start (no temporary in
  # them). Counted without a GPU (bench/diag_moved.py): re-recorded nodes when inputs and outputs move, propose bs 1
  # 22 -> 7, bs 64 146 -> 7; verify's tokens 43 -> 1. STAGE_STEPS: any of "lane vlog bench" (all by default).
  # lane: its tests on the GPU (the drafter's bit-for-bit comparison and the engine's, Triton kernels); vlog: XLA's own
  # count of re-recorded nodes a call, the bs-1 propose bucketed against staged (20 calls each); bench (= propose verify
  # decode, each also alone): the goal rows' programs called as the goal rows call them, staged beside unstaged in one process each, propose in both orders
  # (bucketed,staged then staged,bucketed), verify bs 1,16 and decode bs 1 (paged against paged-staged). All figures
  # are -experiment files (the goal rows themselves come from s26-goals with the switch's shipped value)
  steps=" ${STAGE_STEPS:-lane vlog bench} "; vm=command_buffer_thunk=3,command_executor=2
  [[ $steps == *" bench "* ]] && steps="$steps propose verify decode "
  [[ $steps == *" lane "* ]] && { timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_staging.py tests/test_rounds.py -k "staging or staged or stages or copied or misplaced or copy" \
    > "$OUT/tests-stage.txt" 2>&1; grep -E "passed|failed|^FAILED" "$OUT/tests-stage.txt" | tail -6; }
  [[ $steps == *" vlog "* ]] && for v in bucketed staged; do
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=$vm timeout ${VLOG_TIMEOUT:-150} python3 -m jaxspec.bench propose --bs 1 \
      --ctx 4096 --variants $v --iters 20 --json "$OUT/propose-stage-vlog-$v-experiment.json" > /tmp/sv-$v.log 2>&1
    echo "== $v: $(grep -h '^propose ctx' /tmp/sv-$v.log)"
    grep -oE "Updated [0-9]+ commands in [0-9]+" /tmp/sv-$v.log | awk '{n[$2]++; s[$2]+=$NF} END {for (k in n) \
      printf "  graph %s: %d updates, mean %.0f us\n", k, n[k], s[k]/n[k]}' | sort -t: -k2 -rn | head -4 \
      | tee "$OUT/stage-updates-$v.txt"; done
  [[ $steps == *" propose "* ]] && for order in bucketed,staged staged,bucketed; do
      timeout ${PROPOSE_TIMEOUT:-200} python3 -m jaxspec.bench propose --bs 1,64 --ctx 4096 --variants $order \
        --json "$OUT/propose-stage-${order%%,*}-first-experiment.json" > "$OUT/propose-stage-${order%%,*}-first.log" 2>&1
      echo "== $order"; grep -h "^propose ctx\|Error" "$OUT/propose-stage-${order%%,*}-first.log" | head -3; done
  [[ $steps == *" verify "* ]] && { timeout ${VERIFY_TIMEOUT:-260} python3 -m jaxspec.bench verify --bs 1,16 --cache paged,paged-staged \
      --json "$OUT/verify-stage-experiment.json" > "$OUT/verify-stage.log" 2>&1
    grep -h "^step of\|Error" "$OUT/verify-stage.log" | head -8; }
  [[ $steps == *" decode "* ]] && { timeout ${DECODE_TIMEOUT:-160} python3 -m jaxspec.bench decode --bs 1 --cache paged,paged-staged \
      --json "$OUT/decode-stage-experiment.json" > "$OUT/decode-stage.log" 2>&1
    grep -h "^step of\|Error" "$OUT/decode-stage.log" | head -8; }; true ;;
s24-graph)  # issue #14 (next): `bench graph` on the device (XLA's autotuned GEMMs): launches a call of propose bs 1/64,
  # verify bs 1/16, decode bs 1 and the engine's round (bs 1, R 1). Session 24 counted, for an H200 described to XLA on
  # a CPU: 110, 184, 783, 791, 983 and the round's; the traces: verify bs 1 783 (session 17), propose bs 1 110 + 4 input
  # copies (session 22); s24-graph-trace traces the same verify and propose again beside it
  timeout ${GRAPH_TIMEOUT:-420} python3 -m jaxspec.bench graph --top 0 --json "$OUT/graph-h200.json" \
    > "$OUT/graph.log" 2>&1
  tail -10 "$OUT/graph.log" ;;
s24-graph-trace)  # issue #14 (next): verify bs 1 and propose bs 1 (the default program) traced: launches a call from
  # the profile, against s24-graph's counts of the same programs
  rm -rf /tmp/vg; XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout ${VERIFY_TIMEOUT:-200} \
    python3 -m jaxspec.bench verify --bs 1 --profile-dir /tmp/vg --json "$OUT/verify-graph.json" \
    > "$OUT/verify-graph.log" 2>&1
  timeout 60 python3 -m jaxspec.bench trace /tmp/vg --rounds 20 --top 900 --json "$OUT/trace-verify-graph.json" \
    >> "$OUT/verify-graph.log" 2>&1
  grep "^step of\|launches\|Error" "$OUT/verify-graph.log" | head -4
  traced_propose graph 1 bucketed ${PROPOSE_TIMEOUT:-200} 120 ;;
s24-norms)  # issue #14 (next): the Pallas residual norm (JAXSPEC_FUSED_NORMS=1) on the decode step, where XLA splits each
  # norm of a single row into a reduction and an elementwise kernel (bench graph: decode bs 1 983 -> 773 launches;
  # verify 783 -> 785, its norms already one Triton kernel each): decode bs 1 (paged) 0, 1, 0 in three processes
  for v in 0 1 0; do JAXSPEC_FUSED_NORMS=$v timeout ${DECODE_TIMEOUT:-150} python3 -m jaxspec.bench decode --bs 1 \
      --cache paged --json "$OUT/decode-fnorm$v-experiment.json" > "$OUT/decode-fnorm$v.log" 2>&1
    echo "== JAXSPEC_FUSED_NORMS=$v"; grep "^step of\|Error" "$OUT/decode-fnorm$v.log" | head -3; done ;;
s24-tiling)  # issue #14 (next): XLA's tiling propagation (bench graph: verify bs 1 783 -> 764 launches, the shared
  # layers' q norm and RoPE in one kernel) on verify bs 1, off / on / off in three processes
  for f in "" --xla_gpu_experimental_enable_tiling_propagation=true ""; do t=$([ -n "$f" ] && echo on || echo off)
    XLA_FLAGS="$f" timeout ${VERIFY_TIMEOUT:-150} python3 -m jaxspec.bench verify --bs 1 \
      --json "$OUT/verify-tiling-$t-experiment.json" > "$OUT/verify-tiling-$t.log" 2>&1
    echo "== tiling propagation $t"; grep "^step of\|Error" "$OUT/verify-tiling-$t.log" | head -3; done ;;
s25-diag-lp)  # issue #14 (next): the layer products kernel site by site against XLA's ops at E4B's shapes, both forms
  # and a few cuts (bench/diag_layer_products.py: chains of 8 layers, 4 and 1 rows, wall and profiled kernels a layer);
  # run before s25-layer-products to pick Config's default
  timeout ${DIAG_TIMEOUT:-500} python3 bench/diag_layer_products.py --profile ${LP_CUTS:+--cuts $LP_CUTS} \
    --json "$OUT/diag-layer-products-experiment.json" > "$OUT/diag-layer-products.log" 2>&1
  tail -40 "$OUT/diag-layer-products.log" ;;
s25-layer-products)  # issue #14 (next): a layer's products with the norms before them and the activations after them
  # (JAXSPEC_LAYER_PRODUCTS=1, jaxspec/pallas/layer_products.py; bench graph: verify bs 1 783 -> 491 launches, decode
  # 983 -> 516; with JAXSPEC_QKV_KERNEL=1 JAXSPEC_FUSED_NORMS=1 too: 399 and 398). GPU lane (the kernel against its
  # reference, compiled by Triton; the engine with it against transformers' greedy, all sites and all but q/k/v), then
  # verify bs 1 and decode bs 1 with the switch 0, 1, 0 (LP_SITES: JAXSPEC_LAYER_PRODUCT_SITES of the 1 runs, default
  # all; LP_WITH="JAXSPEC_QKV_KERNEL=1 JAXSPEC_FUSED_NORMS=1" to run them with the other kernels too)
  lp_lane
  for v in 0 1 0; do for step in verify decode; do
    env JAXSPEC_LAYER_PRODUCTS=$v ${LP_SITES:+JAXSPEC_LAYER_PRODUCT_SITES=$LP_SITES} $LP_WITH \
      timeout ${STEP_TIMEOUT:-150} python3 -m jaxspec.bench $step --bs 1 $([ $step = decode ] && echo --cache paged) \
      --json "$OUT/$step-lp$v-experiment.json" > "$OUT/$step-lp$v.log" 2>&1
    echo "== $step JAXSPEC_LAYER_PRODUCTS=$v"; grep "^step of\|Error" "$OUT/$step-lp$v.log" | head -3
  done; done ;;
s26-lp)  # issue #14: the layer products kernel on the H200 in one call. Warm compiles (--iters 1) of every (step, switch
  # set) side by side fill the persistent cache, each process held to 14% of the GPU's memory (session 26: six of them
  # unbounded ran it out, and the kernel tests beside them failed their first four cases, cause not seen); then each is
  # timed in its own process, one at a time, the first set again at the end (the machine's drift); then the GPU lane of
  # the kernel alone (tests, Triton; failures named)
  confs=("JAXSPEC_LAYER_PRODUCTS=0" "JAXSPEC_LAYER_PRODUCTS=1" \
    "JAXSPEC_LAYER_PRODUCTS=1 JAXSPEC_QKV_KERNEL=1 JAXSPEC_FUSED_NORMS=1"); tags=(lp0 lp1 lp1-qkv-fn)
  steps=${LP_STEPS:-verify decode}
  for step in $steps; do for i in 0 1 2; do
    (export ${confs[i]}; warm "$step-${tags[i]}" $step --bs 1 $([ $step = decode ] && echo --cache paged)) & done; done
  wait
  for i in 0 1 2 0; do for step in $steps; do f="$step-${tags[i]}"; [ -e "$OUT/$f-experiment.json" ] && f="$f-again"
    env ${confs[i]} timeout ${STEP_TIMEOUT:-90} python3 -m jaxspec.bench $step --bs 1 \
      $([ $step = decode ] && echo --cache paged) --json "$OUT/$f-experiment.json" > "$OUT/$f.log" 2>&1
    echo "== $step ${confs[i]}"; grep "^step of\|Error" "$OUT/$f.log" | head -3; done; done
  lp_lane ;;
s24-qkv)  # issue #14 (next): the q/k/v kernel (JAXSPEC_QKV_KERNEL=1: a non-shared layer's q/k/v norms, RoPE and K/V
  # write in one launch, a KV-shared layer's q in another; bench graph: verify bs 1 783 -> 732 launches, decode bs 1
  # 983 -> 867). GPU lane (the kernels against their references, compiled by Triton; the engine with them against
  # transformers' greedy), then verify bs 1 with the switch 0, 1, 0 in three processes
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_qkv_cache.py tests/test_rounds.py \
    -k "qkv" > "$OUT/tests-qkv.txt" 2>&1
  grep -E "passed|failed" "$OUT/tests-qkv.txt" | tail -2
  for v in 0 1 0; do JAXSPEC_QKV_KERNEL=$v timeout ${VERIFY_TIMEOUT:-130} python3 -m jaxspec.bench verify --bs 1 \
      --json "$OUT/verify-qkv$v-experiment.json" > "$OUT/verify-qkv$v.log" 2>&1
    echo "== JAXSPEC_QKV_KERNEL=$v"; grep "^step of\|Error" "$OUT/verify-qkv$v.log" | head -3; done ;;
s24-qkv-decode)  # issue #14 (next): decode bs 1 (paged) with (JAXSPEC_QKV_KERNEL, JAXSPEC_FUSED_NORMS) = (0, 0),
  # (1, 1), (1, 0) in three processes (bench graph: 983, 657, 867 launches; (0, 1) 773 is s24-norms)
  for v in 00 11 10; do JAXSPEC_QKV_KERNEL=${v:0:1} JAXSPEC_FUSED_NORMS=${v:1:1} timeout ${DECODE_TIMEOUT:-150} \
      python3 -m jaxspec.bench decode --bs 1 --cache paged --json "$OUT/decode-qkv-fn$v-experiment.json" \
      > "$OUT/decode-qkv-fn$v.log" 2>&1
    echo "== JAXSPEC_QKV_KERNEL, JAXSPEC_FUSED_NORMS = $v"; grep "^step of\|Error" "$OUT/decode-qkv-fn$v.log" | head -3
  done ;;
s23-fused-rows)  # issue #14 (next): why the fused drafter kernels fall behind the jnp step from bs 8 up (session 22: bs 8
  # 1300-1319 against 1008-1132 µs). Both steps at bs 8, inputs on the device, each traced in its own process
  # (every kernel listed), so the kernels whose time grows with the rows are named
  for v in fused_stable unfused_stable; do traced_propose rows-$v-experiment 8 $v ${PROPOSE_TIMEOUT:-200} 80; done ;;
s22-default)  # issue #14: the fused drafter kernels by default for buckets up to FUSED_MAX_BUCKET (2; 4 when run). GPU lane (the
  # drafter against eager at every batch size, the fused step, the engine with kernels against transformers' greedy),
  # then the propose goal rows (E4B drafter, k 3, 4K, bs 1 and 64: bucketed, the default, against unfused) in two
  # processes of opposite order, the first variant traced
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_drafter.py tests/test_rounds.py \
    -k "every_batch_size or fused or changing_tables or kernels" > "$OUT/tests-default.txt" 2>&1
  grep -E "passed|failed" "$OUT/tests-default.txt" | tail -2
  for order in bucketed,unfused unfused,bucketed; do
    traced_propose default-${order%%,*} 1,64 $order ${PROPOSE_TIMEOUT:-200} 60; done ;;
s22-cluster-device)  # issue #14: s22-cluster with each call's device time (R = 32 chained calls in one program minus
  # one call, over 31: the ~60-µs per-call floor cancelled) and longer chains (L up to 16), so that a phase's cost
  # inside a cluster kernel is resolved below a µs
  timeout ${CLUSTER_TIMEOUT:-300} python3 bench/diag_cluster.py --layers 1,2,4,8,16 --calls 100 --repeats 32 \
    --json "$OUT/diag-cluster-device.json" > "$OUT/diag-cluster-device.log" 2>&1
  grep "per more layer\|Error" "$OUT/diag-cluster-device.log" | tail -30 ;;
s22-cluster)  # issue #14 (next): what one dependent phase costs inside a thread-block-cluster kernel (Mosaic GPU), the
  # road under the ~90-phase floor of a kernel per phase (BENCHMARKS.md session 21): bench/diag_cluster.py, chains of
  # 1-6 dependent products in one cluster kernel (C 2-16 blocks, weights prefetched or streamed by the TMA) against
  # XLA's chain; µs per more layer for each. CPU-checked (--check: lowered for CUDA, the interpreter = the jnp chain)
  timeout ${CLUSTER_TIMEOUT:-240} python3 bench/diag_cluster.py --json "$OUT/diag-cluster.json" > "$OUT/diag-cluster.log" 2>&1
  grep -v "^W\|^I" "$OUT/diag-cluster.log" | tail -30 ;;
s22-fused)  # issue #14 (next): the fused drafter kernels with their weights loaded at once (session 21: no chunk loop, every
  # weight load issued before the prologue's; 2 weight rows a program for pre / o / down). Their GPU lane, then the
  # propose (E4B drafter, k 3, 4K) at bs 1 and 64 in two processes of opposite order (stable, fused_stable), each
  # traced last (kernels and launches a propose); then, with FUSED_E2E=1, E4B end to end at bs 1 (bucketed against
  # bucketed-fused, R 4)
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_draft_layer.py tests/test_drafter.py \
    -k "fused or kernel or comparison or prologue" > "$OUT/tests-fused.txt" 2>&1; grep -E "passed|failed" "$OUT/tests-fused.txt" | tail -2
  for order in stable,fused_stable fused_stable,stable; do
    traced_propose first-${order%%,*} 1,64 $order ${FUSED_TIMEOUT:-200} 60; done
  [ "${FUSED_E2E:-0}" = 1 ] || exit 0
  timeout ${E2E_TIMEOUT:-300} python3 -m jaxspec.bench e2e --bs 1 --prompt-len 1024 --modes off,bucketed,bucketed-fused \
    -k 3 --rounds-per-call 4 --overlap on --json "$OUT/e2e-e4b-fused.json" > "$OUT/e2e-e4b-fused.log" 2>&1
  grep -h "^e2e bs\|Error" "$OUT/e2e-e4b-fused.log" ;;
s21-pin-ab)  # issue #14: JAXSPEC_PIN_OUTPUT's GPU lane (the engine against transformers' greedy with the switch 0 and 1,
  # Triton kernels, fp32), then E2B end to end at bs 1 (R 1 and 4, overlap) with the switch 0 and 1 side by side
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_rounds.py -k pinned \
    > "$OUT/tests-pin.txt" 2>&1; grep -E "passed|failed" "$OUT/tests-pin.txt" | tail -2
  for v in ${PIN_VALUES:-0 1}; do JAXSPEC_PIN_OUTPUT=$v timeout ${E2E_TIMEOUT:-200} python3 -m jaxspec.bench e2e \
      --preset E2B --bs 1 --prompt-len 256 --new-tokens 128 --modes off,bucketed -k 3 --rounds-per-call 1,4 \
      --overlap on --json "$OUT/e2e-e2b-pin$v.json" > "$OUT/e2e-e2b-pin$v.log" 2>&1
    echo "== E2B JAXSPEC_PIN_OUTPUT=$v"; grep -h "^e2e bs\|Error" "$OUT/e2e-e2b-pin$v.log"; done ;;
s37-named)  # issue #14: decode (paged) and verify at bs 1, E4B, 4K, each traced with XLA's optimized HLO beside it, so
  # that `bench trace --hlo` names every kernel (shape, jax op) and its µs a step; NAMED picks "decode verify" (both)
  for g in ${NAMED:-decode verify}; do rm -rf /tmp/hlo-$g /tmp/pt-$g
    args=$([ $g = decode ] && echo "--bs 1 --cache paged" || echo "--bs 1")
    XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true --xla_dump_to=/tmp/hlo-$g" timeout ${NAMED_TIMEOUT:-150} \
      python3 -m jaxspec.bench $g $args --profile-dir /tmp/pt-$g --json "$OUT/$g-named-traced.json" > "$OUT/$g-named.log" 2>&1
    f=$(ls -S /tmp/hlo-$g/*after_optimizations.txt 2>/dev/null | head -1)
    timeout 120 python3 -m jaxspec.bench trace /tmp/pt-$g --rounds 20 --top 1000 $([ -n "$f" ] && echo "--hlo $f") \
      --json "$OUT/trace-$g-named.json" >> "$OUT/$g-named.log" 2>&1
    echo "== $g: $(grep -h '^step of\|launches\|Error\|error' "$OUT/$g-named.log" | head -3 | tr '\n' ' ')"; done ;;
s21-propose-hlo)  # issue #14: E4B's drafter propose (bs 1, 4K, the stable variant: inputs on the device) traced with
  # XLA's optimized HLO beside it, so that `bench trace --hlo` names every kernel of a propose (shape and jax op)
  named_propose propose-hlo 1 stable ${PROPOSE_TIMEOUT:-150} ;;
s20-fused-trace)  # issue #14: why the fused drafter step is slower with stable addresses: fused_stable and stable each
  # traced (the first variant listed is the traced one), one process each, side by side in one call
  for v in fused_stable stable; do o=$([ $v = stable ] && echo fused_stable || echo stable); rm -rf /tmp/pt
    XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout ${FUSED_TIMEOUT:-150} python3 -m jaxspec.bench \
      propose --bs 1 --ctx 4096 --variants $v,$o --profile-dir /tmp/pt --json "$OUT/propose-traced-$v.json" \
      > "$OUT/propose-traced-$v.log" 2>&1
    timeout 60 python3 -m jaxspec.bench trace /tmp/pt --rounds 20 --top 40 --json "$OUT/trace-propose-$v.json" \
      >> "$OUT/propose-traced-$v.log" 2>&1
    echo "== $v traced"; grep "^propose ctx\|launches\|busy\|Error\|error:" "$OUT/propose-traced-$v.log" | head -5; done ;;
s20-io)  # issue #14: what moved buffers cost a call. XLA re-records every CUDA-graph node that touches a buffer whose
  # address changed since the last call (session 10: 140 of the bs-1 propose's 207 nodes, ~300 µs); fresh outputs
  # move every call, and temporaries share their allocations. The stable variants keep every address: inputs already on
  # the device, outputs written into the donated buffers of the last call (session 10's attempt at this donated
  # nothing: jit drops an argument the program does not read, and a dropped argument is not donated). Side by side in
  # one call: the GPU test of the donated outputs, propose bs 1 and 64 (bucketed, stable), verify bs 1 and 16 and decode
  # bs 1 (paged, paged-stable); then XLA's own count of re-recorded nodes a call (its log) for each. All under $o,
  # packed into $OUT/io.tgz after each step. IO_STEPS: "bench" (the tests and the figures), "vlog" (the counts); both
  # by default (two calls if the compiles are cold: the second finds them in the persistent cache)
  o=/tmp/io-out; mkdir -p $o
  if [[ " ${IO_STEPS:-bench vlog} " == *" bench "* ]]; then
  timeout ${IO_TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_drafter.py \
    -k "donated or changing_tables" > $o/tests-io.txt 2>&1
  grep -E "passed|failed" $o/tests-io.txt | tail -2 | tee -a $o/io.log
  for b in ${IO_BENCHES:-propose verify decode}; do
    case $b in propose) a="propose --bs 1,64 --ctx 4096 --variants bucketed,stable" ;;
    verify) a="verify --bs ${IO_VERIFY_BS:-1,16} --cache paged,paged-stable" ;; decode) a="decode --bs 1 --cache paged,paged-stable" ;;
    esac
    timeout ${IO_TIMEOUT:-150} python3 -m jaxspec.bench $a --json "$o/$b-io.json" > "$o/$b-io.log" 2>&1
    grep -h "^step of\|^propose ctx\|Error\|error:" "$o/$b-io.log" | head -6 | tee -a $o/io.log
    tar czf "$OUT/io.tgz" -C $o .; done; fi
  [[ " ${IO_STEPS:-bench vlog} " == *" vlog "* ]] || { cp $o/io.log "$OUT/io.log"; exit 0; }
  vm=command_buffer_thunk=3,command_executor=2  # (INFO lines: jax's default TF_CPP_MIN_LOG_LEVEL hides them)
  IFS=';' read -ra vlogs <<< "${IO_VLOGS:-propose --bs 1 --ctx 4096 --variants bucketed;propose --bs 1 --ctx 4096 \
--variants stable;verify --bs 1 --cache paged;verify --bs 1 --cache paged-stable}"
  for v in "${vlogs[@]}"; do
    t=$(echo "$v" | awk '{print $1"-"$NF}')
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=$vm timeout ${IO_VLOG_TIMEOUT:-120} python3 -m jaxspec.bench $v --iters 20 \
      --json "$o/vlog-$t-experiment.json" > "$o/vlog-$t.log" 2>&1
    echo "== $t: $(grep -h '^step of\|^propose ctx' "$o/vlog-$t.log" | head -1)" | tee -a $o/io.log
    grep -oE "Updated [0-9]+ commands in [0-9]+ [^ ]+ \(skipped [0-9]+" "$o/vlog-$t.log" | sed -E 's/in [0-9]+ /in N /' \
      | sort | uniq -c | sort -rn | head -4 | tee -a $o/io.log
    grep -oE "Updated [0-9]+ commands in [0-9]+" "$o/vlog-$t.log" | awk '{s+=$NF; n++} END {if (n) printf \
      "  %d updates, mean %.0f us\n", n, s/n}' | tee -a $o/io.log
    grep -E "changed address|Updated [0-9]+ commands" "$o/vlog-$t.log" | tail -60 > "$o/vlog-$t-tail.txt"
    rm -f "$o/vlog-$t.log"; tar czf "$OUT/io.tgz" -C $o .; done
  cp $o/io.log "$OUT/io.log" ;;
s20-concurrent)  # issue #14 (next): --xla_gpu_command_buffer_scheduling_mode=CONCURRENT (session 18: verify -2.1%,
  # decode -1.9%, propose -5.9% at bs 1) end to end, side by side with the default twice (default, concurrent, default,
  # concurrent): E4B bs 1 at a 1K prompt (plain and k 3, R 4) and, where s7-convert left it, the default pair (16
  # held-out prompts, plain and k 5, R 4); then the GPU lane's greedy-vs-transformers and lossless tests with the flag
  c=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT
  for i in $(seq ${S20_REPEATS:-2}); do for f in default concurrent; do x=$([ $f = concurrent ] && echo "$c" || echo "")
    XLA_FLAGS="$x" timeout ${E2E_TIMEOUT:-150} python3 -m jaxspec.bench e2e --bs 1 --prompt-len 1024 --modes off,bucketed \
      -k 3 --rounds-per-call 4 --overlap on --json "$OUT/e2e-e4b-$f$i.json" > "$OUT/e2e-e4b-$f$i.log" 2>&1
    [ -d /root/gemma-3-270m ] && XLA_FLAGS="$x" timeout ${E2E_TIMEOUT:-150} python3 -m jaxspec.bench e2e \
      --model /root/gemma-3-270m --assistant "$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir as b; print(b())")" \
      --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 --modes off,bucketed -k 5 \
      --rounds-per-call 4 --overlap on --json "$OUT/e2e-270m-$f$i.json" > "$OUT/e2e-270m-$f$i.log" 2>&1
    echo "== $f $i"; grep -h "^e2e bs\|Error" "$OUT"/e2e-*-$f$i.log; done; done
  XLA_FLAGS="$c" timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_rounds.py \
    tests/test_engine.py::test_speculative_greedy_is_lossless > "$OUT/tests-concurrent.txt" 2>&1
  grep -E "passed|failed" "$OUT/tests-concurrent.txt" | tail -2 ;;
s19-split)  # issue #14 (next): the o and down products' split-K written out (bench/diag_split.py: the weight in S pieces,
  # one batched product, the pieces summed inside the residual norm's fusion) against XLA's own product and its split-K
  # reduction kernel, E4B's shapes at 4 and 1 rows, chains of 8 layers, profiled: µs and kernels a layer
  timeout ${SPLIT_TIMEOUT:-200} python3 bench/diag_split.py --sites o,down --rows 4,1 --splits 0,4,8,16 --profile \
    --json "$OUT/diag-split.json" > "$OUT/diag-split.log" 2>&1
  grep -v "^W\|^I" "$OUT/diag-split.log" | tail -20
  [ "${SPLIT_AB:-0}" = 1 ] || exit 0  # SPLIT_AB=1: then the engine's switch, its GPU lane and E4B side by side
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_model.py tests/test_rounds.py \
    -k "split" > "$OUT/tests-split.txt" 2>&1; grep -E "passed|failed" "$OUT/tests-split.txt" | tail -2
  ab_e4b JAXSPEC_SPLIT_PRODUCTS sp ;;
s19-flags)  # issue #14: XLA's own knobs on E4B's bs-1 steps, one process per flag set, side by side in one call:
  # FLAGSETS (`;`-separated XLA_FLAGS sets, "default" = none; the default twice, first and last, shows the call's drift):
  # verify (4 positions), decode (1, paged), propose (k 3), bs 1, 4K; a set's files are tagged f0, f1, ... in order and
  # packed into $OUT/flags.tgz after each set (what finished comes back if the call is cut short)
  IFS=';' read -ra sets <<< "${FLAGSETS:-default;--xla_gpu_enable_pdl=false;--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true;--xla_gpu_enable_split_k_autotuning=false}"
  i=0; o=/tmp/flags-out; rm -rf $o; mkdir -p $o  # (a warm machine keeps /tmp between calls)
  for s in "${sets[@]}"; do f=$([ "$s" = default ] && echo "" || echo "$s")
    x=$([ -n "$f" ] && echo "-experiment" || echo "")
    echo "== f$i XLA_FLAGS=$f" | tee -a "$OUT/flags.log"
    for b in ${BENCHES:-verify decode propose}; do
      case $b in
      verify) a="verify --bs 1" ;; decode) a="decode --bs 1 --cache paged" ;;
      propose) a="propose --bs 1 --ctx 4096 --variants bucketed" ;; esac
      XLA_FLAGS="$f" timeout ${FLAG_TIMEOUT:-100} python3 -m jaxspec.bench $a --json "$o/$b-f$i$x.json" \
        > "$o/$b-f$i.log" 2>&1
      grep -h "^step of\|^propose ctx\|Error\|error:" "$o/$b-f$i.log" | head -3 | tee -a "$OUT/flags.log"
    done; i=$((i+1)); tar czf "$OUT/flags.tgz" -C $o .; done ;;
s18)  # issue #14 (next): the kernels built in session 16 and not yet measured or GPU-tested, each off by default.
  # PARTS (default "lane gemv joint"; one or two a call): lane, their GPU lane (the small products' kernel and the
  # norms kernel v2 against their references, the joint q/k norm against transformers on the six oracle checkpoints,
  # the engine against transformers' greedy with each switch); gemv, E4B side by side with JAXSPEC_GEMV 0 and 1
  # (ab_e4b: verify traced, decode, propose); joint, the same with JAXSPEC_JOINT_QK_NORM
  for part in ${PARTS:-lane gemv joint}; do case $part in
  lane)
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_row_norms.py \
      tests/test_model.py tests/test_rounds.py -k "gemv or add_norm or joint or fused_qkv or layer_kernels" \
      > "$OUT/tests-s18.txt" 2>&1
    grep -E "passed|failed|Error" "$OUT/tests-s18.txt" | tail -6 ;;
  gemv)
    ab_e4b JAXSPEC_GEMV gv ;;
  joint)
    ab_e4b JAXSPEC_JOINT_QK_NORM jq ;;
  esac; done ;;
s17-hlo)  # issue #14: E4B's verify step (bs 1, 4K) traced with XLA's optimized HLO beside it, so that `bench trace
  # --hlo` names every kernel of the step (its shape and jax op); the HLO comes back xz-compressed
  rm -rf /tmp/hlo /tmp/vh
  XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true --xla_dump_to=/tmp/hlo \
--xla_dump_hlo_module_re=.*paged_decode_step.*" timeout ${VERIFY_TIMEOUT:-250} python3 -m jaxspec.bench verify --bs 1 \
    --profile-dir /tmp/vh --json "$OUT/verify-hlo.json" > "$OUT/verify-hlo.log" 2>&1
  f=$(ls -S /tmp/hlo/*paged_decode_step*after_optimizations.txt 2>/dev/null | head -1)
  [ -n "$f" ] && xz -c "$f" > "$OUT/verify-hlo.txt.xz"
  timeout 120 python3 -m jaxspec.bench trace /tmp/vh --rounds 20 --top 900 $([ -n "$f" ] && echo "--hlo $f") \
    --json "$OUT/trace-verify-hlo.json" >> "$OUT/verify-hlo.log" 2>&1
  grep "^step of\|launches\|Error\|error" "$OUT/verify-hlo.log" | head -6 ;;
s16-ab)  # issue #14: JAXSPEC_ATTN_MERGED 0 against 1 (the split merge in the attention kernel), the default pair at
  # bs 1, plain and k 4 at R 4 (s7-convert first)
  switch_ab_270m JAXSPEC_ATTN_MERGED m ${AB_TIMEOUT:-150} ;;
s15-cost)  # issue #14 (next): what --batch-invariant costs E4B, side by side in one call: plain and k 4 at bs 1 and 16
  # (1K prompts, 64 new tokens), without and with the mode (P 5); no GGUF
  for p in 0 5; do
    timeout ${COST_TIMEOUT:-280} python3 -m jaxspec.bench e2e --bs ${COST_BS:-1,16} --prompt-len 1024 --new-tokens 64 \
      --modes off,bucketed -k 4 --batch-invariant $p --json "$OUT/e2e-e4b-inv$p.json" > "$OUT/e2e-e4b-inv$p.log" 2>&1
    echo "== batch-invariant $p"; grep -A6 "^bs " "$OUT/e2e-e4b-inv$p.log" | head -7; done ;;
s14-tests)  # issue #14's GPU lane for session 13's changes: the attention kernels against their reference (q gathered
  # and the output scattered in q's layout, Triton), the fused q/k/v stacks, both switches through the engine
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    tests/test_model.py -k "matches_reference or has_teeth or fused_qkv or gathering_q" tests/test_rounds.py \
    > "$OUT/tests-s14.txt" 2>&1
  tail -3 "$OUT/tests-s14.txt" ;;
s14-e4b)  # issue #14: the E4B verify step (bs 1 and 16, 4K) with session 13's two switches off and on (the defaults),
  # its bs-1 calls traced (launches and kernel time per call); then decode and propose as shipped (no GGUF)
  for v in 0 1; do
    JAXSPEC_FUSE_QKV=$v JAXSPEC_ATTN_GATHER_Q=$v XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true \
      timeout ${VERIFY_TIMEOUT:-150} python3 -m jaxspec.bench verify --bs ${VERIFY_BS:-1,16} --profile-dir /tmp/v$v \
      --json "$OUT/verify-sw$v.json" > "$OUT/verify-sw$v.log" 2>&1
    timeout 60 python3 -m jaxspec.bench trace /tmp/v$v --rounds 20 --json "$OUT/trace-verify-sw$v.json" \
      >> "$OUT/verify-sw$v.log" 2>&1
    echo "== switches $v"; grep "^step of\|launches\|all kernels\|Error" "$OUT/verify-sw$v.log" | head -6; done
  [ "${E4B_REST:-1}" = 1 ] || exit 0  # E4B_REST=0: the verify step only
  timeout ${DECODE_TIMEOUT:-120} python3 -m jaxspec.bench decode --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1
  timeout ${PROPOSE_TIMEOUT:-150} python3 -m jaxspec.bench propose --bs 1,64 --ctx 4096 --variants bucketed \
    --json "$OUT/propose.json" > "$OUT/propose.log" 2>&1
  grep -h "^step of\|Error" "$OUT/decode.log"; grep -A4 "^ctx  bs" "$OUT/propose.log" | head -6 ;;
s12-same)  # issue #14 (next): bf16 batch invariance, the fraction of requests whose speculative greedy output equals
  # plain greedy output (`same_as_plain`) on the random E4B pair, 64 prompts of 1K, 64 new tokens, 16 at once; no GGUF
  timeout ${SAME_TIMEOUT:-500} python3 -m jaxspec.bench e2e --bs 16 --requests 64 --prompt-len 1024 --new-tokens 64 \
    --modes off,bucketed -k 4 --json "$OUT/e2e-e4b-same.json" > "$OUT/e2e-e4b-same.log" 2>&1
  grep "^e2e bs\|Error" "$OUT/e2e-e4b-same.log"; grep -A4 "^bs " "$OUT/e2e-e4b-same.log" ;;
s10-trace270)  # issue #17 (next): where a 270M round's fixed ~1.2 ms goes (s7-convert first): plain (row-0) and k 4
  # (row-1), RS rounds a call (default 1), both traced; kernel launches, top kernels and XLA modules per call
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  # DUMP=1: also XLA's optimized HLO of the largest decode program (xz) back, to name what the trace's fusions hold
  # (session 10: 27 loop_pad_fusion and 20 memcpy a k-4 round that the plain step has not); TOP: kernels kept per row
  dump=$([ "${DUMP:-0}" = 1 ] && echo "--xla_dump_to=/tmp/hlo --xla_dump_hlo_module_re=.*decode_rounds.*" || echo "")
  XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true $dump" timeout 300 python3 -m jaxspec.bench e2e \
    --model /root/gemma-3-270m --assistant "$A" --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 4 \
    --new-tokens 64 --modes off,bucketed -k 4 --rounds-per-call ${RS:-1} --overlap on --profile-dir /tmp/t \
    --json "$OUT/e2e-270m-r1.json" > "$OUT/trace270.log" 2>&1
  f=$(ls -S /tmp/hlo/*decode_rounds*after_optimizations.txt 2>/dev/null | head -1)  # the k-4 row's (the largest)
  for i in 0 1; do timeout 100 python3 -m jaxspec.bench trace /tmp/t/row-$i --top ${TOP:-25} \
    $([ $i = 1 ] && [ -n "$f" ] && echo "--hlo $f") --json "$OUT/trace270-row$i.json" >> "$OUT/trace270.log" 2>&1; done
  [ -n "$f" ] && xz -c "$f" > "$OUT/decode-rounds-hlo.txt.xz"
  grep -h "^e2e bs\|launches\|all kernels\|Error" "$OUT"/trace270.log | head -20 ;;
s9-e2e)  # issue #17: the shipped drafter at k 1..6 against plain, bs 1, 16 held-out prompts, 128 new tokens
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  timeout ${E2E_TIMEOUT:-400} python3 -m jaxspec.bench e2e --model /root/gemma-3-270m --assistant "$A" \
    --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 --modes off,bucketed \
    -k ${KS:-1,2,3,4,5,6} --rounds-per-call 16 --overlap on --json "$OUT/e2e-270m-k.json" > "$OUT/e2e-270m-k.log" 2>&1
  grep "^e2e bs\|Error" "$OUT/e2e-270m-k.log" | head -30 ;;
s7-convert)  # assemble the carried GGUF (.gg0-.gg3, xz) and convert it without its tokenizer (prompt ids in); unpack
  # the bundled drafter (jaxspec/assets)
  cd /root/carry && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl && cd - >/dev/null
  cat /root/carry/.gg?/part | xz -dc > /tmp/model.gguf; sha256sum /tmp/model.gguf > "$OUT/270m.log"
  PYTHONPATH=/tmp/site:. python3 -c "
from jaxspec.model import gguf
gguf._tokenizer = lambda meta: type('NoTokenizer', (), {'save_pretrained': lambda self, d: None})()
gguf.convert_gguf('/tmp/model.gguf', '/root/gemma-3-270m')
from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())" >> "$OUT/270m.log" 2>&1
  tail -2 "$OUT/270m.log" ;;
s7-e2e270)  # issue #13: the engine at bs 1 on 16 held-out prompts one at a time, 128 new tokens (after s7-convert)
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  timeout ${E2E_TIMEOUT:-420} python3 -m jaxspec.bench e2e --model /root/gemma-3-270m --assistant "$A" \
    --prompts bench/prompts/270m-heldout.jsonl --bs 1 --requests 16 --new-tokens 128 --modes ${MODES:-off,bucketed} \
    -k ${KS:-4} --rounds-per-call ${RS:-16} --overlap on --json "$OUT/e2e-270m.json" > "$OUT/e2e-270m.log" 2>&1
  grep "^e2e bs\|Error" "$OUT/e2e-270m.log" | head -30 ;;
s7-serve)  # issue #16: the server with the default pair (converted by s7-270m) under 1, 8 and 32 streaming clients
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-serve \
    $(ls /root/carry/.whl/*.whl | grep -v gguf) > "$OUT/serve.log" 2>&1
  A=$(python3 -c "from jaxspec.model.packed import bundled_assistant_dir; print(bundled_assistant_dir())")
  PYTHONPATH=/tmp/site-serve:. timeout ${SERVE_TIMEOUT:-420} python3 -m jaxspec.bench serve --model /root/gemma-3-270m \
    --assistant "$A" --server-args "--max-running-requests 32 --draft-bs 1,8,32 ${SERVE_ARGS:-}" --clients 1,8,32 \
    --prompts bench/prompts/270m-heldout.jsonl --json "$OUT/serve-270m.json" >> "$OUT/serve.log" 2>&1
  grep -v "^ *$" "$OUT/serve.log" | tail -14 ;;
esac
# The device tool brings back at most eight files a call: more are packed into one archive (tar xzf out.tgz)
n=$(ls "$OUT" | wc -l)
if [ "$n" -gt 8 ]; then
  tar czf /tmp/out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/out.tgz "$OUT/out.tgz"
  echo "packed $n files into out.tgz"
fi
if [ -n "${CACHE_OUT:-}" ] && [ -d "$JAX_COMPILATION_CACHE_DIR" ]; then  # the part's compile cache, in 15-MiB parts
  rm -f "$OUT"/jaxcache-part-*; tar czf - -C "$JAX_COMPILATION_CACHE_DIR" . | split -b 15m - "$OUT/jaxcache-part-"
  echo "compile cache: $(du -sh "$JAX_COMPILATION_CACHE_DIR" | cut -f1) in $(ls "$OUT"/jaxcache-part-* | wc -l) parts"
fi
