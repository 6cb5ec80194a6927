"""The JAX target (dense cache) against transformers 5.24.0 on tiny random checkpoints (goldens from tests/oracle).

Two comparisons per case:
- float64: our model run in float64 against transformers' own modules run in float64 (`*64` goldens): within 1e-9.
  This is the exact-semantics check; every feature (PLE, KV sharing, MoE, k_eq_v, partial RoPE, ...) is covered.
- fp32 against transformers fp32: within 1e-4. The tiny random networks amplify fp32 rounding: our own fp32 result
  is up to 3.5e-5 from our float64 one, the same distance transformers' fp32 result has from its float64 one.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import bf16_not_exactly_rounded, golden_path, load_reference, on_gpu
from jaxspec.config import FULL, SLIDING, PRESETS, ConfigError, Rope
from jaxspec.model import gemma4, layers
from jaxspec.model.hf import load_target_config
from jaxspec.model.weights import count_leaves, global_shapes, layer_shapes, load_target

CASES = ["e2b", "moe", "dense31", "mm", "sharded", "gemma3"]
TOL = 1e-4  # fp32 vs fp32 (see the module docstring)
TOL64 = 1e-9


def run_dense(cfg, params, ids, dtype=jnp.float32):
    B, T = ids.shape
    cache = gemma4.init_dense_cache(cfg, B, T, dtype)
    logits, hidden, cache = gemma4.dense_forward_jit(params, cfg, jnp.asarray(ids, jnp.int32), 0, cache)
    return np.asarray(logits), np.asarray(hidden, np.float32), cache


@pytest.fixture(scope="module", params=CASES)
def case(request):
    name = request.param
    cfg, params = load_target(golden_path(name, "target"), "fp32")
    return name, cfg, params, load_reference(name)


def check_against(name, cache, logits, hidden, ref, suffix, tol):
    np.testing.assert_allclose(logits, ref["logits" + suffix], atol=tol, rtol=0)
    np.testing.assert_allclose(hidden, ref["hidden" + suffix], atol=tol, rtol=0)
    for t, short in ((FULL, "full"), (SLIDING, "sliding")):
        for kv in "kv":
            want = ref[f"store_{short}_{kv}{suffix}"].transpose(0, 2, 1, 3)  # HF [B, kvh, T, d] -> [B, T, kvh, d]
            got = np.asarray(getattr(cache[t], kv)[-1][:, : want.shape[1]])
            np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=f"{name} store {t} {kv}")


def test_forward_equals_transformers(case):
    name, cfg, params, ref = case
    assert ref["prompt_ids"].shape[1] > cfg.sliding_window
    logits, hidden, cache = run_dense(cfg, params, ref["prompt_ids"])
    check_against(name, cache, logits, hidden, ref, "", TOL)


@pytest.mark.parametrize("name", CASES)
def test_forward_equals_transformers_float64(name):
    with jax.enable_x64(True):
        cfg, params = load_target(golden_path(name, "target"), jnp.float64)
        ref = load_reference(name)
        ids = jnp.asarray(ref["prompt_ids"], jnp.int32)
        cache = gemma4.init_dense_cache(cfg, *ids.shape, jnp.float64)
        logits, hidden, cache = gemma4.dense_forward(params, cfg, ids, 0, cache)
        err = float(np.max(np.abs(np.asarray(logits) - ref["logits64"])))
        check_against(name, cache, np.asarray(logits), np.asarray(hidden), ref, "64", TOL64)
    print(f"{name}: float64 max |dlogits| vs transformers float64 = {err:.1e}")


def test_incremental_decode_equals_full_forward(case):
    """Prefill 11 tokens, then one token at a time through the window: the same logits as one full forward."""
    name, cfg, params, ref = case
    ids = jnp.asarray(ref["prompt_ids"], jnp.int32)
    full, _, _ = run_dense(cfg, params, ids)
    np.testing.assert_allclose(decode_one_at_a_time(cfg, params, ids), full, atol=TOL, rtol=0)


def decode_one_at_a_time(cfg, params, ids, prefill: int = 11):
    """Logits [B, T, V] of ids prefilled `prefill` tokens, then decoded one token a step (dense cache, fp32)."""
    B, T = ids.shape
    cache = gemma4.init_dense_cache(cfg, B, T, jnp.float32)
    out, _, cache = gemma4.dense_forward_jit(params, cfg, ids[:, :prefill], 0, cache)
    steps = [np.asarray(out)]
    for p in range(prefill, T):
        out, _, cache = gemma4.dense_forward_jit(params, cfg, ids[:, p : p + 1], p, cache)
        steps.append(np.asarray(out))
    return np.concatenate(steps, axis=1)


def test_one_row_decode_equals_transformers(case):
    """The first prompt alone, prefilled 11 tokens and then one token a step: one-row steps, which take their own
    forms (`layers.gated_ple`'s exp-form gelu; on the GPU `linear`'s one-row products), give transformers' logits."""
    name, cfg, params, ref = case
    logits = decode_one_at_a_time(cfg, params, jnp.asarray(ref["prompt_ids"][:1], jnp.int32))
    np.testing.assert_allclose(logits, ref["logits"][:1], atol=TOL, rtol=0)


