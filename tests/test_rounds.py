"""The device-paced loop (DESIGN.md §9): several speculative rounds per decode call, and decode calls launched before
the last one's results are read, change who drives a round, never its tokens.

References: transformers' greedy generation (the oracle goldens) cut by the host's stopping rules, and plain greedy
decoding of the target (draft off, one round per call, no overlap).
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from conftest import GREEDY, load_reference, pair, tiny_vocab_pair
from jaxspec.engine import Engine, Request, SamplingParams
from jaxspec.model import gemma4

# unroll True: the default (JAXSPEC_UNROLL_ROUNDS unset); False: the `while` loop kept for comparisons. R 16 unrolled (a
# 65-s compile here) is test_cuts_inside_a_round_and_a_call's, against plain greedy
ROUNDS = ([(r, o, True) for r in (1, 2, 4) for o in (False, True)] + [(8, False, True)]
          + [(2, False, False), (4, True, False)])


class Tok:
    """A tokenizer whose token i reads "<i>": a stop string "<i>" matches exactly where token i is committed."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


def cut(out: list[int], *, max_new: int, eos: int | None = None, stop: int | None = None) -> tuple[list[int], str]:
    """The host's rules applied to a reference continuation: EOS (kept), a stop token (kept in the ids), length."""
    for n, t in enumerate(out[:max_new], 1):
        if t in (eos, stop):
            return out[:n], "stop"
    return out[:max_new], "length"


@pytest.fixture(scope="module")
def oracle():
    cfg, params, acfg, aparams = pair()
    ref = load_reference("e2b")
    prompts = [ref[f"greedy_prompt_{i}"][0].tolist() for i in range(4)]
    outs = [ref[f"greedy_out_{i}"][0, len(p):].tolist() for i, p in enumerate(prompts)]
    return cfg, params, acfg, aparams, prompts, outs


@pytest.mark.parametrize("rounds,overlap,unroll", ROUNDS)
def test_rounds_and_overlap_equal_transformers_greedy(oracle, rounds, overlap, unroll, monkeypatch):
    """Transformers' greedy continuations of four prompts, each ended differently: 24 tokens; max_new_tokens 11; an
    EOS at its 10th token (inside a multi-round call); a stop string at its 13th. The last two requests join
    through add_request while the first two are decoding. unroll: the R rounds of a call one after another in the
    program (the default, JAXSPEC_UNROLL_ROUNDS unset); otherwise the device `while` loop (JAXSPEC_UNROLL_ROUNDS=0)."""
    if unroll:
        monkeypatch.delenv("JAXSPEC_UNROLL_ROUNDS", raising=False)
    else:
        monkeypatch.setenv("JAXSPEC_UNROLL_ROUNDS", "0")
    cfg, params, acfg, aparams, prompts, outs = oracle
    eos, stop = outs[2][9], outs[3][12]
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(4,), max_running=4, page_size=4,
                 max_context=64, prefill_chunk=8, rounds_per_call=rounds, overlap=overlap, eos_token_ids=(eos,),
                 tokenizer=Tok())
    params_of = [GREEDY, dataclasses.replace(GREEDY, max_new_tokens=11),
                 dataclasses.replace(GREEDY, ignore_eos=False), dataclasses.replace(GREEDY, stop=(f"<{stop}>",))]
    reqs = [Request(prompt_ids=p, params=sp) for p, sp in zip(prompts, params_of)]
    want = [cut(outs[0], max_new=24), cut(outs[1], max_new=11), cut(outs[2], max_new=24, eos=eos),
            cut(outs[3], max_new=24, stop=stop)]
    assert len(want[2][0]) == 10 and len(want[3][0]) == 13  # the cuts are where meant (first occurrences)
    eng.warmup()
    for r in reqs[:2]:
        eng.add_request(r)
    joined = False
    while eng.has_work():
        eng.step()
        if not joined and all(r.decoding for r in reqs[:2]):
            for r in reqs[2:]:
                eng.add_request(r)
            joined = True
    for i, (r, (ids, reason)) in enumerate(zip(reqs, want)):
        assert (r.output_ids, r.finish_reason) == (ids, reason), f"request {i}"
        assert sum(r.accept_lengths) == len(r.output_ids) - 1  # every committed token is accounted for
    assert reqs[3].text == "".join(f"<{t}>" for t in want[3][0][:-1])  # the stop string is cut from the text
    assert eng.cache.pool.num_free_full == eng.cache.spec.num_full_pages - 1  # every page back
    hlo = eng.runner.executables[("decode", 4, False)].as_text()
    assert (" while(" in hlo) == (rounds > 1 and not unroll)  # the switch does what it says


