"""The engine: lossless speculative decoding, equality with transformers' greedy generation, sampling by chi-square."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import (GREEDY, chi_square_cells, golden_path, load_reference, mixed_prompts, pair, pearson_p,
                      run)
from jaxspec import sampling
from jaxspec.config import assistant_preset
from jaxspec.engine import Engine, Request, SamplingParams
from jaxspec.engine.stopping import Stopping
from jaxspec.model import gemma4
from jaxspec.model.weights import load_assistant, load_target, random_assistant_params

# ---- against transformers' own greedy generation ------------------------------------------------------------------


@pytest.mark.parametrize("case,head,mode,threads", [
    ("e2b", "assistant", "bucketed", 2),  # the programs compiled side by side in two threads (`compile_all`)
    ("moe", "assistant", "eager", None), ("dense31", "assistant", "bucketed", None), ("gemma3", None, "off", None),
    ("mm", None, "off", None)])
def test_greedy_equals_transformers_generate(case, head, mode, threads, monkeypatch):
    if threads:
        monkeypatch.setenv("JAXSPEC_COMPILE_THREADS", str(threads))
    cfg, params = load_target(golden_path(case, "target"), "fp32")
    acfg = aparams = None
    if head:
        acfg, aparams = load_assistant(golden_path(case, head), "fp32")
    ref = load_reference(case)
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, draft_mode=mode,
                 buckets=(2, 4) if threads else (4,), max_running=4, page_size=4, max_context=64, prefill_chunk=8)
    prompts = [ref[f"greedy_prompt_{i}"][0].tolist() for i in range(4)]
    outs, _ = run(eng, prompts)
    for i, out in enumerate(outs):
        want = ref[f"greedy_out_{i}"][0, len(prompts[i]):].tolist()
        assert out == want, f"{case} prompt {i}"


# ---- lossless: speculative greedy == plain greedy -------------------------------------------------------------------


LOSSLESS = [
    # k, draft mode, head, max running, full pages (None: no pressure), buckets, Pallas kernels (interpret on CPU),
    # rounds per decode call, overlap (the eager reference always runs one round a call without overlap)
    (1, "bucketed", "assistant", 16, None, (1, 2, 4, 8, 16), False, 4, False),
    (2, "eager", "assistant_plain", 4, None, (1, 4), False, 1, False),
    (3, "bucketed", "assistant_plain", 8, 40, (1, 4, 8), False, 2, True),
    (5, "eager", "assistant", 3, 40, (1, 4), False, 1, False),
    (3, "bucketed", "assistant", 16, 60, (16,), True, 8, True),
]


@pytest.mark.parametrize("k,mode,head,running,pages,buckets,kernels,rounds,overlap", LOSSLESS)
def test_speculative_greedy_is_lossless(plain_reference, k, mode, head, running, pages, buckets, kernels, rounds,
                                        overlap):
    """Token for token equal to plain greedy: 50 prompts per configuration (250 over the sweep, many longer than
    the window), continuous batching, k in {1,2,3,5}, both draft modes, both heads, 1 to 8 rounds per decode call
    with and without overlap, and pools small enough that requests wait and are preempted."""
    prompts, want = plain_reference
    i = LOSSLESS.index((k, mode, head, running, pages, buckets, kernels, rounds, overlap))
    lo, hi = 50 * i, 50 * (i + 1)
    cfg, params, acfg, aparams = pair(head=head)
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=k, draft_mode=mode, buckets=buckets,
                 max_running=running, page_size=4, num_pages=pages, max_context=96, prefill_chunk=8,
                 use_kernels=kernels, rounds_per_call=rounds, overlap=overlap)
    outs, reqs = run(eng, prompts[lo:hi], dataclasses.replace(GREEDY, max_new_tokens=20))
    for j, (got, exp) in enumerate(zip(outs, want[lo:hi])):
        assert got == exp, f"prompt {lo + j}"
    s = eng.summary(reqs)
    if pages:
        assert s["preemptions"] > 0, "the pool was meant to be too small for all requests at once"
    assert s["mean_accept_length"] > 1.0  # the drafter does get drafts accepted on this pair
    assert eng.cache.pool.num_free_full == eng.cache.spec.num_full_pages - 1  # every page back


def test_stops_at_eos_and_max_new_tokens():
    cfg, params, acfg, aparams = pair()
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(4,), max_running=4, page_size=4,
                 max_context=64, prefill_chunk=8)
    prompts = mixed_prompts(cfg, 4, seed=3)
    outs, _ = run(eng, prompts)
    eos = outs[0][5]  # a token the first request produces: make it the EOS
    eng2 = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(4,), max_running=4, page_size=4,
                  max_context=64, prefill_chunk=8, eos_token_ids=[eos])
    outs2, reqs = run(eng2, prompts, dataclasses.replace(GREEDY, ignore_eos=False, max_new_tokens=10))
    for full, cut, r in zip(outs, outs2, reqs):
        stop = full.index(eos) + 1 if eos in full[:10] else 10
        assert cut == full[:stop]
        assert r.finish_reason == ("stop" if eos in full[:10] else "length")


def test_context_limit_finishes_the_request():
    cfg, params, acfg, aparams = pair()
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(1,), max_running=1, page_size=4,
                 max_context=32, prefill_chunk=8)
    outs, reqs = run(eng, [list(range(3, 23))], dataclasses.replace(GREEDY, max_new_tokens=100))
    assert reqs[0].finish_reason == "length"
    assert len(reqs[0].tokens) + 4 > 32 and len(reqs[0].tokens) <= 32


def test_no_tracing_after_warmup_is_enforced(monkeypatch):
    """generate() runs under jax.no_tracing: a step that would compile on the serving path raises."""
    cfg, params, acfg, aparams = pair()
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=2, buckets=(2,), max_running=2, page_size=4,
                 max_context=64, prefill_chunk=8)
    outs, _ = run(eng, mixed_prompts(cfg, 6, seed=4))  # a long run: would raise on any trace
    assert len(outs) == 6
    programs, R = eng.runner.programs, eng.config.rounds_per_call
    eng.runner.executables = {
        key: jax.jit(programs.prefill(key[2]) if key[0] == "prefill" else programs.decode_rounds(R, key[2]),
                     donate_argnames=("kv", "state")) for key in eng.runner.executables}
    with pytest.raises(RuntimeError, match="no_tracing"):
        run(eng, mixed_prompts(cfg, 2, seed=5))


def _real_rows(eng):
    """The device state real requests own: K/V of every page but the dummy page 0, decode-state rows but slot 0."""
    ps = eng.cache.spec.page_size
    kv = {t: (np.asarray(layer.k)[:, ps:], np.asarray(layer.v)[:, ps:]) for t, layer in eng.cache.kv.items()}
    state = jax.tree.map(lambda a: np.asarray(a)[1:], eng.runner.state)
    return kv, state


@pytest.mark.parametrize("overlap", [False, True])
def test_prime_touches_only_padding_rows(plain_reference, overlap):
    """Running every program once on padding rows (what warmup does on a GPU) in the middle of serving changes no
    byte of a real request's K/V or decode state, and the outputs stay equal to plain greedy decoding."""
    prompts, want = plain_reference
    cfg, params, acfg, aparams = pair()
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, buckets=(1, 4), max_running=4, page_size=4,
                 max_context=96, prefill_chunk=8, overlap=overlap)
    eng.warmup(sample=True, prime=False)
    assert not eng.runner._primed
    reqs = [Request(prompt_ids=list(p), params=dataclasses.replace(GREEDY, max_new_tokens=20)) for p in prompts[:6]]
    for r in reqs:
        eng.add_request(r)
    for _ in range(4):
        eng.step()
    assert any(r.decoding for r in eng.scheduler.running)  # requests are mid-way, rows and pages in use
    jax.block_until_ready((eng.cache.kv, eng.runner.state))
    before = _real_rows(eng)
    eng.runner.prime()
    assert len(eng.runner._primed) == len(eng.runner.executables) == 8  # {prefill, decode} x 2 buckets x 2 variants
    after = _real_rows(eng)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    while eng.has_work():
        eng.step()
    assert [r.output_ids for r in reqs] == want[:6]