def _broken_variants(cfg, params):
    yield "full RoPE instead of proportional", dataclasses.replace(cfg, rope_full=Rope(theta=cfg.rope_full.theta)), params
    ones = {g: dict(w, layer_scalar=jnp.ones_like(w["layer_scalar"])) for g, w in params["layers"].items()}
    yield "layer_scalar ignored", cfg, dict(params, layers=ones)
    yield "window off by one", dataclasses.replace(cfg, sliding_window=cfg.sliding_window + 1), params


def test_comparison_has_teeth():
    """Each deliberately broken variant of the E2B-style model must fail the 1e-5 comparison."""
    cfg, params = load_target(golden_path("e2b", "target"), "fp32")
    ref = load_reference("e2b")
    for what, bcfg, bparams in _broken_variants(cfg, params):
        logits, _, _ = run_dense(bcfg, bparams, ref["prompt_ids"])
        assert np.max(np.abs(logits - ref["logits"])) > 100 * TOL, what


def bf16_errors(logits, ref):
    """mean and max |logit - fp32 golden|, and the share of positions whose argmax agrees with the golden's."""
    d = np.abs(logits - ref["logits"])
    return float(d.mean()), float(d.max()), float(np.mean(logits.argmax(-1) == ref["logits"].argmax(-1)))


def test_bf16_close_to_fp32():
    """bf16 weights and activations against the fp32 golden, measured against the error bf16 rounding itself causes
    in this network: transformers' own bf16 forward of the same bf16 checkpoint (`logits_bf16`). Measured (the
    golden logits: std 0.40, max |logit| 1.61; bf16's epsilon 2^-7 = 0.0078): transformers' |dlogit| mean 0.0194
    (6 epsilons of the logit std), max 0.237, argmax agreement 36/40; jaxspec's mean 0.0187, max 0.332, 37/40.
    Bounds: mean within 1.5x and max within 2x of transformers' (the max is one extreme of 20 480 values, so it
    gets the wider margin), argmax agreement at most 2 positions below transformers'. Broken variants in bf16:
    layer_scalar ignored (mean 0.088, 24/40) and the window off by one (0.163, 22/40) fail every bound, full RoPE
    (0.023, 33/40) fails the argmax one; a 5% logit scale error (0.026) is within the bf16 noise here."""
    cfg, params = load_target(golden_path("e2b", "target_bf16"), "bf16")
    ref = load_reference("e2b")
    logits, _, _ = run_dense(cfg, params, ref["prompt_ids"], jnp.bfloat16)
    mean, err, agree = bf16_errors(logits, ref)
    hf_mean, hf_err, hf_agree = bf16_errors(ref["logits_bf16"], ref)
    print(f"bf16 vs fp32 golden: |dlogit| mean {mean:.4f}, max {err:.4f}, argmax agreement {agree:.3f}; "
          f"transformers bf16: {hf_mean:.4f}, {hf_err:.4f}, {hf_agree:.3f}")
    assert mean < 1.5 * hf_mean and err < 2 * hf_err and agree >= hf_agree - 2 / (logits.shape[0] * logits.shape[1])