@pytest.fixture(scope="module")
def tiny():
    """The tiny-vocabulary pair (drafts often accepted, so rounds commit several tokens) and its plain greedy
    continuations of 40 prompts."""
    cfg, params, acfg, aparams = tiny_vocab_pair()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 12, 40)]
    plain = Engine(cfg, params, draft_mode="off", buckets=(8,), max_running=8, page_size=4, max_context=48,
                   prefill_chunk=8, rounds_per_call=1, overlap=False)
    reqs = [Request(prompt_ids=p, params=dataclasses.replace(GREEDY, max_new_tokens=30)) for p in prompts]
    plain.generate(reqs)
    return cfg, params, acfg, aparams, prompts, [r.output_ids for r in reqs]


@pytest.mark.parametrize("rounds,overlap", [(4, True), (16, False)])
def test_cuts_inside_a_round_and_a_call(tiny, rounds, overlap):
    """EOS and max_new_tokens land inside rounds that commit several tokens, inside multi-round calls: the output is
    the plain greedy continuation cut by the host's rules, and the device's extra tokens are discarded."""
    cfg, params, acfg, aparams, prompts, plain = tiny
    eos = 5
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(8,), max_running=8, page_size=4,
                 max_context=48, prefill_chunk=8, rounds_per_call=rounds, overlap=overlap, eos_token_ids=(eos,))
    counts, cuts = [], []
    read, commit = eng.runner.read, eng.stopping.commit

    def read_spy(out):
        host = read(out)
        counts.append(host[:, :, -1])
        return host

    def commit_spy(r, tokens, now):
        n = commit(r, tokens, now)
        cuts.append(n < len(tokens))
        return n

    eng.runner.read, eng.stopping.commit = read_spy, commit_spy
    sps = [SamplingParams(max_new_tokens=int(m), ignore_eos=bool(i % 2)) for i, m in
           enumerate(np.random.default_rng(8).integers(2, 30, len(prompts)))]
    reqs = [Request(prompt_ids=p, params=sp) for p, sp in zip(prompts, sps)]
    eng.generate(reqs)
    for i, (r, sp, out) in enumerate(zip(reqs, sps, plain)):
        want = cut(out, max_new=sp.max_new_tokens, eos=None if sp.ignore_eos else eos)
        assert (r.output_ids, r.finish_reason) == want, f"request {i}"
    # the cases meant happened: rounds of several tokens, and rounds the host cut short (EOS or length inside them)
    committed = np.concatenate([c.reshape(-1) for c in counts])
    print(f"tokens per round {np.mean(committed[committed > 0]):.2f}, max {committed.max()}; rounds cut by the host: "
          f"{sum(cuts)}")
    assert committed.max() == eng.k + 1 and sum(cuts) >= 5


@pytest.mark.parametrize("mode,kernels", [("bucketed", True), ("eager", False)])
def test_accepted_drafts_are_lossless_under_preemption(tiny, mode, kernels):
    """Speculative greedy equals plain greedy where drafts are often accepted (the tiny-vocabulary pair: the random
    512-token pair of tests/test_engine.py's sweep accepts about one draft in 950 rounds, so accepted drafts are rare
    there; here 1.26 tokens a round): k 3, a pool too small for all requests at once (requests wait and are
    preempted mid-way, their accepted tokens recomputed on return), the Pallas kernels (interpreted) at R 4 with
    overlap, and the eager reference path."""
    cfg, params, acfg, aparams, prompts, plain = tiny
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, draft_mode=mode, buckets=(8,), max_running=8,
                 page_size=4, num_pages=40, max_context=48, prefill_chunk=8, use_kernels=kernels,
                 rounds_per_call=4 if mode == "bucketed" else 1, overlap=mode == "bucketed")
    reqs = [Request(prompt_ids=p, params=dataclasses.replace(GREEDY, max_new_tokens=30)) for p in prompts]
    eng.generate(reqs)
    for i, (r, want) in enumerate(zip(reqs, plain)):
        assert r.output_ids == want, f"request {i}"
    s = eng.summary(reqs)
    print(f"mean accept length {s['mean_accept_length']:.2f}, preemptions {s['preemptions']}")
    assert s["mean_accept_length"] > 1.2 and s["preemptions"] > 0  # the cases meant happened
    assert eng.cache.pool.num_free_full == eng.cache.spec.num_full_pages - 1  # every page back


