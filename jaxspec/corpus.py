"""Prompts for distillation (`jaxspec.distill`): the text that ships with Python (`pydoc_data.topics`, 79 topics,
~490 KB) cut into prompts of a fixed number of tokens and split into train and held-out by topic, and the JSONL of
prompt_ids that carries them to a machine where the tokenizer is not usable.

    python -m jaxspec.corpus --model DIR --out prompts.jsonl [--heldout-out heldout.txt] [--prompt-len 64]

One JSON object a line: {"prompt_ids": [...], "split": "train" | "heldout", "topic": name}. `--heldout-out` writes
the held-out prompts as text, one a line (whitespace runs, newlines included, become one space): the bundled prompts
of `python -m jaxspec.generate`. Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from jaxspec.cli import Parser, run_cli
from jaxspec.config import ConfigError
from jaxspec.prompts import load_tokenizer, read_jsonl

HELDOUT_FRACTION = 0.1  # of the corpus text, in whole topics
HELDOUT_EVERY = 10  # untagged prompt_ids rows: every 10th is held out
SPLITS = ("train", "heldout")


def pydoc_topics() -> dict[str, str]:
    """{topic name: text} of the Python docs bundled with the interpreter."""
    from pydoc_data.topics import topics

    return dict(topics)


def heldout_topics(topics: dict[str, str]) -> set[str]:
    """Whole topics, taken in a fixed pseudo-random order (md5 of the name) until they hold ~10% of the text."""
    order = sorted(topics, key=lambda n: hashlib.md5(n.encode()).hexdigest())
    total, held, size = sum(len(t) for t in topics.values()), set(), 0
    for name in order:
        if size >= HELDOUT_FRACTION * total:
            break
        held.add(name)
        size += len(topics[name])
    return held


def cut_prompts(tokenizer, topics: dict[str, str], prompt_len: int, stride: int) -> list[dict]:
    """Every topic's tokens -> windows of exactly `prompt_len` tokens (BOS + prompt_len - 1 text tokens when the
    tokenizer has a BOS), one every `stride` tokens; rows in topic order, tagged with their split."""
    if prompt_len < 2 or stride < 1:
        raise ConfigError(f"--prompt-len must be >= 2 and --stride >= 1, got {prompt_len} and {stride}")
    bos = [] if tokenizer.bos_token_id is None else [int(tokenizer.bos_token_id)]
    body = prompt_len - len(bos)
    held = heldout_topics(topics)
    rows = []
    for name in sorted(topics):
        ids = tokenizer.encode(topics[name], add_special_tokens=False)
        split = "heldout" if name in held else "train"
        rows += [{"prompt_ids": bos + list(ids[s: s + body]), "split": split, "topic": name}
                 for s in range(0, len(ids) - body + 1, stride)]
    return rows


def prompt_text(tokenizer, ids) -> str:
    """A prompt as one line of text: special tokens dropped, every whitespace run turned into one space."""
    return " ".join(tokenizer.decode(ids, skip_special_tokens=True).split())


def write_heldout_text(path: str, tokenizer, rows: list[dict]) -> int:
    """The held-out prompts as text lines (those that are all whitespace left out); returns the line count."""
    texts = (prompt_text(tokenizer, r["prompt_ids"]) for r in rows if r["split"] == "heldout")
    lines = [t for t in texts if t]
    with open(path, "w") as f:
        f.writelines(line + "\n" for line in lines)
    return len(lines)


def write_prompt_ids(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_prompt_ids(path: str) -> list[dict]:
    """Rows of a prompt_ids JSONL (`split` defaults to None: untagged)."""
    rows = []
    for n, obj in read_jsonl(path):
        ids = obj.get("prompt_ids") if isinstance(obj, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ConfigError(f"{path}:{n}: expected an object with 'prompt_ids', a non-empty list of integers")
        split = obj.get("split")
        if split not in (None, *SPLITS):
            raise ConfigError(f"{path}:{n}: split must be 'train' or 'heldout', got {split!r}")
        rows.append({"prompt_ids": ids, "split": split})
    if not rows:
        raise ConfigError(f"{path}: no prompts")
    return rows


def split_rows(rows: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held-out) prompt ids: by the rows' tags, or, when no row is tagged, every 10th row held out."""
    if any(r["split"] for r in rows):
        return ([r["prompt_ids"] for r in rows if r["split"] != "heldout"],
                [r["prompt_ids"] for r in rows if r["split"] == "heldout"])
    held = {i for i in range(len(rows)) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1} or {len(rows) - 1}
    return ([r["prompt_ids"] for i, r in enumerate(rows) if i not in held],
            [r["prompt_ids"] for i, r in enumerate(rows) if i in held])


def load_tokenizer_or_fail(model: str):
    if not os.path.isdir(model):
        raise ConfigError(f"model directory not found: {model}")
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ConfigError(f"no tokenizer in {model}: pre-tokenize with `python -m jaxspec.corpus` where one is, and "
                          "pass the prompt_ids JSONL with --prompts")
    return tokenizer



def main(argv=None) -> int:
    p = Parser(prog="python -m jaxspec.corpus", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model folder with the tokenizer")
    p.add_argument("--out", required=True, help="prompt_ids JSONL (train and held-out rows, tagged)")
    p.add_argument("--heldout-out", default=None, help="held-out prompts as text, one a line")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--stride", type=int, default=None, help="tokens between prompt starts (default prompt-len / 2)")
    return run_cli(_run, p.parse_args(argv))


def _run(args) -> int:
    tokenizer = load_tokenizer_or_fail(args.model)
    rows = cut_prompts(tokenizer, pydoc_topics(), args.prompt_len, args.stride or max(1, args.prompt_len // 2))
    write_prompt_ids(args.out, rows)
    held = write_heldout_text(args.heldout_out, tokenizer, rows) if args.heldout_out else 0
    n_held = sum(r["split"] == "heldout" for r in rows)
    print(f"{len(rows)} prompts of {args.prompt_len} tokens ({len(rows) - n_held} train, {n_held} held-out) -> "
          f"{args.out}" + (f"; {held} held-out text lines -> {args.heldout_out}" if args.heldout_out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