# ---- sampling: the speculative distribution equals transformers' ----------------------------------------------------

ALPHA = 1e-3  # the chi-square test's level
TV = 0.02  # the smallest total-variation error it must detect, with probability POWER
POWER = 0.9


def samples_needed(law):
    """The smallest n (a multiple of 1000) at which the chi-square test at level ALPHA rejects every law q with
    TV(q, law) >= TV with probability >= POWER. Pearson's statistic is then noncentral chi-square with
    lambda = n * sum((q - p)^2 / p) >= n * (2 TV)^2 (Cauchy-Schwarz: (sum |q - p|)^2 <= sum (q - p)^2 / p * sum p),
    whatever the shape of the error."""
    for n in range(1000, 200_001, 1000):
        _, df = chi_square_cells(law, n)
        if stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, n * (2 * TV) ** 2) >= POWER:
            return n
    raise AssertionError("no affordable sample size")


def chi_square_p(pairs, law):
    """p-value of the sampled pairs [n, 2] under law [V, V]; a sample of a probability-0 pair fails outright."""
    V = law.shape[0]
    counts = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    assert counts[law.reshape(-1) == 0].sum() == 0, "a token transformers' warpers filter out was sampled"
    return pearson_p(counts, law)


@pytest.fixture(scope="module")
def sampling_oracle():
    """The oracle's tiny target (vocabulary 6, window 4), a random drafter for it, and transformers' laws; the
    engine's target logits after the prompt and after prompt + [a] are checked equal to those the laws come from."""
    cfg, params = load_target(golden_path("sampling", "target"), "fp32")
    ref = load_reference("sampling")
    prompt = ref["prompt_ids"].tolist()
    ids = np.concatenate([np.tile(prompt, (cfg.vocab_size, 1)), np.arange(cfg.vocab_size)[:, None]], 1)
    cache = gemma4.init_dense_cache(cfg, cfg.vocab_size, ids.shape[1], jnp.float32)
    logits, _, _ = gemma4.dense_forward_jit(params, cfg, jnp.asarray(ids, jnp.int32), 0, cache)
    np.testing.assert_allclose(logits[0, -2], ref["logits_first"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[:, -1], ref["logits_second"], atol=1e-4, rtol=0)
    acfg = assistant_preset(cfg, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, ordered=False)
    return cfg, params, acfg, random_assistant_params(acfg, 4, jnp.float32), prompt, ref


def sample_pairs(oracle, runs):
    """The first two output tokens of n requests per (SamplingParams, n) in `runs`, all through one engine: t1 comes
    from the prefill, t2 from the first speculative round (its accepted draft or the residual sample). t2 depends
    only on the round's first verify row, so k = 1 (deeper rows run the same vectorised rule; a cheaper program).
    Also the device's committed count of every round (before the host cuts at max_new_tokens)."""
    cfg, params, acfg, aparams, prompt, _ = oracle
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=1, buckets=(1024,), max_running=1024, page_size=4,
                 max_context=16, prefill_chunk=8)
    counts, read = [], eng.runner.read

    def read_spy(out):
        host = read(out)
        counts.append(host[:, 0, -1])
        return host

    eng.runner.read = read_spy
    reqs = [[Request(prompt_ids=list(prompt), params=dataclasses.replace(sp, max_new_tokens=2, ignore_eos=True,
                                                                        seed=10**6 * i + j)) for j in range(n)]
            for i, (sp, n) in enumerate(runs)]
    eng.generate([r for rs in reqs for r in rs])
    counts = np.concatenate(counts)
    return [np.array([r.output_ids for r in rs]) for rs in reqs], counts[counts > 0]