def test_requests_join_while_others_decode_bs_1_to_65(plain_reference):
    """add_request / step: requests join in waves of 1, 2, 4, 8, 16 and 34 on consecutive steps while the earlier ones
    decode, until 65 rows decode together (65: a chunk of 64 and one of 1); the outputs equal plain greedy decoding
    (`generate` of the plain target)."""
    prompts, want = plain_reference
    cfg, params, acfg, aparams = pair()
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(1, 16, 64), max_running=65, page_size=4,
                 max_context=96, prefill_chunk=8, rounds_per_call=1, overlap=True)
    eng.warmup()
    reqs = [Request(prompt_ids=p, params=dataclasses.replace(GREEDY, max_new_tokens=20)) for p in prompts[:65]]
    widest, lo = 0, 0
    for wave in (1, 2, 4, 8, 16, 34):
        for r in reqs[lo: lo + wave]:
            eng.add_request(r)
        lo += wave
        eng.step()
    while eng.has_work():
        widest = max(widest, sum(1 for x in eng.scheduler.running if x.decoding and not x.finished))
        eng.step()
    assert widest == 65
    for i, r in enumerate(reqs):
        assert r.output_ids == want[i], f"request {i}"


def test_decode_steps_transfer_only_their_results(monkeypatch):
    """One device -> host transfer per decode call, and the drafts never leave the device:
    - every step runs under jax.transfer_guard("disallow"): no implicit transfer (on the CPU host -> device only,
      as a CPU array needs no copy to be read; on a GPU device -> host too, bench/results/h200-s4-tests.txt);
    - every explicit one (`runner.fetch`, the engine's only way to read) is a prefill's token per row or, once per
      decode call, that call's committed tokens and counts [bucket, R, k + 2];
    - each compiled decode program takes no drafts and returns, besides the K/V and the round state it is donated,
      only those committed tokens: a draft has no way out of it."""
    from jaxspec.engine import runner

    cfg, params, acfg, aparams = pair()
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(4,), max_running=4, page_size=4,
                 max_context=64, prefill_chunk=8, rounds_per_call=2, overlap=True)
    eng.warmup()
    fetched, fetch = [], runner.fetch
    monkeypatch.setattr(runner, "fetch", lambda x: fetched.append(x.shape) or fetch(x))
    for p in ([3, 4, 5], list(range(3, 20)), [7] * 9):
        eng.add_request(Request(prompt_ids=p, params=GREEDY))
    with jax.transfer_guard("disallow"):
        while eng.has_work():
            eng.step()
    results = (4, 2, eng.k + 2)
    assert fetched.count(results) == eng.stats.calls > 0
    assert set(fetched) == {results, (4,)}, fetched  # (4,): a prefill chunk's tokens
    for (kind, bucket, _), program in eng.runner.executables.items():
        args, _ = program.args_info
        kv, state, out = program.out_info
        assert jax.tree.structure(state) == jax.tree.structure(eng.runner.state)
        assert jax.tree.structure(kv) == jax.tree.structure(eng.cache.kv)
        if kind == "decode":
            assert len(args) == 5, "a decode program with an input beyond weights, kv, state, slots, pages"
            assert out.shape == (bucket, 2, eng.k + 2)


def test_comparison_catches_a_stale_pending_token(oracle, monkeypatch):
    """The round-state comparison has teeth: a loop that carries the old pending token into the next round (instead
    of the round's bonus token) no longer equals transformers."""
    from jaxspec.engine import programs

    real = programs.Programs._advance

    def stale(self, rows, active, n, committed, hidden):
        new, committed, count = real(self, rows, active, n, committed, hidden)
        return dataclasses.replace(new, pending_token=rows.pending_token), committed, count

    monkeypatch.setattr(programs.Programs, "_advance", stale)
    cfg, params, acfg, aparams, prompts, outs = oracle
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(4,), max_running=4, page_size=4,
                 max_context=64, prefill_chunk=8, rounds_per_call=4, overlap=True)
    reqs = [Request(prompt_ids=p, params=GREEDY) for p in prompts]
    eng.generate(reqs)
    assert sum(r.output_ids != out for r, out in zip(reqs, outs)) >= 3