def test_hub_style_config_reads_the_same(tmp_path):
    """Hub configs carry global_head_dim / num_global_key_value_heads instead of per_layer_config."""
    src = golden_path("dense31", "target")
    d = json.load(open(os.path.join(src, "config.json")))
    plc = d.pop("per_layer_config")
    full = next(v for v in plc.values() if "head_dim" in v)
    d["global_head_dim"] = full["head_dim"]
    d["num_global_key_value_heads"] = full["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert load_target_config(str(tmp_path)) == load_target_config(src)


def test_transformers_saved_config_with_no_full_layer_override(tmp_path):
    """transformers saves `per_layer_config: {}` (and no global_head_dim) when the full layers keep the sliding
    layers' head_dim and KV heads: those are the full geometry, not the hub default of 512."""
    src = golden_path("e2b", "target")
    d = json.load(open(os.path.join(src, "config.json")))
    d["per_layer_config"] = {}
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = load_target_config(str(tmp_path))
    assert (cfg.global_head_dim, cfg.num_global_kv_heads) == (cfg.head_dim, cfg.num_kv_heads) == (16, d[
        "num_key_value_heads"])
    assert load_target_config(src).global_head_dim == 32  # the golden's own override still applies


def test_e4b_params_fit_few_leaves():
    cfg = PRESETS["E4B"]
    n = len(global_shapes(cfg)) + sum(len(layer_shapes(cfg, g)) for g in cfg.groups)
    assert n <= 64, n
    assert cfg.store_layers == {SLIDING: 22, FULL: 23}
    cfg, params = load_target(golden_path("e2b", "target"), "fp32")
    assert count_leaves(params) == len(global_shapes(cfg)) + sum(len(layer_shapes(cfg, g)) for g in cfg.groups)


def _copy(tmp_path, case="e2b"):
    dst = tmp_path / case
    shutil.copytree(golden_path(case, "target"), dst)
    return dst


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_target(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_target(str(tmp_path / "empty"))
    d = _copy(tmp_path)
    cfgd = json.load(open(d / "config.json"))
    (d / "config.json").write_text(json.dumps(dict(cfgd, model_type="llama")))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        load_target(str(d))
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed"):
        load_target(str(d))
    (d / "config.json").write_text(json.dumps(cfgd))
    with pytest.raises(ConfigError, match="unsupported dtype 'fp8'"):
        load_target(str(d), "fp8")


def _rewrite_tensors(path, fn):
    from safetensors.numpy import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    tensors = fn(load_file(f))
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_and_misshapen_tensors(tmp_path):
    d = _copy(tmp_path)
    _rewrite_tensors(d, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.self_attn.q_proj.weight"})
    with pytest.raises(ConfigError, match=r"missing tensor model\.layers\.1\.self_attn\.q_proj\.weight"):
        load_target(str(d))
    d = _copy(tmp_path / "b")
    _rewrite_tensors(d, lambda t: dict(t, **{"model.layers.0.mlp.down_proj.weight":
                                             t["model.layers.0.mlp.down_proj.weight"][:, :-1]}))
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.down_proj\.weight has shape \(64, 127\), "
                                          r"expected \(64, 128\)"):
        load_target(str(d))
    d = _copy(tmp_path / "c")
    _rewrite_tensors(d, lambda t: dict(t, **{"model.norm.weight": t["model.norm.weight"].astype(np.int8)}))
    with pytest.raises(ConfigError, match="unsupported dtype I8"):
        load_target(str(d))


def test_fused_qkv_equals_transformers(case):
    """gemma4.fuse_qkv (the engine's default on one device): one q/k/v stack per layer group instead of three gives
    transformers' logits, hidden states and stored K/V, for every checkpoint (KV sharing, k_eq_v, MoE, Gemma 3)."""
    name, cfg, params, ref = case
    fused = gemma4.fuse_qkv(params)
    groups = fused["layers"].values()
    assert any("qkv_proj" in g for g in groups) and not any("k_proj" in g or "v_proj" in g for g in groups)
    logits, hidden, cache = run_dense(cfg, fused, ref["prompt_ids"])
    check_against(name, cache, logits, hidden, ref, "", TOL)


def test_fused_qkv_comparison_has_teeth():
    """The fused stack's rows in another order (V's before K's) fail the comparison: the split is checked."""
    cfg, params = load_target(golden_path("e2b", "target"), "fp32")
    ref = load_reference("e2b")
    swapped = {g: dict(w, k_proj=w["v_proj"], v_proj=w["k_proj"]) if "v_proj" in w else w
               for g, w in params["layers"].items()}
    logits, _, _ = run_dense(cfg, gemma4.fuse_qkv(dict(params, layers=swapped)), ref["prompt_ids"])
    assert np.max(np.abs(logits - ref["logits"])) > 100 * TOL


def run_joint(cfg, params, ids, monkeypatch, switch="1"):
    """run_dense with JAXSPEC_JOINT_QK_NORM set (read when the forward is traced: a fresh jit)."""
    monkeypatch.setenv("JAXSPEC_JOINT_QK_NORM", switch)
    cache = gemma4.init_dense_cache(cfg, *ids.shape, jnp.float32)
    logits, hidden, cache = jax.jit(gemma4.dense_forward, static_argnums=(1,))(params, cfg, jnp.asarray(ids, jnp.int32),
                                                                              0, cache)
    return np.asarray(logits), np.asarray(hidden, np.float32), cache


def test_joint_qk_norm_equals_separate_norms(case, monkeypatch):
    """JAXSPEC_JOINT_QK_NORM=1 (`gemma4.joint_qkv`): q's, k's (and v's) heads normed and rotated as one array give
    the same logits, hidden states and stored K/V as the separate norms, bit for bit on the CPU (every element goes
    through the same operations), for every checkpoint (KV sharing, k_eq_v, MoE, no v-norm in Gemma 3)."""
    name, cfg, params, ref = case
    fused = gemma4.fuse_qkv(params)
    want = run_joint(cfg, fused, ref["prompt_ids"], monkeypatch, "0")
    got = run_joint(cfg, fused, ref["prompt_ids"], monkeypatch)
    tol = 0 if jax.default_backend() == "cpu" else TOL
    np.testing.assert_allclose(got[0], want[0], atol=tol, rtol=0)
    np.testing.assert_allclose(got[1], want[1], atol=tol, rtol=0)
    for t in want[2]:
        for kv in "kv":
            np.testing.assert_allclose(getattr(got[2][t], kv), getattr(want[2][t], kv), atol=tol, rtol=0)
    check_against(name, got[2], got[0], got[1], ref, "", TOL)


def test_joint_qk_norm_comparison_has_teeth(monkeypatch):
    """The joint norm with k's heads weighted by q_norm (a concatenation in the wrong order) fails the comparison."""
    cfg, params = load_target(golden_path("e2b", "target"), "fp32")
    ref = load_reference("e2b")
    fused = gemma4.fuse_qkv(params)
    wrong = {g: dict(w, k_norm=w["q_norm"]) if "qkv_proj" in w else w for g, w in fused["layers"].items()}
    logits, _, _ = run_joint(cfg, dict(fused, layers=wrong), ref["prompt_ids"], monkeypatch)
    assert np.max(np.abs(logits - ref["logits"])) > 100 * TOL


def test_stored_params_fuse_once_and_only_on_one_device(case, monkeypatch):
    """gemma4.stored_params, which the loaders call: on one device one q/k/v stack (and stored weights come back as
    they are, so an engine built on them holds the caller's arrays, not a second copy beside them); with
    JAXSPEC_FUSE_QKV=0 three stacks; split over devices three stacks, and fused ones are a ConfigError."""
    name, cfg, params, ref = case
    monkeypatch.delenv("JAXSPEC_FUSE_QKV", raising=False)
    stored = gemma4.stored_params(params)
    assert gemma4.is_fused(stored) and not gemma4.is_fused(params)
    again = gemma4.stored_params(stored)
    for group, weights in stored["layers"].items():
        assert all(again["layers"][group][n] is a for n, a in weights.items())
    assert gemma4.stored_params(params, 2) is params
    with pytest.raises(ConfigError, match="three projection stacks"):
        gemma4.stored_params(stored, 2)
    monkeypatch.setenv("JAXSPEC_FUSE_QKV", "0")
    assert gemma4.stored_params(params) is params


def outputs_not_exactly_rounded(product, x, w) -> int:
    return bf16_not_exactly_rounded(jax.jit(product)(x, w), x, w)


def one_row_operands():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 1, 2560)).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.PRNGKey(1), (1024, 2560)) * 2560**-0.5).astype(jnp.bfloat16)
    return x, w