def oracle_cases(ref):
    return [SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p)) for t, k, p in ref["sampling_cases"]]


def test_speculative_sampling_matches_transformers_law(sampling_oracle):
    """Speculative sampling draws the first two tokens with transformers' law: generate(do_sample=True)'s
    Temperature/TopK/TopP warpers, in its order, on the same tiny target (tests/oracle: `law_i`), for T 0.7, top-k 3
    at T 1, and T 1.5 with top-k 4 then top-p 0.8 (whose cut depends on that order). Per case, n samples so that
    the chi-square test at level 1e-3 rejects any law 0.02 away in total variation with probability >= 0.9
    (`samples_needed`: 33K for the 35 cells of T 0.7, two of its 36 pairs pooled, 21K for the 9 of the others); a
    pair the warpers exclude must never appear. t2 is the accepted draft in a fifth of the rounds and the residual
    sample in the rest, so both branches of the accept rule shape the law."""
    cases, ref = oracle_cases(sampling_oracle[-1]), sampling_oracle[-1]
    laws = [ref[f"law_{i}"] for i in range(len(cases))]
    ns = [samples_needed(law) for law in laws]
    pairs, committed = sample_pairs(sampling_oracle, list(zip(cases, ns)))
    ps = [chi_square_p(x, law) for x, law in zip(pairs, laws)]
    accepted = np.mean(committed == 2)
    print(f"samples {ns}; chi-square p {', '.join(f'{p:.3f}' for p in ps)}; drafts accepted {accepted:.3f}")
    assert 0.1 < accepted < 0.9  # measured 0.203 of 75K rounds: both branches carry a large share of the samples
    assert min(ps) > ALPHA, ps