def test_sampled_outputs_do_not_depend_on_rounds_per_call_or_overlap(tiny):
    """Sampling randomness is keyed by (request seed, position), so a sampled request's tokens are a function of its
    seed alone: every R with overlap gives, token for token, the host-paced schedule's (R 1, no overlap) samples over
    30 new tokens (rounds deep into a call, drafts accepted and rejected). With tests/test_engine.py's chi-square
    test of that schedule against transformers' law, the law holds for every R."""
    cfg, params, acfg, aparams, prompts, _ = tiny
    sp = SamplingParams(max_new_tokens=30, temperature=1.0, top_k=4, top_p=0.9, ignore_eos=True)

    def sample(rounds, overlap):
        eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(8,), max_running=8, page_size=4,
                     max_context=48, prefill_chunk=8, rounds_per_call=rounds, overlap=overlap)
        reqs = [Request(prompt_ids=p, params=dataclasses.replace(sp, seed=100 + i)) for i, p in enumerate(prompts[:16])]
        eng.generate(reqs)
        return [r.output_ids for r in reqs], eng.summary(reqs)

    want, s = sample(1, False)
    assert 1.05 < s["mean_accept_length"] < 4.0  # drafts accepted and rejected (k = 3; measured 1.12)
    assert len({tuple(w) for w in want}) >= 8  # sampled, not greedy: the 16 seeds give mostly different outputs
    for rounds, overlap in [(1, True), (4, True), (8, False)]:
        got, _ = sample(rounds, overlap)
        assert got == want, f"R {rounds} overlap {overlap}"


def kernels_greedy(oracle):
    """The engine with the kernels (interpreted on the CPU) at R 2 with overlap, k 3: the oracle prompts' 12-token
    greedy continuations, and transformers'."""
    cfg, params, acfg, aparams, prompts, outs = oracle
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(4,), max_running=4, page_size=4,
                 max_context=64, prefill_chunk=8, rounds_per_call=2, overlap=True, use_kernels=True)
    reqs = [Request(prompt_ids=p, params=dataclasses.replace(GREEDY, max_new_tokens=12)) for p in prompts]
    eng.generate(reqs)
    return [r.output_ids for r in reqs], [o[:12] for o in outs]


def qkv_launches(monkeypatch) -> list:
    """The q/k/v kernels' launches traced from now on, (kernel name, program rows) each, with JAXSPEC_QKV_KERNEL
    unset (its default) unless the caller sets it after."""
    from jaxspec.pallas import qkv_cache

    monkeypatch.delenv("JAXSPEC_QKV_KERNEL", raising=False)
    rows = []
    monkeypatch.setattr(qkv_cache, "pallas_call", lambda *a, real=qkv_cache.pallas_call, **kw: rows.append(
        (kw["name"], kw["grid"][0])) or real(*a, **kw))
    return rows


