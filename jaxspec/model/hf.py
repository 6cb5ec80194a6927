"""The Hugging Face checkpoint format, read and written in one place: `config.json` <-> TargetConfig /
AssistantConfig (hub and transformers-saved styles of gemma4, gemma4_text, gemma4_unified, gemma3_text and the
assistants; the config.json of a drafter that `jaxspec.distill` trains), and the one table of tensor names: which
HF tensors make each jaxspec param leaf (`model.weights` reads them, `model.packed` writes them, `model.gguf` maps
llama.cpp's names onto them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any

import numpy as np

from jaxspec.config import (
    ASSISTANT_TYPES,
    FULL,
    SLIDING,
    TARGET_TYPES,
    AssistantConfig,
    ConfigError,
    Rope,
    TargetConfig,
    read_utf8,
)

# ---- reading config.json ------------------------------------------------------------------------------------------

_REQUIRED = object()


def _field(d: dict, key: str, types: tuple, what: str, default):
    """d[key] when it has one of `types` (JSON's true is not a number, nor 1 a boolean); null or absent: `default`
    (absent and required: KeyError, reported as the missing field)."""
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    if isinstance(v, bool) != (bool in types) or not isinstance(v, types):
        raise ConfigError(f"{key} must be {what}, got {v!r}")
    return v


def _int(d: dict, key: str, default=_REQUIRED) -> int:
    v = _field(d, key, (numbers.Integral,), "an integer", default)
    return v if v is None else int(v)


def _float(d: dict, key: str, default=_REQUIRED) -> float:
    v = _field(d, key, (numbers.Real,), "a number", default)
    if v is not None and not math.isfinite(v):
        raise ConfigError(f"{key} must be a finite number, got {v!r}")
    return v if v is None else float(v)


def _bool(d: dict, key: str, default: bool) -> bool:
    return _field(d, key, (bool,), "true or false", default)


def _dict(d: dict, key: str) -> dict:
    return _field(d, key, (dict,), "an object", {})


def _rope_from(rp: dict | None, default: Rope) -> Rope:
    if not rp:
        return default
    if not isinstance(rp, dict):
        raise ConfigError(f"rope_parameters entries must be objects, got {rp!r}")
    theta = _float(rp, "rope_theta", default.theta)
    kind = rp.get("rope_type", "default")
    if kind == "proportional":
        return Rope(theta=theta, partial_factor=_float(rp, "partial_rotary_factor", 1.0),
                    scale=_float(rp, "factor", 1.0))
    if kind == "linear":
        return Rope(theta=theta, scale=_float(rp, "factor", 1.0))
    if kind == "default":
        return Rope(theta=theta)
    raise ConfigError(f"unsupported rope_type {kind!r}")


def _eos(d: dict) -> tuple[int, ...]:
    if "eos_token_id" not in d:
        return (1,)
    e = d["eos_token_id"]
    ids = e if isinstance(e, (list, tuple)) else [] if e is None else [e]
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise ConfigError(f"eos_token_id must be an integer or a list of integers, got {e!r}")
    return tuple(int(t) for t in ids)


def _layer_override(d: dict, i: int) -> dict:
    return _dict(_dict(d, "per_layer_config"), str(i))


def target_config_from_dict(d: dict[str, Any]) -> TargetConfig:
    mt = d.get("model_type")
    if mt in ("gemma4", "gemma4_unified"):
        if not isinstance(d.get("text_config"), dict):
            raise ConfigError(f"config of model_type {mt!r} has no text_config object")
        td = dict(d["text_config"])
        td.setdefault("model_type", mt + "_text")
        for k in ("eos_token_id", "pad_token_id", "bos_token_id"):
            if k in d and k not in td:
                td[k] = d[k]
        return target_config_from_dict(td)
    if mt not in TARGET_TYPES:
        raise ConfigError(f"unsupported model_type {mt!r} (expected one of {', '.join(TARGET_TYPES)})")
    try:
        return _text_config(d, mt)
    except KeyError as e:
        raise ConfigError(f"{mt} config lacks the field {e.args[0]!r}") from None


def _text_config(d: dict, mt: str, validate: bool = True) -> TargetConfig:
    L = _int(d, "num_hidden_layers")
    gemma3 = mt == "gemma3_text"
    layer_types = d.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise ConfigError(f"layer_types must be a list of strings, got {layer_types!r}")
    if not layer_types:
        pattern = _int(d, "sliding_window_pattern", 6)
        if pattern < 1:
            raise ConfigError(f"sliding_window_pattern must be >= 1, got {pattern}")
        layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(L)]
        if not gemma3:
            layer_types[-1] = FULL
    layer_types = tuple(layer_types)
    if len(layer_types) != L:
        raise ConfigError(f"layer_types has {len(layer_types)} entries for {L} layers")
    head_dim = _int(d, "head_dim", 256)
    kvh = _int(d, "num_key_value_heads")
    k_eq_v = _bool(d, "attention_k_eq_v", False)
    # Full-layer geometry: transformers-saved configs carry a sparse per_layer_config; hub configs carry
    # global_head_dim / num_global_key_value_heads (the kv override only applies with attention_k_eq_v).
    full = [i for i in range(L) if layer_types[i] == FULL]
    if gemma3:
        g_hd, g_kvh = head_dim, kvh
    elif isinstance(d.get("per_layer_config"), dict):  # {} when full layers keep the sliding geometry
        ovs = [_layer_override(d, i) for i in full]
        g_hd = {_int(o, "head_dim", head_dim) for o in ovs}
        g_kvh = {_int(o, "num_key_value_heads", kvh) for o in ovs}
        if len(g_hd) > 1 or len(g_kvh) > 1:
            raise ConfigError("per_layer_config gives full layers different geometries; jaxspec needs one per type")
        g_hd, g_kvh = (g_hd.pop(), g_kvh.pop()) if full else (head_dim, kvh)
    else:
        g_hd = _int(d, "global_head_dim", 512)
        g_kvh = _int(d, "num_global_key_value_heads", 0) if k_eq_v else 0
        g_kvh = g_kvh or kvh
    rp = _dict(d, "rope_parameters")
    if gemma3:
        legacy_full = {"rope_type": "default", "rope_theta": d.get("rope_theta", 1_000_000.0)}
        legacy_full.update(_dict(d, "rope_scaling"))
        rope_full = _rope_from(rp.get(FULL) or legacy_full, Rope(theta=1_000_000.0))
        rope_sliding = _rope_from(rp.get(SLIDING), Rope(theta=_float(d, "rope_local_base_freq", 10_000.0)))
        query_pre_attn_scalar = _float(d, "query_pre_attn_scalar", 256.0)
        if query_pre_attn_scalar <= 0:
            raise ConfigError(f"query_pre_attn_scalar must be > 0, got {query_pre_attn_scalar}")
        query_scale = query_pre_attn_scalar ** -0.5
        if d.get("attn_logit_softcapping"):
            raise ConfigError("attn_logit_softcapping is not supported")
    else:
        rope_full = _rope_from(rp.get(FULL), Rope(theta=1_000_000.0, partial_factor=0.25))
        rope_sliding = _rope_from(rp.get(SLIDING), Rope(theta=10_000.0))
        query_scale = 1.0
    if d.get("use_bidirectional_attention") == "all":
        raise ConfigError("use_bidirectional_attention='all' is not a generative configuration")
    moe = _bool(d, "enable_moe_block", False)
    cfg = TargetConfig(
        model_type=mt,
        vocab_size=_int(d, "vocab_size"),
        hidden_size=_int(d, "hidden_size"),
        intermediate_size=_int(d, "intermediate_size"),
        num_layers=L,
        num_heads=_int(d, "num_attention_heads"),
        num_kv_heads=kvh,
        head_dim=head_dim,
        global_head_dim=g_hd,
        num_global_kv_heads=g_kvh,
        layer_types=layer_types,
        sliding_window=_int(d, "sliding_window", 512),
        rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
        rope_sliding=rope_sliding,
        rope_full=rope_full,
        final_logit_softcapping=_float(d, "final_logit_softcapping", None),
        hidden_size_per_layer_input=0 if gemma3 else _int(d, "hidden_size_per_layer_input", 0),
        vocab_size_per_layer_input=0 if gemma3 else _int(d, "vocab_size_per_layer_input", 0),
        num_kv_shared_layers=_int(d, "num_kv_shared_layers", 0),
        use_double_wide_mlp=_bool(d, "use_double_wide_mlp", False),
        enable_moe_block=moe,
        num_experts=_int(d, "num_experts", 0) if moe else 0,
        top_k_experts=_int(d, "top_k_experts", 0) if moe else 0,
        moe_intermediate_size=_int(d, "moe_intermediate_size", 0) if moe else 0,
        attention_k_eq_v=k_eq_v,
        max_position_embeddings=_int(d, "max_position_embeddings", 131072),
        norm_plus_one=gemma3,
        query_scale=query_scale,
        use_v_norm=not gemma3,
        eos_token_ids=_eos(d),
        pad_token_id=_int(d, "pad_token_id", 0),
        bos_token_id=_int(d, "bos_token_id", 2),
    )
    if validate:
        cfg.validate()
    return cfg


def assistant_config_from_dict(d: dict[str, Any]) -> AssistantConfig:
    mt = d.get("model_type")
    if mt not in ASSISTANT_TYPES:
        raise ConfigError(f"unsupported assistant model_type {mt!r} (expected one of {', '.join(ASSISTANT_TYPES)})")
    if not isinstance(d.get("text_config"), dict):
        raise ConfigError("assistant config has no text_config object")
    td = dict(d["text_config"])
    td["model_type"] = "gemma4_text"
    text = _assistant_text(td)
    if text.hidden_size_per_layer_input or text.enable_moe_block or text.use_double_wide_mlp:
        raise ConfigError("assistant text_config must have no PLE, no MoE and no double-wide MLP")
    return AssistantConfig(
        model_type=mt,
        text=text,
        backbone_hidden_size=_int(d, "backbone_hidden_size", 1536),
        use_ordered_embeddings=_bool(d, "use_ordered_embeddings", False),
        num_centroids=_int(d, "num_centroids", 2048),
        centroid_top_k=_int(d, "centroid_intermediate_top_k", 32),
    )


def _assistant_text(td: dict) -> TargetConfig:
    # All layers are shared (Q-only), so TargetConfig.validate, which wants a storing layer, does not apply.
    try:
        base = _text_config(dict(td, num_kv_shared_layers=0), "gemma4_text", validate=False)
    except KeyError as e:
        raise ConfigError(f"assistant text_config lacks the field {e.args[0]!r}") from None
    base.check_sizes()
    return dataclasses.replace(base, num_kv_shared_layers=base.num_layers, final_logit_softcapping=None)


def read_json(path: str, what: str = "file"):
    """The JSON value of the file at `path`; missing, not UTF-8 or not JSON is a ConfigError naming it."""
    try:
        return json.loads(read_utf8(path, what))
    except json.JSONDecodeError as e:
        raise ConfigError(f"malformed {path}:{e.lineno}: {e.msg}") from None


def _load_config(path: str, what: str, from_dict):
    """from_dict(the config.json of the folder `path`), every problem a ConfigError naming the file."""
    if not os.path.isdir(path):
        raise ConfigError(f"{what} directory not found: {path}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"no config.json in {path}")
    d = read_json(cfg_path)
    if not isinstance(d, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object, got {type(d).__name__}")
    try:
        return from_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{cfg_path}: {e}") from None


def load_target_config(path: str) -> TargetConfig:
    return _load_config(path, "model", target_config_from_dict)


def load_assistant_config(path: str) -> AssistantConfig:
    return _load_config(path, "assistant", assistant_config_from_dict)


# ---- writing a drafter's config.json --------------------------------------------------------------------------------


def _rope_dict(rope: Rope) -> dict:
    """The rope_parameters entry `_rope_from` reads back as `rope`."""
    if rope.partial_factor != 1.0:
        d = {"rope_type": "proportional", "rope_theta": rope.theta, "partial_rotary_factor": rope.partial_factor}
        return d | ({"factor": rope.scale} if rope.scale != 1.0 else {})
    if rope.scale != 1.0:
        return {"rope_type": "linear", "rope_theta": rope.theta, "factor": rope.scale}
    return {"rope_type": "default", "rope_theta": rope.theta}


def assistant_hf_config(cfg: TargetConfig, *, hidden_size: int = 256, num_layers: int = 4, num_heads: int = 4,
                        intermediate_size: int = 2048) -> dict:
    """config.json of a plain-head drafter for `cfg`: the public drafters' sizes by default, layer types
    [S, ..., S, F] (or one type where the target stores only one), attention geometry and RoPE of the target's."""
    if min(hidden_size, num_layers, num_heads, intermediate_size) < 1:
        raise ConfigError("assistant hidden size, layers, heads and intermediate size must be >= 1")
    stored = [t for t in (SLIDING, FULL) if t in cfg.store_layers]
    types = [stored[0]] * (num_layers - 1) + [stored[-1]]
    text = {
        "model_type": "gemma4_text", "vocab_size": cfg.vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "global_head_dim": cfg.global_head_dim,
        "attention_k_eq_v": cfg.attention_k_eq_v, "num_global_key_value_heads": cfg.num_global_kv_heads,
        "layer_types": types, "sliding_window": cfg.sliding_window, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {FULL: _rope_dict(cfg.rope_full), SLIDING: _rope_dict(cfg.rope_sliding)},
        "final_logit_softcapping": None, "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
        "num_kv_shared_layers": num_layers, "use_double_wide_mlp": False, "enable_moe_block": False,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id,
    }
    return {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
            "backbone_hidden_size": cfg.hidden_size, "use_ordered_embeddings": False, "num_centroids": 2048,
            "centroid_intermediate_top_k": 32, "tie_word_embeddings": True, "dtype": "bfloat16", "text_config": text}


def assistant_generation_config(cfg: TargetConfig, k: int) -> dict:
    """generation_config.json of a drafter for `cfg` that proposes k tokens a round."""
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id,
            "num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant"}