def test_chi_square_catches_a_temperature_6_percent_off(sampling_oracle, monkeypatch):
    """The same test fails for speculative rounds that temper with 1.06 T: at T 0.7 their law of the two tokens
    (the oracle's `hot_law_0`) is 0.021 from the right one in total variation, just above the design limit."""
    ref = sampling_oracle[-1]
    assert 0.02 < 0.5 * np.abs(ref["hot_law_0"] - ref["law_0"]).sum() < 0.022
    real = sampling.accept
    monkeypatch.setattr(sampling, "accept", lambda logits, drafts, temperature, *a: real(
        logits, drafts, temperature * ref["hot"].item(), *a))
    (pairs,), _ = sample_pairs(sampling_oracle, [(oracle_cases(ref)[0], samples_needed(ref["law_0"]))])
    p_right, p_hot = chi_square_p(pairs, ref["law_0"]), chi_square_p(pairs, ref["hot_law_0"])
    print(f"6% hot sampler: chi-square p {p_right:.2e} against the right law, {p_hot:.3f} against the hot one")
    assert p_right < ALPHA and p_hot > ALPHA  # and what it sampled is the hot law


def test_stop_string_scan_is_exact_and_decodes_only_a_tail():
    """Stop strings: the request stops at the first token after which the whole output's text holds the stop string
    (the same token a full decode per token finds), and the per-token scan decodes only a bounded tail, so host work
    does not grow with the output (a full decode per token made long outputs quadratic)."""
    pieces = ["a", "bc", "", "d e", "S", "T", "OP", "xyz", "ST", "\u00e9"]  # "" : a token that decodes to nothing

    class Tok:
        lengths = []

        def decode(self, ids, skip_special_tokens=False):
            self.lengths.append(len(ids))
            return "".join(pieces[i] for i in ids)

    rng = np.random.default_rng(0)
    stream = rng.integers(0, len(pieces), 4000).tolist()
    for stop in (["STOP"], ["zz", "d eS"], ["never"]):
        want = next((n for n in range(1, len(stream) + 1)
                     if any(s in "".join(pieces[i] for i in stream[:n]) for s in stop)), None)
        tok = Tok()
        tok.lengths = []
        stopping = Stopping(eos=set(), tokenizer=tok, k=3, max_context=10**6)
        r = Request(prompt_ids=[0], params=SamplingParams(max_new_tokens=len(stream) + 1, stop=stop))
        for lo in range(0, len(stream), 4):  # rounds of up to 4 committed tokens
            stopping.commit(r, stream[lo:lo + 4], 0.0)
            if r.finish_reason:
                break
        if want is None:
            assert r.finish_reason is None and len(r.output_ids) == len(stream)
        else:
            assert r.finish_reason == "stop" and len(r.output_ids) == want, (stop, want, len(r.output_ids))
        scans = tok.lengths[:-2] if want else tok.lengths  # a hit adds the confirming and the final full decode
        assert max(scans) <= 4 * max(map(len, stop)) + 8