def test_one_row_product_keeps_every_term_exact():
    """What `layers.linear` runs on the GPU for a one-row bf16 product that XLA would strength-reduce: its outputs are
    the exact products' sums rounded once (at most 1 in 200 across a tie by the fp32 sum's order), and `linear`'s too.
    The plain dot is exact on the CPU; on the GPU XLA's rewrite multiplies in bf16 (212 of 512 outputs more than half
    an ulp off on the H100, BENCHMARKS.md session 34), which is what `linear` avoids there."""
    x, w = one_row_operands()
    assert w.size <= layers.STRENGTH_REDUCED_MAX
    assert outputs_not_exactly_rounded(layers.one_row_product, x, w) <= 5
    assert outputs_not_exactly_rounded(layers.linear, x, w) <= 5
    off = outputs_not_exactly_rounded(layers.dot, x, w)
    assert off > 100 if on_gpu() else off <= 5, off
    np.testing.assert_array_equal(np.asarray(jax.jit(layers.linear)(x, w), np.float32),
                                  np.asarray(jax.jit(layers.one_row_product if on_gpu() else layers.dot)(x, w),
                                             np.float32))


def test_one_row_product_check_has_teeth():
    """The check above fails a product whose terms are rounded to bf16 before the fp32 sum (XLA's rewrite on the
    GPU, written out with `reduce_precision`, which no compiler pass removes)."""
    x, w = one_row_operands()

    def rounded_terms(x, w):
        terms = x.astype(jnp.float32)[..., None, :] * w.astype(jnp.float32)
        return jnp.sum(jax.lax.reduce_precision(terms, exponent_bits=8, mantissa_bits=7), axis=-1).astype(x.dtype)
    assert outputs_not_exactly_rounded(rounded_terms, x, w) > 100