# ---- tensor names: jaxspec param leaves <-> HF tensors --------------------------------------------------------------

TARGET_PREFIXES = ("model.language_model.", "model.")  # a multimodal wrapper's text model; a text-only checkpoint
TEXT_PREFIX = "model."  # what a text-only checkpoint (and jaxspec's GGUF import) uses
ASSISTANT_TEXT_PREFIX = "model."  # an assistant's decoder: embedding, layers and final norm, named as a target's

# One layer's leaves, each made of these HF tensors under `{prefix}layers.{i}.`. Several tensors are joined on axis 0:
# the norms stacked into one [n, H] row block, gate_up concatenated (gate rows, then up rows).
LAYER_TENSORS: dict[str, tuple[str, ...]] = {
    "norms": ("input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
              "post_feedforward_layernorm.weight"),
    "q_proj": ("self_attn.q_proj.weight",),
    "q_norm": ("self_attn.q_norm.weight",),
    "k_proj": ("self_attn.k_proj.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
    "v_proj": ("self_attn.v_proj.weight",),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
    "layer_scalar": ("layer_scalar",),  # [1] on disk, a scalar leaf
    "ple_gate": ("per_layer_input_gate.weight",),
    "ple_proj": ("per_layer_projection.weight",),
    "ple_norm": ("post_per_layer_input_norm.weight",),
    "moe_norms": ("pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_1.weight",
                  "post_feedforward_layernorm_2.weight"),
    "router_proj": ("router.proj.weight",),
    "router_scale": ("router.scale",),
    "per_expert_scale": ("router.per_expert_scale",),
    "experts_gate_up": ("experts.gate_up_proj",),
    "experts_down": ("experts.down_proj",),
}
_STACKED = ("norms", "moe_norms")

# Global leaves: a target's under its prefix; an assistant's from the top of its checkpoint.
TARGET_TENSORS = {"embed": "embed_tokens.weight", "final_norm": "norm.weight",
                  "ple_embed": "embed_tokens_per_layer.weight", "ple_model_proj": "per_layer_model_projection.weight",
                  "ple_proj_norm": "per_layer_projection_norm.weight"}
ASSISTANT_TENSORS = {"embed": ASSISTANT_TEXT_PREFIX + TARGET_TENSORS["embed"],
                     "final_norm": ASSISTANT_TEXT_PREFIX + TARGET_TENSORS["final_norm"],
                     "pre_projection": "pre_projection.weight", "post_projection": "post_projection.weight",
                     "centroids": "masked_embedding.centroids.weight",
                     "token_ordering": "masked_embedding.token_ordering"}


def layer_prefix(prefix: str, i: int | str) -> str:
    """The HF name prefix of layer i's tensors."""
    return f"{prefix}layers.{i}."


def layer_tensor_shapes(leaf: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """{HF name under the layer prefix: shape} of the tensors that make one layer's `leaf` of `shape` (a scalar
    leaf's tensor is listed as (), which `Checkpoint.get` also matches to its [1] on disk)."""
    names = LAYER_TENSORS[leaf]
    if leaf in _STACKED:
        part = tuple(shape[1:])
    elif len(names) > 1:
        part = (shape[0] // len(names), *shape[1:])
    else:
        part = tuple(shape)
    return dict.fromkeys(names, part)


def join_layer_tensors(leaf: str, parts: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """One layer's `leaf` of `shape` from its HF tensors, in LAYER_TENSORS order."""
    if leaf in _STACKED:
        return np.stack(parts)
    if len(parts) > 1:
        return np.concatenate(parts)
    return parts[0].reshape(shape)


def split_layer_leaf(leaf: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """{HF name under the layer prefix: tensor} of one layer's `leaf` value: the inverse of `join_layer_tensors`."""
    names = LAYER_TENSORS[leaf]
    if leaf in _STACKED:
        return dict(zip(names, value))
    if len(names) > 1:
        return dict(zip(names, np.split(value, len(names))))
    return {names[0]: value if value.ndim else value.reshape(1)}
