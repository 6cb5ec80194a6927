"""Assistant checkpoints on disk: the HF folder `load_assistant` reads, and a packed form for shipping it.

A distilled drafter (`jaxspec.distill`) has embedding rows for only K of the V tokens; every other row is exactly
zero, so its logit is exactly 0. The packed form stores the K non-zero rows and their ids instead of the zero-filled
[V, H] matrix, every tensor split into safetensors files of at most 15 MB, plus the folder's other small files
(config.json, ...) verbatim. `unpack_assistant` rebuilds the HF folder byte for byte.

    python -m jaxspec.model.packed pack HF_DIR PACKED_DIR
    python -m jaxspec.model.packed unpack PACKED_DIR HF_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxspec.config import AssistantConfig, ConfigError
from jaxspec.model import hf

MAX_FILE_BYTES = 15_000_000
HEADER_RESERVE = 1_000_000  # room for a safetensors JSON header inside MAX_FILE_BYTES
WEIGHTS = "model.safetensors"
EMBED = hf.ASSISTANT_TENSORS["embed"]
MANIFEST = "packed.json"
FORMAT = "jaxspec-packed-assistant/1"
ST_METADATA = {"format": "pt"}
_IDS, _ROWS = "packed.embed_ids", "packed.embed_rows"
_PLAIN_HEAD = ("embed", "final_norm", "pre_projection", "post_projection")  # a plain-head assistant's global leaves


# ---- the HF folder -------------------------------------------------------------------------------------------------


def assistant_tensors(acfg: AssistantConfig, params, dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """HF tensor name -> array (the inverse of `load_assistant`) for a plain-head assistant, cast to `dtype`."""
    if acfg.use_ordered_embeddings:
        raise ConfigError("writing a centroid-head assistant is not supported")

    def arr(x):
        return np.asarray(x).astype(dtype)

    out = {hf.ASSISTANT_TENSORS[name]: arr(params[name]) for name in _PLAIN_HEAD}
    for i in range(acfg.text.num_layers):
        group, j = acfg.text.group_of(i)
        pre = hf.layer_prefix(hf.ASSISTANT_TEXT_PREFIX, i)
        for name, stack in params["layers"][group].items():
            out.update({pre + n: t for n, t in hf.split_layer_leaf(name, arr(stack[j])).items()})
    return out


def save_assistant(path: str, config: dict, acfg: AssistantConfig, params, extra_json: dict | None = None) -> None:
    """Write an HF assistant folder: config.json, model.safetensors (bf16) and any `extra_json` {file name: dict}."""
    os.makedirs(path, exist_ok=True)
    for name, obj in {"config.json": config, **(extra_json or {})}.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    save_file(assistant_tensors(acfg, params), os.path.join(path, WEIGHTS), metadata=ST_METADATA)


# ---- packing ---------------------------------------------------------------------------------------------------------


def _chunks(name: str, a: np.ndarray, budget: int):
    """(key, part) pieces of `a` split along its first axis, each at most `budget` bytes."""
    if a.nbytes <= budget or a.ndim == 0:
        return [(name, a)]
    rows = max(1, budget // max(1, a[0].nbytes))
    return [(f"{name}:{n}", a[s: s + rows]) for n, s in enumerate(range(0, a.shape[0], rows))]


def _remove_previous_pack(out_dir: str) -> None:
    """Delete the files an earlier pack wrote into out_dir (so no stale shard survives a smaller repack)."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        old = json.load(f)
    shards = {fn for parts in old.get("tensors", {}).values() for fn, _ in parts}
    for n in sorted(shards) + old.get("copied", []) + [MANIFEST]:
        if os.path.isfile(os.path.join(out_dir, n)):
            os.remove(os.path.join(out_dir, n))