def gelu_error(gelu) -> tuple[float, float]:
    """(the largest absolute error in fp64, in fp32) of `gelu` against the tanh approximation 0.5 x (1 + tanh(t)),
    t = sqrt(2/pi) (x + 0.044715 x^3), computed in fp64 from the same inputs, over x in [-20, 20]."""
    x64 = np.linspace(-20.0, 20.0, 80001)

    def exact(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    with jax.enable_x64(True):
        e64 = float(np.max(np.abs(np.asarray(gelu(jnp.asarray(x64, jnp.float64))) - exact(x64))))
    x32 = np.asarray(x64, np.float32)
    e32 = float(np.max(np.abs(np.asarray(gelu(jnp.asarray(x32)), np.float64) - exact(x32.astype(np.float64)))))
    return e64, e32


def is_tanh_gelu(gelu) -> bool:
    """The check: within rounding of the tanh approximation in fp64, within 1e-6 in fp32."""
    e64, e32 = gelu_error(gelu)
    return e64 < 1e-12 and e32 < 1e-6


def test_gelu_is_the_tanh_approximation():
    """`layers.gelu_tanh_exp`, written x / (1 + exp(-2t)) so that XLA fuses it into the one-row product that reads it
    (BENCHMARKS.md session 38), is transformers' gelu_pytorch_tanh as `gelu_tanh` is: in fp64 to rounding, in fp32
    within 1e-6 (as close as jax.nn.gelu's tanh form, 7.8e-7), and its outputs stay finite at the range's ends; a
    one-row `gated_ple` takes it, a many-row one the tanh form, both within 1e-6 of each other in fp32."""
    assert is_tanh_gelu(layers.gelu_tanh_exp) and is_tanh_gelu(layers.gelu_tanh)
    assert gelu_error(layers.gelu_tanh_exp)[1] < 2 * gelu_error(layers.gelu_tanh)[1]
    x = jnp.asarray([-1e4, -50.0, 50.0, 1e4], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(layers.gelu_tanh_exp(x), np.float32),
                                  [0.0, 0.0, 50.0, float(x[3])])
    gate = jax.random.normal(jax.random.PRNGKey(0), (4, 1, 256)) * 3
    ple = jax.random.normal(jax.random.PRNGKey(1), (4, 1, 256))
    rows = jnp.concatenate([layers.gated_ple(gate[i:i + 1], ple[i:i + 1]) for i in range(4)])
    np.testing.assert_allclose(np.asarray(rows), np.asarray(layers.gated_ple(gate, ple)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("broken", ["half_exponent", "cubic_constant", "erf_gelu"])
def test_gelu_check_has_teeth(broken):
    """The check above fails near misses: exp(-t) for exp(-2t) (the tanh-to-sigmoid identity's factor lost), a
    rounded cubic constant (0.0447), and the exact erf GELU instead of the tanh approximation."""
    c = 2 * np.sqrt(2 / np.pi)
    forms = {
        "half_exponent": lambda x: x / (1 + jnp.exp(-(x + 0.044715 * x**3) * c / 2)),
        "cubic_constant": lambda x: x / (1 + jnp.exp(-(x + 0.0447 * x**3) * c)),
        "erf_gelu": lambda x: jax.nn.gelu(x, approximate=False),
    }
    assert not is_tanh_gelu(forms[broken])