def test_small_buckets_draft_through_the_fused_kernels(oracle, monkeypatch):
    """By default (fused_draft None) the buckets up to FUSED_MAX_BUCKET draft through the fused kernels and larger
    ones through the jnp step. Buckets 2 and 4, four requests of which two stop early so that both buckets decode:
    the fused step is traced for bucket 2 only, and the engine (kernels interpreted on the CPU, R 2 with overlap)
    gives transformers' greedy continuations. The verify steps (k + 1 positions) do not run the q/k/v kernel
    (`cache.qkv_kernel_on`: by default one-position steps only)."""
    import jaxspec.draft.bucketed as bucketed

    assert bucketed.FUSED_MAX_BUCKET == 2  # the sizes below straddle it
    traced = []

    def spy(aparams, acfg, target_embed, pending_token, *args, **kw):
        traced.append(pending_token.shape[0])
        return propose_fused(aparams, acfg, target_embed, pending_token, *args, **kw)

    propose_fused = bucketed.propose_fused
    monkeypatch.setattr(bucketed, "propose_fused", spy)
    qkv_rows = qkv_launches(monkeypatch)
    cfg, params, acfg, aparams, prompts, outs = oracle
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(2, 4), max_running=4, page_size=4,
                 max_context=64, prefill_chunk=8, rounds_per_call=2, overlap=True, use_kernels=True)
    decoded = []
    decode = eng.runner.decode
    monkeypatch.setattr(eng.runner, "decode",
                        lambda chunk, bucket, *a: decoded.append(bucket) or decode(chunk, bucket, *a))
    lengths = [12, 12, 5, 5]
    reqs = [Request(prompt_ids=p, params=dataclasses.replace(GREEDY, max_new_tokens=n))
            for p, n in zip(prompts, lengths)]
    eng.generate(reqs)
    assert [r.output_ids for r in reqs] == [o[:n] for o, n in zip(outs, lengths)]
    assert set(traced) == {2}, traced
    assert set(decoded) == {2, 4}, decoded
    assert not qkv_rows, qkv_rows


@pytest.mark.parametrize("switch", [None, "0"], ids=["default", "off"])
def test_kernels_gathering_q_equal_transformers_greedy(oracle, monkeypatch, switch):
    """JAXSPEC_ATTN_GATHER_Q (default on): the attention kernels read their query rows from q as it is and write
    their output rows in that layout, no transposed and padded copy before each call and no un-padding slice after;
    0 brings back the row layout. JAXSPEC_FUSED_NORMS (default on): the residual stream's norms as one kernel a site
    (`row_norms.add_norm`); 0 brings back the jnp norms. With the kernels (interpreted on the CPU) at R 2 with
    overlap, the engine gives transformers' greedy continuations with both on (default) and both off ("0"), and every
    kernel call took q as the switch says."""
    import jaxspec.pallas.paged_attention as pa
    from jaxspec.pallas import row_norms

    monkeypatch.delenv("JAXSPEC_ATTN_GATHER_Q", raising=False)
    monkeypatch.delenv("JAXSPEC_FUSED_NORMS", raising=False)
    if switch == "0":
        monkeypatch.setenv("JAXSPEC_ATTN_GATHER_Q", switch)
        monkeypatch.setenv("JAXSPEC_FUSED_NORMS", switch)
    norms = []
    monkeypatch.setattr(row_norms, "pallas_call", lambda *a, real=row_norms.pallas_call, **kw: norms.append(
        kw["grid"]) or real(*a, **kw))
    seen = []
    real = pa.paged_attention_rows
    # `paged_attention` is jitted: an earlier test of these shapes (same process) would leave its trace cached, and
    # its inner calls would not be seen again
    pa.paged_attention.clear_cache()
    # blocks of 16 keys, so that both pieces of a row (the interpreter's two) hold keys at these short contexts
    monkeypatch.setattr(pa, "paged_attention_rows", lambda *a, **kw: seen.append(kw.get("gather_q")) or real(
        *a, **{**kw, "block_k": 16}))
    got, want = kernels_greedy(oracle)
    assert got == want
    assert seen and all((g is not None) == (switch != "0") for g in seen), seen
    assert bool(norms) == (switch != "0"), norms  # the norms kernel traced (prefill chunks, verify steps, drafts)


def test_qkv_kernel_engine_equals_transformers_greedy(oracle, monkeypatch):
    """JAXSPEC_QKV_KERNEL=1 (by default one-position steps only): a non-shared layer's q/k/v norms, RoPE and K/V
    write as one kernel (`qkv_cache.qkv_cache`), a KV-shared layer's q norm and RoPE as one (`q_rope`), interpreted
    here, in prefill chunks and verify steps (JAXSPEC_VERIFY_IN_ATTENTION=0: else steps of up to
    MAX_NEW_KV_QUERIES positions run them inside the attention kernel); at R 2 with overlap the engine gives
    transformers' greedy continuations. (Their comparisons with the references: tests/test_qkv_cache.py.)"""
    rows = qkv_launches(monkeypatch)
    monkeypatch.setenv("JAXSPEC_QKV_KERNEL", "1")
    monkeypatch.setenv("JAXSPEC_VERIFY_IN_ATTENTION", "0")
    got, want = kernels_greedy(oracle)
    assert got == want
    for name in ("qkv_cache", "q_rope"):  # the oracle's KV-shared layers run q_rope
        assert len({m for n, m in rows if n == name}) > 1, rows  # traced in prefill chunks and verify steps


