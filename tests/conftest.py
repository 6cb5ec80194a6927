import os
import shutil

# CPU compiles dominate the suite's time; LLVM optimisation level 0 keeps IEEE semantics and compiles ~3x faster.
_platforms = os.environ.get("JAX_PLATFORMS", "")
if _platforms == "cpu" or (not _platforms and shutil.which("nvidia-smi") is None):
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.config import FULL, PRESETS, SLIDING, assistant_preset
from jaxspec.engine import Engine, Request, SamplingParams
from jaxspec.model.weights import load_assistant, load_target, random_assistant_params, random_target_params

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="session")
def no_compile_cache_in_the_test_process():
    """CLI entry points called in-process (generate's main) would turn JAX's persistent compilation cache on for the
    rest of the session, so later tests would load programs that earlier ones wrote: keep this process hermetic.
    Subprocesses (the CLI tests, tests/test_cache.py) use the cache as a user's run does."""
    import jaxspec.cache

    with pytest.MonkeyPatch.context() as m:
        m.setattr(jaxspec.cache, "enable_compile_cache", lambda: None)
        yield

# Fixtures shared by several tests that take 10-120 s to build (a plain greedy reference, converted GGUF models,
# runs of the CLI or of a server). Under `-n 2` pytest-xdist hands tests out one by one, and a module- or
# session-scoped fixture is built once per worker that runs a test needing it: twice when its tests land on both.
# `--dist loadgroup` (the README's test command) keeps each such fixture's tests on one worker.
SHARED_FIXTURES = {"plain_reference", "runs", "outcomes", "interrupts", "model_dir", "server", "tiny", "trained",
                   "engine_drafts", "with_tokenizer", "sampling_oracle", "source", "tiny_real"}


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the marks into the tests' ids
def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        shared = sorted(SHARED_FIXTURES.intersection(getattr(item, "fixturenames", ())))
        if shared:  # the session-scoped reference across modules; the rest are module-scoped
            key = "plain_reference" if "plain_reference" in shared else item.module.__name__
            item.add_marker(pytest.mark.xdist_group(key))


GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def golden_path(*parts) -> str:
    return os.path.join(GOLDEN, *parts)


def load_reference(case: str) -> dict:
    path = golden_path(case, "reference.npz")
    if not os.path.isfile(path):
        pytest.fail(f"golden file {path} missing: run tests/oracle/make_goldens.py (see tests/oracle/README.md)")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def bf16_not_exactly_rounded(got, x, w) -> int:
    """How many outputs `got` of the product x @ w.T (bf16 operands) are more than half a bf16 ulp from the fp64
    product of the same values (0 when each is the exact sum rounded once; an fp32 sum's own rounding moves an output
    across a tie only rarely)."""
    exact = np.asarray(x, np.float64).reshape(-1, x.shape[-1]) @ np.asarray(w, np.float64).T
    got = np.asarray(got, np.float64).reshape(exact.shape)
    half_ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - 8)
    return int((np.abs(got - exact) > half_ulp * (1 + 1e-6)).sum())


def check_outputs(got, want, dtype, *, bf16_atol: float, fp32_tol: float, same_shapes: bool = True):
    """A kernel's outputs (a tuple, None where an output is absent) against its reference's: bf16 within one bf16 step
    (rtol 2^-7, atol `bf16_atol` × the largest |value|), fp32 within `fp32_tol` relative."""
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is None:
            continue
        if same_shapes:
            assert g.shape == w.shape and g.dtype == w.dtype
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if dtype == jnp.bfloat16:
            np.testing.assert_allclose(g, w, rtol=2**-7, atol=bf16_atol * np.abs(w).max())
        else:
            np.testing.assert_allclose(g, w, rtol=fp32_tol, atol=fp32_tol * np.abs(w).max())


# ---- Pearson's chi-square test of sampled counts against a law -------------------------------------------------------


