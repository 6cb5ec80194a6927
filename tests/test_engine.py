"""The engine: lossless speculative decoding, equality with transformers' greedy generation, sampling by chi-square."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import GREEDY, golden_path, load_reference, mixed_prompts, pair, run, tiny_vocab_pair
from jaxspec import sampling
from jaxspec.engine import Engine, Request, SamplingParams
from jaxspec.engine.stopping import Stopping
from jaxspec.model.weights import load_assistant, load_target

# ---- against transformers' own greedy generation ------------------------------------------------------------------


@pytest.mark.parametrize("case,head,mode", [("e2b", "assistant", "bucketed"), ("moe", "assistant", "eager"),
                                            ("dense31", "assistant", "bucketed"), ("gemma3", None, "off"),
                                            ("mm", None, "off")])
def test_greedy_equals_transformers_generate(case, head, mode):
    cfg, params = load_target(golden_path(case, "target"), "fp32")
    acfg = aparams = None
    if head:
        acfg, aparams = load_assistant(golden_path(case, head), "fp32")
    ref = load_reference(case)
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, draft_mode=mode, buckets=(4,), max_running=4,
                 page_size=4, max_context=64, prefill_chunk=8)
    prompts = [ref[f"greedy_prompt_{i}"][0].tolist() for i in range(4)]
    outs, _ = run(eng, prompts)
    for i, out in enumerate(outs):
        want = ref[f"greedy_out_{i}"][0, len(prompts[i]):].tolist()
        assert out == want, f"{case} prompt {i}"


# ---- lossless: speculative greedy == plain greedy -------------------------------------------------------------------


LOSSLESS = [
    # k, draft mode, head, max running, full pages (None: no pressure), buckets, Pallas kernels (interpret on CPU),
    # rounds per decode call, overlap (the eager reference always runs one round a call without overlap)
    (1, "bucketed", "assistant", 16, None, (1, 2, 4, 8, 16), False, 16, False),
    (2, "eager", "assistant_plain", 4, None, (1, 4), False, 1, False),
    (3, "bucketed", "assistant_plain", 8, 40, (1, 4, 8), False, 2, True),
    (5, "eager", "assistant", 3, 40, (1, 4), False, 1, False),
    (3, "bucketed", "assistant", 16, 60, (16,), True, 8, True),
]


@pytest.mark.parametrize("k,mode,head,running,pages,buckets,kernels,rounds,overlap", LOSSLESS)
def test_speculative_greedy_is_lossless(plain_reference, k, mode, head, running, pages, buckets, kernels, rounds,
                                        overlap):
    """Token for token equal to plain greedy: 50 prompts per configuration (250 over the sweep, many longer than
    the window), continuous batching, k in {1,2,3,5}, both draft modes, both heads, 1 to 16 rounds per decode call
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


# ---- sampling: the speculative distribution equals the target's -------------------------------------------------------


def exact_triples(cfg, params, prompt, sp, V):
    """P(t1, t2, t3) of sampling the target alone, from its filtered next-token distributions."""
    eng = Engine(cfg, params, draft_mode="off", buckets=(V,), max_running=V, page_size=4, max_context=32,
                 prefill_chunk=8)
    from jaxspec.model import gemma4

    def dist(prefixes):
        out = []
        for p in prefixes:
            cache = gemma4.init_dense_cache(cfg, 1, len(p), jnp.float32)
            lg, _, _ = gemma4.dense_forward(params, cfg, jnp.asarray([p], jnp.int32), 0, cache)
            probs = sampling.filtered_probs(lg[:, -1], jnp.full((1,), sp.temperature), jnp.full((1,), sp.top_k),
                                            jnp.full((1,), sp.top_p))
            out.append(np.asarray(probs[0], np.float64))
        return out
    del eng
    p1 = dist([prompt])[0]
    p2 = dist([prompt + [a] for a in range(V)])
    p3 = dist([prompt + [a, b] for a in range(V) for b in range(V)])
    joint = np.zeros((V, V, V))
    for a in range(V):
        for b in range(V):
            joint[a, b] = p1[a] * p2[a][b] * p3[a * V + b]
    return joint


def sample_triples(cfg, params, acfg, aparams, prompt, sp, n, mode):
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=2, draft_mode=mode, buckets=(64,), max_running=64,
                 page_size=4, max_context=32, prefill_chunk=8)
    reqs = [Request(prompt_ids=list(prompt), params=dataclasses.replace(sp, seed=1000 + i)) for i in range(n)]
    eng.generate(reqs)
    return np.array([r.output_ids[:3] for r in reqs]), eng.summary(reqs)


def chi_square_p(triples, joint, V):
    counts = np.zeros(V**3)
    np.add.at(counts, triples[:, 0] * V * V + triples[:, 1] * V + triples[:, 2], 1)
    expected = joint.reshape(-1) * len(triples)
    keep = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs, exp = counts[keep], expected[keep]
    if expected[~keep].sum() > 0:
        obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, expected[~keep].sum())
    assert counts[expected == 0].sum() == 0, "a sample the target gives probability 0"
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


# 5 new tokens, of which the first 3 are compared: with only 3, this pair's first round (which rarely accepts) leaves
# one token of room for the second, and the committed accept lengths could not show an acceptance
SAMPLING = SamplingParams(max_new_tokens=5, temperature=1.0, top_k=5, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def sampling_setup():
    cfg, params, acfg, aparams = tiny_vocab_pair()
    prompt = [1, 4, 2, 3, 0, 5, 2]
    return cfg, params, acfg, aparams, prompt, exact_triples(cfg, params, prompt, SAMPLING, cfg.vocab_size)


def test_speculative_sampling_matches_the_target_distribution(sampling_setup):
    """4000 sampled continuations with k=2 speculation: the joint law of the first three tokens equals the target's
    exact one (chi-square p > 0.001; fixed seeds). Drafts get accepted and rejected, so the residual is exercised."""
    cfg, params, acfg, aparams, prompt, joint = sampling_setup
    triples, s = sample_triples(cfg, params, acfg, aparams, prompt, SAMPLING, 4000, "bucketed")
    p = chi_square_p(triples, joint, cfg.vocab_size)
    print(f"chi-square p = {p:.3f}, mean accept length {s['mean_accept_length']:.2f}")
    assert 1.05 < s["mean_accept_length"] < 2.9  # both acceptances and rejections happen
    assert p > 1e-3


def test_chi_square_catches_a_wrong_residual(sampling_setup, monkeypatch):
    """The same test fails for a rejection sampler whose residual keeps the rejected draft."""
    cfg, params, acfg, aparams, prompt, joint = sampling_setup
    real = sampling.accept

    def wrong(logits, drafts, temperature, top_k, top_p, keys):
        n, committed = real(logits, drafts, temperature, top_k, top_p, keys)
        # resample the bonus from p_n itself (the rejected draft not removed)
        probs = sampling.filtered_probs(logits, temperature, top_k, top_p)
        p_n = jnp.take_along_axis(probs, n[:, None, None], axis=1)[:, 0]
        bad = jax.vmap(lambda kk, p: jax.random.categorical(kk, jnp.log(p)))(keys, p_n).astype(jnp.int32)
        return n, committed.at[jnp.arange(n.shape[0]), n].set(bad)

    monkeypatch.setattr(sampling, "accept", wrong)
    triples, _ = sample_triples(cfg, params, acfg, aparams, prompt, SAMPLING, 4000, "bucketed")
    assert chi_square_p(triples, joint, cfg.vocab_size) < 1e-3


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
