"""Prompts for distillation (`jaxspec.distill`): text that ships with Python and its packages, cut into prompts of a
fixed number of tokens and split into train and held-out by whole documents, and the JSONL of prompt_ids that carries
them to a machine where the tokenizer is not usable.

    python -m jaxspec.corpus --model DIR --out prompts.jsonl [--sources pydoc,stdlib,docstrings,packages,oneline]
        [--max-per-source 4000] [--heldout-out heldout.txt] [--prompt-len 64]

Sources (`SOURCES`), each a set of documents:
- pydoc: the Python docs bundled with the interpreter (`pydoc_data.topics`, 79 topics, ~490 KB);
- stdlib: the standard library's own .py files (its test suites left out), code;
- docstrings: the module, class and function docstrings of those files, one document a file, prose;
- packages: the descriptions (METADATA) and license texts of the installed distributions;
- oneline: pydoc, docstrings and packages again with every whitespace run turned into one space (how the bundled
  prompts of `python -m jaxspec.generate` and many typed prompts look).
Within each source, whole documents are held out (the first in md5 order of their names until they hold ~10% of the
source's text); a oneline document is held out exactly when its original is, so the pydoc topics held out are the
same for every choice of sources (the bundled prompts and `bench/prompts/270m-heldout.jsonl` come from them).

One JSON object a line: {"prompt_ids": [...], "split": "train" | "heldout", "source": name, "topic": document}.
`--heldout-out` writes the held-out prompts as text, one a line (whitespace runs, newlines included, become one
space). Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import os
import pathlib
import sys
import sysconfig
import warnings

from jaxspec.cli import Parser, run_cli
from jaxspec.config import ConfigError
from jaxspec.prompts import load_tokenizer, read_jsonl

HELDOUT_FRACTION = 0.1  # of the corpus text, in whole topics
HELDOUT_EVERY = 10  # untagged prompt_ids rows: every 10th is held out
SPLITS = ("train", "heldout")
SOURCES = ("pydoc", "stdlib", "docstrings", "packages", "oneline")


def pydoc_topics() -> dict[str, str]:
    """{topic name: text} of the Python docs bundled with the interpreter."""
    from pydoc_data.topics import topics

    return dict(topics)


def stdlib_files() -> dict[str, str]:
    """{path under the standard library: source} of its .py files, test suites, site-packages and files that are
    not UTF-8 left out."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root).parts
        if {"site-packages", "test", "tests", "idle_test", "__pycache__"} & set(parts):
            continue
        try:
            out["/".join(parts)] = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
    return out


def docstrings(files: dict[str, str]) -> dict[str, str]:
    """{file: its module, class and function docstrings, blank-line separated} for the files that have any."""
    out = {}
    for name, text in files.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SyntaxWarning)
                tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        docs = [ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        docs = [d for d in docs if d and len(d) > 40]
        if docs:
            out[name] = "\n\n".join(docs)
    return out


def package_texts() -> dict[str, str]:
    """{distribution/file: text} of the installed distributions' descriptions and license files (one entry per
    distribution name, the first found when several are installed)."""
    out, seen = {}, set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: str(d.metadata.get("Name", ""))):
        name = str(dist.metadata.get("Name") or "")
        if not name or name.lower() in seen:
            continue
        seen.add(name.lower())
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        if isinstance(body, str) and len(body.strip()) > 200:
            out[f"{name}/METADATA"] = body
        for f in dist.files or ():
            if pathlib.PurePath(str(f)).name.upper().startswith(("LICENSE", "LICENCE", "COPYING", "NOTICE")):
                try:
                    text = f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError, FileNotFoundError):
                    continue
                if text and len(text.strip()) > 200:
                    out[f"{name}/{pathlib.PurePath(str(f)).name}"] = text
    return out


def one_line(docs: dict[str, str]) -> dict[str, str]:
    return {n: " ".join(t.split()) for n, t in docs.items()}


def check_sources(names) -> None:
    if not names or set(names) - set(SOURCES):
        raise ConfigError(f"--sources: expected names among {', '.join(SOURCES)}, got {','.join(names) or 'none'}")


def corpus_sources(names) -> dict[str, dict[str, str]]:
    """{source: {document: text}} of the chosen `SOURCES`."""
    check_sources(names)
    want = set(names)
    files = stdlib_files() if want & {"stdlib", "docstrings", "oneline"} else {}
    docs = {"pydoc": pydoc_topics() if want & {"pydoc", "oneline"} else {},
            "stdlib": files, "docstrings": docstrings(files) if want & {"docstrings", "oneline"} else {},
            "packages": package_texts() if want & {"packages", "oneline"} else {}}
    if "oneline" in want:  # document names keep their source, so the held-out split follows the original
        docs["oneline"] = {f"{src}:{n}": t for src in ("pydoc", "docstrings", "packages")
                           for n, t in one_line(docs[src]).items()}
    return {n: docs[n] for n in SOURCES if n in want}


def split_documents(docs: dict[str, dict[str, str]]) -> dict[str, tuple[set[str], set[str]]]:
    """{source: (held-out documents, dropped documents)}. Within a source, `heldout_topics`; a docstrings document
    goes with its file and a oneline document with its original. Dropped: every other document that repeats a
    passage of a held-out one (pydoc's topics overlap, 'naming' holds 'execmodel'; packages share license texts),
    and exact repeats of an earlier document, so no held-out text is trained on."""
    out = {}
    for source in ("pydoc", "stdlib", "packages"):
        if source in docs:
            held = heldout_topics(docs[source])
            out[source] = held, repeats(held, docs[source])
    if "docstrings" in docs:
        held, dropped = out.get("stdlib") or (heldout_topics(docs["docstrings"]), set())
        out["docstrings"] = held & docs["docstrings"].keys(), dropped & docs["docstrings"].keys()
    if "oneline" in docs:
        held, dropped = set(), set()
        for name in docs["oneline"]:
            src, _, doc = name.partition(":")
            h, d = out.get(src) or split_documents({src: corpus_sources([src])[src]})[src]
            held |= {name} if doc in h else set()
            dropped |= {name} if doc in d else set()
        out["oneline"] = held, dropped
    return out


