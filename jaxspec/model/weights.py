"""Checkpoint loading (safetensors exactly as transformers writes them) and random initialisation.

Params are laid out in few leaves: per-layer weights of the same shape are stacked on a leading axis, one stack per
layer group (`TargetConfig.groups`), the four layer norms of a layer in one [4, H] row, gate/up in one [2I, H]
matrix. A jitted E4B forward takes ~55 array arguments instead of ~600 (each leaf costs ~1.6 µs of dispatch).
Matrices keep transformers' [out, in] layout. Norm weights, `layer_scalar` and router scales stay fp32 whatever the
compute dtype (Gemma 3's `1 + w` is folded in here).
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxspec.config import AssistantConfig, ConfigError, TargetConfig
from jaxspec.model import hf

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
_FLOAT_DTYPES = ("F32", "BF16", "F16")
_INT_DTYPES = ("I64", "I32")
INT_TENSORS = (hf.ASSISTANT_TENSORS["token_ordering"],)  # every other tensor holds weights: float, finite
F32_LEAVES = ("norms", "q_norm", "k_norm", "layer_scalar", "ple_norm", "moe_norms", "router_scale",
              "per_expert_scale", "final_norm", "ple_proj_norm")


def compute_dtype(name: str):
    if name not in DTYPES:
        raise ConfigError(f"unsupported dtype {name!r} (expected one of {', '.join(DTYPES)})")
    return DTYPES[name]


# ---- shapes --------------------------------------------------------------------------------------------------------


def layer_shapes(cfg: TargetConfig, group) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's weights in `group` (without the leading stack axis)."""
    i = group.layers[0]
    H, NH, d, kvh = cfg.hidden_size, cfg.num_heads, cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
    I = cfg.mlp_size(i)
    s = {
        "norms": (4, H),
        "q_proj": (NH * d, H),
        "q_norm": (d,),
        "o_proj": (H, NH * d),
        "gate_up": (2 * I, H),
        "down": (H, I),
        "layer_scalar": (),
    }
    if not group.reuse:
        s.update(k_proj=(kvh * d, H), k_norm=(d,))
        if cfg.has_v_proj(i):
            s["v_proj"] = (kvh * d, H)
    if cfg.hidden_size_per_layer_input:
        P = cfg.hidden_size_per_layer_input
        s.update(ple_gate=(P, H), ple_proj=(H, P), ple_norm=(H,))
    if cfg.enable_moe_block:
        E, Im = cfg.num_experts, cfg.moe_intermediate_size
        s.update(moe_norms=(3, H), router_proj=(E, H), router_scale=(H,), per_expert_scale=(E,),
                 experts_gate_up=(E, 2 * Im, H), experts_down=(E, H, Im))
    return s


def global_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    s = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,)}
    if cfg.hidden_size_per_layer_input:
        LP = cfg.num_layers * cfg.hidden_size_per_layer_input
        s.update(ple_embed=(cfg.vocab_size_per_layer_input, LP), ple_model_proj=(LP, cfg.hidden_size),
                 ple_proj_norm=(cfg.hidden_size_per_layer_input,))
    return s


def assistant_global_shapes(acfg: AssistantConfig) -> dict[str, tuple[int, ...]]:
    Ha, Ht, V = acfg.hidden_size, acfg.backbone_hidden_size, acfg.vocab_size
    s = {"embed": (V, Ha), "final_norm": (Ha,), "pre_projection": (Ha, 2 * Ht), "post_projection": (Ht, Ha)}
    if acfg.use_ordered_embeddings:
        if V % acfg.num_centroids:
            raise ConfigError(f"vocab_size {V} is not a multiple of num_centroids {acfg.num_centroids}")
        s.update(centroids=(acfg.num_centroids, Ha), token_ordering=(V,))
    return s


def _leaf_dtype(name: str, dtype):
    if name == "token_ordering":
        return jnp.int32
    return jnp.promote_types(dtype, jnp.float32) if name in F32_LEAVES else dtype


# ---- reading safetensors -------------------------------------------------------------------------------------------


def _open_safetensors(fn: str):
    try:
        return safe_open(fn, "numpy")
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{fn} is not a readable safetensors file ({e})") from None


