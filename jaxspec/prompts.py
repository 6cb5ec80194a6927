"""Prompts in, token ids out: the prompt files `python -m jaxspec.generate` reads and the tokenizer of a model folder.

A library for the command-line modules (generate, corpus, bench); stdlib-only imports, so a CLI that imports it still
starts before jax or transformers load.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxspec.config import ConfigError, read_utf8

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt as the user gave it: text, or token ids; `where` says where it came from for error messages
    ("prompts.jsonl:4", "--prompt 2")."""

    where: str
    text: str | None = None
    ids: list[int] | None = None


def read_jsonl(path: str) -> list[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a JSONL file; a missing file, one that is not UTF-8 or
    a line that is not JSON is a ConfigError naming the file and line."""
    return _jsonl(path, read_utf8(path, "prompts file"))


def _jsonl(path: str, text: str) -> list[tuple[int, Any]]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not JSON ({e.msg})") from None
    return out


def _json_file(path: str, text: str) -> list[tuple[int, Any]]:
    """(line, value) of each prompt of a `.json` file, read by its content: the items of a JSON list, one JSON
    value, or JSONL (a value a line)."""
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as e:
        first = next((line for line in text.splitlines() if line.strip()), "")
        try:
            json.loads(first)
        except json.JSONDecodeError:
            raise ConfigError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
        return _jsonl(path, text)  # its first line is a whole JSON value: one a line
    if not isinstance(whole, list):
        return [(text.count("\n", 0, len(text) - len(text.lstrip())) + 1, whole)]
    decoder, out, i = json.JSONDecoder(), [], text.index("[") + 1
    for value in whole:  # the file is valid JSON: between items there is only whitespace and one comma
        while text[i] in " \t\r\n,":
            i += 1
        out.append((text.count("\n", 0, i) + 1, value))
        i = decoder.raw_decode(text, i)[1]
    return out


def _prompt(where: str, value: Any) -> Prompt:
    if isinstance(value, str):
        return Prompt(where, text=value)
    if isinstance(value, dict) and "prompt_ids" in value:
        ids = value["prompt_ids"]
        # bool is an int in Python: JSON's true must not become token 1
        if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
            raise ConfigError(f"{where}: prompt_ids must be a non-empty list of token ids (integers >= 0), "
                              f"got {json.dumps(ids)[:80]}")
        return Prompt(where, ids=ids)
    if isinstance(value, dict) and isinstance(value.get("prompt"), str):
        return Prompt(where, text=value["prompt"])
    raise ConfigError(f"{where}: expected a string, {{\"prompt\": text}} or {{\"prompt_ids\": [...]}}, "
                      f"got {json.dumps(value)[:80]}")


def read_prompt_file(path: str) -> list[Prompt]:
    """The prompts of a file, in order: `.jsonl` (a JSON value a line), `.json` (read by content: a JSON list, one
    value or JSONL) or text (one prompt a line, blank lines skipped). A value is a string, {"prompt": text} or
    {"prompt_ids": [...]}. A file without prompts is a ConfigError (never silently replaced by demo prompts)."""
    text = read_utf8(path, "prompts file")
    if path.endswith(".jsonl"):
        values = _jsonl(path, text)
    elif path.endswith(".json"):
        values = _json_file(path, text)
    else:
        return _nonempty(path, [Prompt(f"{path}:{n}", text=line)
                                for n, line in enumerate(text.splitlines(), 1) if line.strip()])
    return _nonempty(path, [_prompt(f"{path}:{n}", v) for n, v in values])


def _nonempty(path: str, prompts: list[Prompt]) -> list[Prompt]:
    if not prompts:
        raise ConfigError(f"prompts file {path} holds no prompts")
    return prompts


def tokenize(prompts: list[Prompt], tokenizer) -> list[tuple[list[int], str | None]]:
    """[(prompt_ids, source text or None)]; text needs `tokenizer` (None: only prompt_ids are accepted)."""
    out = []
    for p in prompts:
        if p.ids is not None:
            out.append((list(p.ids), None))
        elif tokenizer is None:
            raise ConfigError(f"{p.where}: this model has no tokenizer: give prompts as prompt_ids in a .jsonl file")
        else:
            out.append((tokenizer(p.text)["input_ids"], p.text))
    return out


def read_prompts(texts: list[str], path: str | None, tokenizer) -> list[tuple[list[int], str | None]]:
    """[(prompt_ids, source text or None)] in input order: `texts` first, then the prompts of the file at `path`
    (`read_prompt_file`)."""
    prompts = [Prompt(f"--prompt {i + 1}", text=t) for i, t in enumerate(texts)]
    return tokenize(prompts + (read_prompt_file(path) if path else []), tokenizer)


def load_tokenizer(path: str):
    """The transformers tokenizer of a model folder, or None when the folder has no tokenizer files."""
    if not any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # only now: importing transformers costs a second

    return AutoTokenizer.from_pretrained(path)