def pack_assistant(hf_dir: str, out_dir: str) -> list[str]:
    """Pack an HF assistant folder (single model.safetensors) into `out_dir`; returns the files written."""
    src = os.path.join(hf_dir, WEIGHTS)
    if not os.path.isfile(src):
        raise ConfigError(f"no {WEIGHTS} in {hf_dir} (pack needs a single-file assistant checkpoint)")
    with safe_open(src, "numpy") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if EMBED not in tensors:
        raise ConfigError(f"missing tensor {EMBED} in {hf_dir}")
    embed = tensors.pop(EMBED)
    ids = np.flatnonzero(np.any(embed != 0, axis=1)).astype(np.int32)
    tensors[_IDS], tensors[_ROWS] = ids, embed[ids]
    budget = MAX_FILE_BYTES - HEADER_RESERVE
    files, current, size, parts = [], {}, 0, {}
    for name in sorted(tensors):
        keys = []
        for key, piece in _chunks(name, tensors[name], budget):
            if current and size + piece.nbytes > budget:
                files.append(current)
                current, size = {}, 0
            current[key] = np.ascontiguousarray(piece)
            size += piece.nbytes
            keys.append([len(files), key])
        parts[name] = keys
    files.append(current)
    names = [f"packed-{n + 1:05d}.safetensors" for n in range(len(files))]
    others = sorted(n for n in os.listdir(hf_dir) if os.path.isfile(os.path.join(hf_dir, n))
                    and not n.endswith(".safetensors") and n != "model.safetensors.index.json")
    for n in others:
        if os.path.getsize(os.path.join(hf_dir, n)) > MAX_FILE_BYTES:
            raise ConfigError(f"{n} in {hf_dir} is larger than {MAX_FILE_BYTES} bytes")
    _remove_previous_pack(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for fn, content in zip(names, files):
        save_file(content, os.path.join(out_dir, fn))
    for n in others:
        shutil.copyfile(os.path.join(hf_dir, n), os.path.join(out_dir, n))
    manifest = {"format": FORMAT, "metadata": metadata, "embed_shape": list(embed.shape), "copied": others,
                "tensors": {name: [[names[i], key] for i, key in keys] for name, keys in parts.items()}}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    return names + others + [MANIFEST]


def unpack_assistant(packed_dir: str, hf_dir: str) -> None:
    """Rebuild the HF folder that `pack_assistant` packed (byte-identical files)."""
    path = os.path.join(packed_dir, MANIFEST)
    if not os.path.isfile(path):
        raise ConfigError(f"no {MANIFEST} in {packed_dir}")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{path}: unknown packed format {manifest.get('format')!r}")
    opened = {}

    def piece(fn, key):
        if fn not in opened:
            opened[fn] = safe_open(os.path.join(packed_dir, fn), "numpy")
        return opened[fn].get_tensor(key)

    tensors = {name: np.concatenate([piece(fn, key) for fn, key in keys]) if len(keys) > 1 else piece(*keys[0])
               for name, keys in manifest["tensors"].items()}
    ids, rows = tensors.pop(_IDS), tensors.pop(_ROWS)
    embed = np.zeros(manifest["embed_shape"], rows.dtype)
    embed[ids] = rows
    tensors[EMBED] = embed
    os.makedirs(hf_dir, exist_ok=True)
    save_file(tensors, os.path.join(hf_dir, WEIGHTS), metadata=manifest["metadata"])
    for n in manifest["copied"]:
        shutil.copyfile(os.path.join(packed_dir, n), os.path.join(hf_dir, n))


BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "gemma3-270m-assistant")


def bundled_assistant_dir() -> str:
    """The assistant shipped with jaxspec for Gemma 3 270M (distilled by `python -m jaxspec.distill`, packed in
    `jaxspec/assets`), unpacked once into the user cache as an HF-layout folder; later calls just return it."""
    import hashlib

    from jaxspec.cache import cached_folder

    digest = hashlib.sha256()  # of every file: a new drafter can keep the manifest (same names and shapes)
    for name in sorted(os.listdir(BUNDLED)):
        digest.update(name.encode() + b"\0")
        with open(os.path.join(BUNDLED, name), "rb") as f:
            digest.update(f.read())
    key = {"bundle_sha256": digest.hexdigest()}
    return cached_folder("gemma-3-270m-assistant", key, lambda tmp: unpack_assistant(BUNDLED, tmp),
                         "unpacking the bundled assistant")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] not in ("pack", "unpack"):
        print("error: usage: python -m jaxspec.model.packed {pack HF_DIR PACKED_DIR | unpack PACKED_DIR HF_DIR}",
              file=sys.stderr)
        return 2
    try:
        (pack_assistant if argv[0] == "pack" else unpack_assistant)(argv[1], argv[2])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