class Checkpoint:
    """Name -> tensor access over a single-file or sharded safetensors checkpoint (numpy, lazily per tensor). A
    damaged file, index or tensor is a ConfigError naming it; weights are checked to be float and finite, since a
    NaN or an integer embedding would otherwise decode garbage without a word."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            listing = hf.read_json(index)
            weight_map = listing.get("weight_map") if isinstance(listing, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConfigError(f"{index} has no weight_map object of tensor name -> shard file")
            self.where = {k: os.path.join(path, v) for k, v in weight_map.items()}
            for fn in sorted(set(self.where.values())):
                if not os.path.isfile(fn):
                    raise ConfigError(f"checkpoint shard missing: {fn} (listed in {index})")
        elif os.path.isfile(single):
            with _open_safetensors(single) as f:
                self.where = {k: single for k in f.keys()}
        else:
            raise ConfigError(f"no model.safetensors or model.safetensors.index.json in {path}")
        self.path = path
        self._files: dict[str, object] = {}

    def _file(self, fn: str):
        if fn not in self._files:
            self._files[fn] = _open_safetensors(fn)
        return self._files[fn]

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if name not in self.where:
            raise ConfigError(f"missing tensor {name} in {self.path}")
        fn = self.where[name]
        f = self._file(fn)
        try:
            dtype = f.get_slice(name).get_dtype()
            if dtype not in _FLOAT_DTYPES + _INT_DTYPES:
                raise ConfigError(f"unsupported dtype {dtype} of tensor {name}")
            if (dtype in _INT_DTYPES) != (name in INT_TENSORS):
                want = "an integer" if name in INT_TENSORS else "a float"
                raise ConfigError(f"tensor {name} in {fn} has dtype {dtype}, expected {want} type")
            t = f.get_tensor(name)
        except SafetensorError as e:
            raise ConfigError(f"tensor {name} unreadable in {fn} ({e})") from None
        if shape is not None and tuple(t.shape) != tuple(shape) and not (shape == () and t.shape == (1,)):
            raise ConfigError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if dtype in _FLOAT_DTYPES and not np.isfinite(t).all():
            raise ConfigError(f"tensor {name} in {fn} holds NaN or infinite values")
        return t


def _detect_prefix(ck: Checkpoint) -> str:
    for p in hf.TARGET_PREFIXES:
        if ck.has(p + hf.TARGET_TENSORS["embed"]):
            return p
    raise ConfigError(f"missing tensor {hf.TEXT_PREFIX + hf.TARGET_TENSORS['embed']} in {ck.path}")


def _in_checkpoint(cfg: TargetConfig, name: str) -> bool:
    return not (name == "layer_scalar" and cfg.model_type == "gemma3_text")  # Gemma 3 has no layer_scalar


def _layer_tensor(ck: Checkpoint, cfg: TargetConfig, pre: str, name: str, shape) -> np.ndarray:
    """One layer's weight `name` (our layout) read from HF tensors under `pre` (e.g. 'model.layers.3.')."""
    if not _in_checkpoint(cfg, name):
        return np.ones((), np.float32)
    parts = [ck.get(pre + n, s) for n, s in hf.layer_tensor_shapes(name, shape).items()]
    return hf.join_layer_tensors(name, parts, shape)