def plain_kernel_launches(oracle, monkeypatch) -> set:
    """Plain decoding with the kernels (bucket 4, prefill chunks of 8, R 2 with overlap, 12 new tokens): asserts the
    engine gives transformers' greedy continuations and returns the (kernel, rows) pairs of `qkv_launches`."""
    rows = qkv_launches(monkeypatch)
    cfg, params, acfg, aparams, prompts, outs = oracle
    eng = Engine(cfg, params, k=0, draft_mode="off", buckets=(4,), max_running=4, page_size=4, max_context=64,
                 prefill_chunk=8, rounds_per_call=2, overlap=True, use_kernels=True)
    reqs = [Request(prompt_ids=p, params=dataclasses.replace(GREEDY, max_new_tokens=12)) for p in prompts]
    eng.generate(reqs)
    assert [r.output_ids for r in reqs] == [o[:12] for o in outs]
    return set(rows)


@pytest.mark.parametrize("switches, launched", [
    ({}, set()), ({"JAXSPEC_SHARED_Q_IN_ATTENTION": "0"}, {("q_rope", 4)}),
    ({"JAXSPEC_QKV_IN_ATTENTION": "0"}, {("qkv_cache", 4)}),
    ({"JAXSPEC_SHARED_Q_IN_ATTENTION": "0", "JAXSPEC_QKV_IN_ATTENTION": "0"}, {("qkv_cache", 4), ("q_rope", 4)}),
], ids=["default", "shared-q-off", "qkv-off", "both-off"])
def test_one_position_steps_norm_and_rotate_in_the_attention_kernel(oracle, monkeypatch, switches, launched):
    """JAXSPEC_QKV_KERNEL unset (the default): in plain decoding's one-position steps a non-shared layer's q/k/v
    norms, RoPE and K/V write run inside its attention kernel (`paged_attention_qkv`; JAXSPEC_QKV_IN_ATTENTION=0:
    `qkv_cache`, one kernel before it) and a KV-shared layer's q norm and RoPE inside its own
    (JAXSPEC_SHARED_Q_IN_ATTENTION=0: `q_rope` before it); prefill chunks run none of them (interpreted here). With
    each choice the engine (R 2 with overlap: the K/V written in the attention kernel are read by the next steps
    and by the KV-shared layers) gives transformers' greedy continuations. (That speculative verify steps run none:
    test_small_buckets_draft_through_the_fused_kernels.)"""
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    rows = plain_kernel_launches(oracle, monkeypatch)
    assert rows == launched, rows  # bucket 4 x 1 position; never an 8-position chunk


