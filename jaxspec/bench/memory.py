"""`bench memory`: KV bytes per request with and without the SWA pool (arithmetic only, nothing runs)."""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from jaxspec.bench.common import DTYPE, PRESET_NAMES, positive, print_table, sizes
from jaxspec.config import FULL, LAYER_TYPES, SLIDING, bench_pair
from jaxspec.paged_kv.pool import swa_pages_bound_for


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="E4B")
    p.add_argument("--ctx", type=sizes, default=[4096, 32768, 131072])
    p.add_argument("-k", type=positive, default=3, help="draft steps: a verify step writes k + 1 positions")
    p.add_argument("--chunk", type=positive, default=256, help="prefill chunk")


def run(args) -> dict:
    """KV bytes per request (bf16) with the SWA pool vs every non-shared layer keeping all positions."""
    cfg = bench_pair(args.preset)[0]
    P, W = args.page_size, cfg.sliding_window
    per_position = {t: len(cfg.kv_layers[t]) * cfg.type_kv_heads(t) * cfg.type_head_dim(t) * 2
                    * jnp.dtype(DTYPE).itemsize for t in LAYER_TYPES}
    rows = []
    for ctx in args.ctx:
        pages = -(-ctx // P)
        without = pages * P * (per_position[FULL] + per_position[SLIDING])
        for step_name, step in ((f"verify {args.k + 1}", args.k + 1), (f"chunk {args.chunk}", args.chunk)):
            swa_pages = min(pages, swa_pages_bound_for(page_size=P, swa_keep=W + 1, max_step_tokens=step))
            full, sliding = pages * P * per_position[FULL], swa_pages * P * per_position[SLIDING]
            rows.append({"ctx": ctx, "step": step_name, "max_step_tokens": step, "swa_pages": swa_pages,
                         "full_bytes": full, "sliding_bytes": sliding, "with_swa_bytes": full + sliding,
                         "without_swa_bytes": without, "without/with": without / (full + sliding)})
    mib = lambda k: (k, k.replace("_bytes", "_MiB"), "{:.1f}")  # noqa: E731
    print_table(f"KV bytes per request, {args.preset} (bf16, page {P}, W {W}): SWA pool vs all positions in every "
                "non-shared layer", [("ctx", "ctx", "{}"), ("step", "step", "{}"), ("swa_pages", "swa_pages", "{}"),
                                     mib("full_bytes"), mib("sliding_bytes"), mib("with_swa_bytes"),
                                     mib("without_swa_bytes"), ("without/with", "without/with", "{:.2f}")],
                [{**r, **{k: r[k] / 2**20 for k in r if k.endswith("_bytes")}} for r in rows])
    return {"preset": args.preset, "per_position_bytes": per_position, "rows": rows}