def target_tensor_shapes(cfg: TargetConfig, prefix: str = hf.TEXT_PREFIX) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every tensor `load_target` reads from a checkpoint of `cfg` whose names start `prefix`."""
    out = {prefix + hf.TARGET_TENSORS[name]: shape for name, shape in global_shapes(cfg).items()}
    for group in cfg.groups:
        for name, shape in layer_shapes(cfg, group).items():
            if _in_checkpoint(cfg, name):
                out.update({hf.layer_prefix(prefix, i) + n: s for i in group.layers
                            for n, s in hf.layer_tensor_shapes(name, shape).items()})
    return out


def _fold_norm(cfg: TargetConfig, name: str, arr: np.ndarray) -> np.ndarray:
    if cfg.norm_plus_one and name in ("norms", "q_norm", "k_norm", "final_norm"):
        return arr.astype(np.float64) + 1.0  # rounded once, to the leaf dtype, as transformers' 1.0 + w.float()
    return arr


def _to_device(name: str, arr: np.ndarray, dtype):
    return jnp.asarray(arr, dtype=_leaf_dtype(name, dtype))


def _load_layers(ck: Checkpoint, cfg: TargetConfig, prefix: str, dtype) -> dict:
    layers = {}
    for group in cfg.groups:
        shapes = layer_shapes(cfg, group)
        layers[group.name] = {
            name: _to_device(name, np.stack([
                _fold_norm(cfg, name, _layer_tensor(ck, cfg, hf.layer_prefix(prefix, i), name, shape))
                for i in group.layers]), dtype)
            for name, shape in shapes.items()
        }
    return layers


def load_target(path: str, dtype="fp32") -> tuple[TargetConfig, dict]:
    """Config and params of a Gemma 4 / Gemma 3 text checkpoint (text-only or the multimodal wrapper).

    dtype: "bf16" | "fp32" (or a jnp dtype; tests use jnp.float64 under jax.enable_x64 for oracle comparisons).
    """
    dtype = compute_dtype(dtype) if isinstance(dtype, str) else dtype
    cfg = hf.load_target_config(path)
    ck = Checkpoint(path)
    prefix = _detect_prefix(ck)
    params = {name: _to_device(name, _fold_norm(cfg, name, ck.get(prefix + hf.TARGET_TENSORS[name], shape)), dtype)
              for name, shape in global_shapes(cfg).items()}
    params["layers"] = _load_layers(ck, cfg, prefix, dtype)
    return cfg, params


def load_assistant(path: str, dtype="fp32") -> tuple[AssistantConfig, dict]:
    """Config and params of a `gemma4_assistant` / `gemma4_unified_assistant` checkpoint. A plain head whose rows are
    mostly exactly zero (a distilled drafter's) also gets its compact form (`assistant.compact_head`)."""
    from jaxspec.model.assistant import compact_head

    dtype = compute_dtype(dtype) if isinstance(dtype, str) else dtype
    acfg = hf.load_assistant_config(path)
    ck = Checkpoint(path)
    params = {name: _to_device(name, ck.get(hf.ASSISTANT_TENSORS[name], shape), dtype)
              for name, shape in assistant_global_shapes(acfg).items()}
    params["layers"] = _load_layers(ck, acfg.text, hf.ASSISTANT_TEXT_PREFIX, dtype)
    return acfg, compact_head(params, acfg)


# ---- random initialisation (presets, demo model, tests) ---------------------------------------------------------


def _random_tree(shapes: dict, key, dtype, leaf_init: Callable) -> dict:
    out = {}
    for n, (name, shape) in enumerate(sorted(shapes.items())):
        out[name] = leaf_init(name, shape, jax.random.fold_in(key, n), dtype)
    return out


def _init_leaf(name, shape, key, dtype, *, stack: int | None = None, vocab: int = 0):
    full = (stack, *shape) if stack is not None else shape
    if name == "token_ordering":
        return jax.random.permutation(key, vocab).astype(jnp.int32)
    if name in ("norms", "q_norm", "k_norm", "ple_norm", "moe_norms", "router_scale", "per_expert_scale",
                "final_norm", "ple_proj_norm"):
        return 1.0 + 0.1 * jax.random.normal(key, full, jnp.float32)
    if name == "layer_scalar":
        return 0.5 + jax.random.uniform(key, full, jnp.float32)
    scale = 0.02 if name in ("embed", "ple_embed") else shape[-1] ** -0.5  # HF's initializer_range for embeddings
    return (scale * jax.random.normal(key, full, jnp.float32)).astype(dtype)


def random_target_params(cfg: TargetConfig, seed: int = 0, dtype=jnp.bfloat16) -> dict:
    """Random weights with the checkpoint's structure (for presets and the demo model), generated on the device."""
    key = jax.random.PRNGKey(seed)
    params = _random_tree(global_shapes(cfg), jax.random.fold_in(key, 1), dtype, _init_leaf)
    params["layers"] = {
        g.name: _random_tree(layer_shapes(cfg, g), jax.random.fold_in(key, 100 + gi), dtype,
                             lambda n, s, k, d, g=g: _init_leaf(n, s, k, d, stack=len(g.layers)))
        for gi, g in enumerate(cfg.groups)
    }
    return params


def random_assistant_params(acfg: AssistantConfig, seed: int = 0, dtype=jnp.bfloat16) -> dict:
    key = jax.random.PRNGKey(seed)
    params = _random_tree(assistant_global_shapes(acfg), jax.random.fold_in(key, 1), dtype,
                          lambda n, s, k, d: _init_leaf(n, s, k, d, vocab=acfg.vocab_size))
    params["layers"] = {
        g.name: _random_tree(layer_shapes(acfg.text, g), jax.random.fold_in(key, 100 + gi), dtype,
                             lambda n, s, k, d, g=g: _init_leaf(n, s, k, d, stack=len(g.layers)))
        for gi, g in enumerate(acfg.text.groups)
    }
    return params


def count_leaves(params) -> int:
    return len(jax.tree.leaves(params))