@pytest.mark.parametrize("switches", [{}, {"JAXSPEC_VERIFY_IN_ATTENTION": "0"}], ids=["default", "off"])
def test_verify_steps_norm_and_rotate_in_the_attention_kernel(oracle, monkeypatch, switches):
    """JAXSPEC_VERIFY_IN_ATTENTION (on by default since session 42): in a verify step's k + 1 positions too, a
    non-shared layer's q/k/v norms, RoPE and K/V write run inside its attention kernel (`paged_attention_qkv`: each
    program computes the step's four keys of its kv head and takes them wherever the walk meets their slots) and a
    KV-shared layer's q norm and RoPE inside its own (RoPE tables per query row); 0: XLA's norm and rotation fusions
    and two scatters a layer. The in-kernel step's walk scores the step's own keys apart from each block's K and
    adds their values after the walk. Each way the engine (kernels interpreted, k 3, R 2 with overlap: the K/V a
    verify writes are read by the drafter, the KV-shared layers and the later rounds) gives transformers' greedy
    continuations, and the 4-position attention calls took the raw projections (and the K/V heads) as the switch
    says, the 8-token prefill chunks' in-kernel steps too when it is on."""
    import jaxspec.pallas.paged_attention as pa

    for name in ("JAXSPEC_VERIFY_IN_ATTENTION", "JAXSPEC_QKV_IN_ATTENTION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    seen = []  # (queries a row, q normed and rotated in the kernel, K/V computed and written in it) of each call
    steps = set()  # queries a row of each in-kernel q/k/v step
    real = pa.paged_attention_rows
    pa.paged_attention.clear_cache()  # jitted: earlier traces of these shapes would hide the inner calls
    pa.paged_attention_qkv.clear_cache()

    def spy(*a, **kw):
        if kw.get("gather_q") is not None:
            rows, _, group = kw["gather_q"]
            seen.append((rows // group, kw.get("rope") is not None, kw.get("new_kv") is not None))
            if kw.get("new_kv") is not None:
                steps.add(rows // group)
        return real(*a, **{**kw, "block_k": 16})  # both pieces of a row hold keys at these short contexts

    monkeypatch.setattr(pa, "paged_attention_rows", spy)
    try:
        got, want = kernels_greedy(oracle)
    finally:
        pa.paged_attention_qkv.clear_cache()  # keep no trace with the spy's blocks for later tests
    assert got == want
    verify = {(rope, new) for queries, rope, new in seen if queries == 4}
    # the oracle's sliding layers (head_dim 16: halves of 8, `qkv_cache.supported` refuses) keep XLA's q/k/v step
    in_kernel = "JAXSPEC_VERIFY_IN_ATTENTION" not in switches
    assert verify == ({(True, True), (True, False), (False, False)} if in_kernel else {(False, False)}), verify
    # the switch takes every multi-position step: the 8-token prefill chunks' in-kernel steps go with the verify's
    assert steps == ({8, 4} if in_kernel else set()), steps


def test_staged_inputs_engine_equals_transformers_greedy_and_unstaged_sampling(oracle, monkeypatch):
    """JAXSPEC_STAGE_INPUTS (on by default since session 28; 0 turns it off): the prefill and decode programs read
    their per-call inputs (the prefill batch, slots, page tables) from one copy made at the program's start
    (`jaxspec.staging`). At R 2 with overlap and page size 4 (the page tables change every round or two) the engine
    gives transformers' greedy continuations; sampled requests (temperature, top-k, top-p and seeds staged as bits)
    give the very tokens the unstaged programs (JAXSPEC_STAGE_INPUTS=0) give."""
    cfg, params, acfg, aparams, prompts, outs = oracle
    sampled = {}
    for switch in (None, "0"):
        if switch is None:
            monkeypatch.delenv("JAXSPEC_STAGE_INPUTS", raising=False)
        else:
            monkeypatch.setenv("JAXSPEC_STAGE_INPUTS", switch)
        eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(4,), max_running=4, page_size=4,
                     max_context=64, prefill_chunk=8, rounds_per_call=2, overlap=True)
        assert eng.runner.programs.stage_inputs == (switch is None)
        if switch is None:
            reqs = [Request(prompt_ids=p, params=dataclasses.replace(GREEDY, max_new_tokens=12)) for p in prompts]
            eng.generate(reqs)
            assert [r.output_ids for r in reqs] == [o[:12] for o in outs]
        reqs = [Request(prompt_ids=p, params=SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i,
                                                            max_new_tokens=10)) for i, p in enumerate(prompts)]
        eng.generate(reqs)
        sampled[switch] = [r.output_ids for r in reqs]
    assert sampled[None] == sampled["0"]
    assert len({tuple(s) for s in sampled[None]}) > 1


@pytest.mark.parametrize("switch", [None, "0"], ids=["default", "off"])
def test_fused_qkv_engine_equals_transformers_greedy(oracle, monkeypatch, switch):
    """JAXSPEC_FUSE_QKV (default on, one device): the engine stores one q/k/v stack per layer group, and at R 2 with
    overlap, prefill, drafts and verify give transformers' greedy continuations; 0 keeps three stacks, and gives
    them too."""
    if switch is None:
        monkeypatch.delenv("JAXSPEC_FUSE_QKV", raising=False)
    else:
        monkeypatch.setenv("JAXSPEC_FUSE_QKV", switch)
    cfg, params, acfg, aparams, prompts, outs = oracle
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(4,), max_running=4, page_size=4,
                 max_context=64, prefill_chunk=8, rounds_per_call=2, overlap=True)
    groups = eng.runner.weights.target["layers"].values()
    fused = any("qkv_proj" in g for g in groups)
    assert fused == (switch is None) and any("k_proj" in g for g in groups) == (switch is not None)
    stored = gemma4.stored_params(params)  # as the loaders store them: the engine keeps these very arrays
    held = Engine(cfg, stored, acfg=acfg, aparams=aparams, k=3, buckets=(4,), max_running=4, page_size=4,
                  max_context=64, prefill_chunk=8).runner.weights.target["layers"]
    assert all(held[g][n] is a for g, w in stored["layers"].items() for n, a in w.items())
    reqs = [Request(prompt_ids=p, params=dataclasses.replace(GREEDY, max_new_tokens=12)) for p in prompts]
    eng.generate(reqs)
    assert [r.output_ids for r in reqs] == [o[:12] for o in outs]


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
def test_batch_invariant_engine_equals_transformers_greedy(oracle, monkeypatch, kernels):
    """batch_invariant=5 (`--batch-invariant 5`): every decode and verify step runs 5 positions a request (k + 1 = 4
    real with k 3, 1 with the drafter off, the rest padding), every attention table starts at position 0 and spans
    max_context (a sliding layer's window kept by the query masks alone) and the kernels split the keys at fixed
    positions. Speculative decoding (R 2, overlap) and plain decoding each still give transformers' greedy
    continuations (fp32), with the kernels (interpreted on the CPU) and with the reference attention."""
    import jaxspec.engine.programs as programs

    steps = []
    real = programs.step_metadata
    monkeypatch.setattr(programs, "step_metadata", lambda *a, **kw: steps.append((a[5], kw["invariant"]))
                        or real(*a, **kw))
    cfg, params, acfg, aparams, prompts, outs = oracle
    for mode, k in (("bucketed", 3), ("off", 0)):
        steps.clear()
        eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=k, draft_mode=mode, buckets=(4,), max_running=4,
                     page_size=4, max_context=64, prefill_chunk=8, rounds_per_call=2, overlap=True,
                     use_kernels=kernels, batch_invariant=5)
        reqs = [Request(prompt_ids=p, params=dataclasses.replace(GREEDY, max_new_tokens=12)) for p in prompts]
        eng.generate(reqs)
        assert [r.output_ids for r in reqs] == [o[:12] for o in outs], mode
        assert set(steps) == {(8, False), (5, True)}, steps  # prefill chunks as ever; every decode step 5 positions


