"""Prompts in, token ids out: the prompt files `python -m jaxspec.generate` reads and the tokenizer of a model folder.

A library for the command-line modules (generate, corpus, bench); stdlib-only imports, so a CLI that imports it still
starts before jax or transformers load.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxspec.config import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def read_jsonl(path: str) -> list[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a JSONL file; a missing file or a line that is not JSON
    is a ConfigError naming the file and line."""
    if not os.path.isfile(path):
        raise ConfigError(f"prompts file not found: {path}")
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not JSON ({e.msg})") from None
    return out


def read_prompts(texts: list[str], path: str | None, tokenizer) -> list[tuple[list[int], str | None]]:
    """[(prompt_ids, source text or None)] in input order: `texts` first, then the prompts of the file at `path`,
    `.jsonl` ({"prompt": text} or {"prompt_ids": [...]} a line) or text (one prompt a line, blank lines skipped).
    Text needs `tokenizer` (None: only prompt_ids are accepted)."""
    items = [("text", t) for t in texts]
    if path and path.endswith(".jsonl"):
        for n, obj in read_jsonl(path):
            if isinstance(obj, dict) and isinstance(obj.get("prompt_ids"), list):
                if not all(isinstance(t, int) for t in obj["prompt_ids"]):
                    raise ConfigError(f"{path}:{n}: prompt_ids must be a list of integers")
                items.append(("ids", obj["prompt_ids"]))
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                items.append(("text", obj["prompt"]))
            else:
                raise ConfigError(f"{path}:{n}: expected an object with 'prompt' (text) or 'prompt_ids' (list)")
    elif path:
        if not os.path.isfile(path):
            raise ConfigError(f"prompts file not found: {path}")
        with open(path) as f:
            items += [("text", line) for line in f.read().splitlines() if line.strip()]
    out = []
    for kind, value in items:
        if kind == "ids":
            out.append((list(value), None))
        else:
            if tokenizer is None:
                raise ConfigError("this model has no tokenizer: give prompts as prompt_ids in a .jsonl file")
            out.append((tokenizer(value)["input_ids"], value))
    return out


def load_tokenizer(path: str):
    """The transformers tokenizer of a model folder, or None when the folder has no tokenizer files."""
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)