def repeats(held: set[str], docs: dict[str, str], passage: int = 200, every: int = 1000) -> set[str]:
    """The documents not in `held` that contain one of their passages (`passage` characters every `every`,
    whitespace runs as one space) or repeat an earlier document (in name order) exactly."""
    flat = one_line(docs)
    pieces = [flat[n][i: i + passage] for n in sorted(held) for i in range(0, max(1, len(flat[n]) - passage), every)]
    pieces = [p for p in pieces if len(p) == passage]
    first: dict[str, str] = {}
    for n in sorted(docs):
        first.setdefault(flat[n], n)
    return {n for n in docs if n not in held and (first[flat[n]] != n or any(p in flat[n] for p in pieces))}


def sample_rows(rows: list[dict], limit: int | None) -> list[dict]:
    """At most `limit` rows, a fixed pseudo-random choice (md5 of the row's document and ids) kept in order, with
    train and held-out rows taken in proportion."""
    if limit is None or len(rows) <= limit:
        return rows
    key = lambda r: hashlib.md5(f"{r['topic']}|{r['prompt_ids']}".encode()).hexdigest()  # noqa: E731
    keep = set()
    for split in SPLITS:
        part = [i for i, r in enumerate(rows) if r["split"] == split]
        n = round(limit * len(part) / len(rows))
        keep |= set(sorted(part, key=lambda i: key(rows[i]))[:n])
    return [r for i, r in enumerate(rows) if i in keep]


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


def cut_prompts(tokenizer, topics: dict[str, str], prompt_len: int, stride: int, held: set[str] | None = None,
                source: str | None = None) -> list[dict]:
    """Every topic's tokens -> windows of exactly `prompt_len` tokens (BOS + prompt_len - 1 text tokens when the
    tokenizer has a BOS), one every `stride` tokens; rows in topic order, tagged with their split (`held`: the
    held-out topics, default `heldout_topics`) and `source` when given."""
    if prompt_len < 2 or stride < 1:
        raise ConfigError(f"--prompt-len must be >= 2 and --stride >= 1, got {prompt_len} and {stride}")
    bos = [] if tokenizer.bos_token_id is None else [int(tokenizer.bos_token_id)]
    body = prompt_len - len(bos)
    held = heldout_topics(topics) if held is None else held
    rows = []
    for name in sorted(topics):
        ids = tokenizer.encode(topics[name], add_special_tokens=False)
        split = "heldout" if name in held else "train"
        rows += [{"prompt_ids": bos + list(ids[s: s + body]), "split": split, "topic": name}
                 | ({"source": source} if source else {}) for s in range(0, len(ids) - body + 1, stride)]
    return rows


def corpus_rows(tokenizer, names, prompt_len: int, stride: int, max_per_source: int | None) -> list[dict]:
    """The prompts of the chosen sources (at most `max_per_source` each), source by source."""
    rows, docs = [], corpus_sources(names)
    for source, (held, dropped) in split_documents(docs).items():
        kept = {n: t for n, t in docs[source].items() if n not in dropped}
        rows += sample_rows(cut_prompts(tokenizer, kept, prompt_len, stride, held, source), max_per_source)
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
        rows.append({"prompt_ids": ids, "split": split, "source": obj.get("source")})
    if not rows:
        raise ConfigError(f"{path}: no prompts")
    return rows


def split_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows: by the rows' tags, or, when no row is tagged, every 10th row held out."""
    if any(r["split"] for r in rows):
        return [r for r in rows if r["split"] != "heldout"], [r for r in rows if r["split"] == "heldout"]
    held = {i for i in range(len(rows)) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1} or {len(rows) - 1}
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


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
    p.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, among {', '.join(SOURCES)}")
    p.add_argument("--max-per-source", type=int, default=4000, help="at most this many prompts from each source "
                   "(0: all)")
    return run_cli(_run, p.parse_args(argv))


def _run(args) -> int:
    if args.max_per_source < 0:
        raise ConfigError(f"--max-per-source must be >= 0, got {args.max_per_source}")
    names = [n for n in args.sources.split(",") if n]
    check_sources(names)  # before the tokenizer loads
    tokenizer = load_tokenizer_or_fail(args.model)
    rows = corpus_rows(tokenizer, names, args.prompt_len,
                       args.stride or max(1, args.prompt_len // 2), args.max_per_source or None)
    write_prompt_ids(args.out, rows)
    held = write_heldout_text(args.heldout_out, tokenizer, rows) if args.heldout_out else 0
    n_held = sum(r["split"] == "heldout" for r in rows)
    per = ", ".join(f"{src} {sum(r.get('source') == src for r in rows)}" for src in SOURCES
                    if any(r.get("source") == src for r in rows))
    print(f"{len(rows)} prompts of {args.prompt_len} tokens ({len(rows) - n_held} train, {n_held} held-out; {per}) -> "
          f"{args.out}" + (f"; {held} held-out text lines -> {args.heldout_out}" if args.heldout_out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