def chi_square_cells(law, n):
    """The cells of the Pearson test for n samples: those expected >= 5 times, the rarer ones pooled into one."""
    expected = law.reshape(-1) * n
    keep = expected >= 5
    pooled = expected[~keep].sum() > 0
    return keep, int(keep.sum()) + int(pooled) - 1  # and the degrees of freedom


def pearson_p(counts, law):
    """p-value of `counts` (flat, one per cell of `law`) under `law`, the rare cells pooled (`chi_square_cells`)."""
    n = counts.sum()
    keep, _ = chi_square_cells(law, n)
    expected = law.reshape(-1) * n
    obs, exp = np.append(counts[keep], counts[~keep].sum()), np.append(expected[keep], expected[~keep].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


# ---- the engine's shared fixtures: golden pairs, mixed prompts, plain greedy decoding as the reference ---------------

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def pair(case="e2b", head="assistant"):
    cfg, params = load_target(golden_path(case, "target"), "fp32")
    acfg, aparams = load_assistant(golden_path(case, head), "fp32")
    return cfg, params, acfg, aparams


def run(engine, prompts, sp=GREEDY):
    reqs = [Request(prompt_ids=list(p), params=sp) for p in prompts]
    engine.generate(reqs)
    return [r.output_ids for r in reqs], reqs


def mixed_prompts(cfg, n, seed):
    rng = np.random.default_rng(seed)
    W = cfg.sliding_window
    lengths = rng.choice([1, 2, W - 1, W, W + 1, 2 * W + 1, 3 * W + 5, 40], size=n)
    return [rng.integers(3, cfg.vocab_size, int(L)).tolist() for L in lengths]


@pytest.fixture(scope="session")
def plain_reference():
    """Plain greedy decoding of the target alone (draft off, one round per call, no overlap: the simplest path) for
    the 250 prompts of the lossless sweeps."""
    cfg, params, _, _ = pair()
    prompts = mixed_prompts(cfg, 250, seed=0)
    eng = Engine(cfg, params, draft_mode="off", buckets=(1, 4, 16), max_running=16, page_size=4, max_context=96,
                 prefill_chunk=8, rounds_per_call=1, overlap=False)
    outs, _ = run(eng, prompts, dataclasses.replace(GREEDY, max_new_tokens=20))
    return prompts, outs


def tiny_vocab_pair(V=6, heads=2, kv_heads=1):
    """A random pair over a vocabulary of V tokens, whose drafts often match: rounds commit several tokens. heads,
    kv_heads: the target's query and K/V heads (the drafter has as many query heads as the target)."""
    base = dataclasses.replace(
        PRESETS["E4B"], vocab_size=V, vocab_size_per_layer_input=V, hidden_size=32, intermediate_size=64,
        num_layers=3, num_heads=heads, num_kv_heads=kv_heads, num_global_kv_heads=kv_heads, head_dim=16,
        global_head_dim=16, layer_types=(SLIDING, FULL, FULL), sliding_window=4, hidden_size_per_layer_input=0,
        num_kv_shared_layers=1)
    params = random_target_params(base, 3, jnp.float32)
    params["embed"] = params["embed"] * 15.0  # logits of std ~2: far from uniform, yet every token is plausible
    acfg = assistant_preset(base, hidden_size=16, num_layers=1, num_heads=heads, intermediate_size=32, ordered=False)
    return base, params, acfg, random_assistant_params(acfg, 4, jnp.float32)


# ---- what the page pool holds, read from its bookkeeping (tests only) -------------------------------------------------


def full_pages_of(pool, rid) -> int:
    return len(pool._requests[rid].full_pages)


def swa_pages_of(pool, rid) -> int:
    return len(pool._requests[rid].swa_pages)


def owned_full_pages(pool) -> set[int]:
    return {p for r in pool._requests.values() for p in r.full_pages}


def owned_swa_pages(pool) -> set[int]:
    return {p for r in pool._requests.values() for p in r.swa_pages.values()}