def test_batch_invariant_bf16_speculative_equals_plain(tiny):
    """The mode's promise: in bf16, greedy output with the drafter (k 3, R 2) equals plain greedy output token for
    token at the same batch_invariant (4) and max_context: the tiny-vocabulary pair cast to bf16 (drafts often
    accepted, so verify rows past the first decide tokens), 16 prompts, 30 new tokens, the engine's default
    attention (the reference on the CPU, the Triton kernels on a GPU; the interpreted kernels' invariance is
    test_kernels.py's). On the CPU the two agree without the mode as well (XLA:CPU's products do not change their
    sums with the row count); on the H200 they do not (E4B's random pair: 0 of 64 requests equal, BENCHMARKS.md
    session 12): there the GPU lane runs this test and `bench e2e --batch-invariant` measures the fraction."""
    cfg, params, acfg, aparams, prompts, _ = tiny
    bf16 = functools.partial(jax.tree.map, lambda a: a.astype(jax.numpy.bfloat16) if a.dtype == np.float32 else a)

    def greedy(mode, k):
        eng = Engine(cfg, bf16(params), acfg=acfg, aparams=bf16(aparams), k=k, draft_mode=mode, buckets=(8,),
                     max_running=8, page_size=4, max_context=48, prefill_chunk=8, rounds_per_call=2,
                     batch_invariant=4)
        reqs = [Request(prompt_ids=p, params=dataclasses.replace(GREEDY, max_new_tokens=30)) for p in prompts[:16]]
        eng.generate(reqs)
        return [r.output_ids for r in reqs], eng.summary(reqs)["mean_accept_length"]

    (spec, accept), (plain, _) = greedy("bucketed", 3), greedy("off", 0)
    assert spec == plain
    assert accept > 1.2  # drafts accepted (measured 1.32): tokens decided by verify rows past the first
