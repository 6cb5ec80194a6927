"""Pallas (Triton) kernel: slot indices of each row's live KV window, with the full -> SWA page translation, and its
jnp reference (`gather_kv_indices_ref`, the same call; the CPU path and the kernel's test oracle).

The kernel touches live entries only: a 128K-position page table is never read or translated as a whole, so a
sliding layer's ~513-entry window costs ~513 lookups, not 128K.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxspec.pallas import interpret_by_default

# jax 0.11 lowers pallas_call on GPU to Triton and warns that this backend is deprecated; it is the one we target.
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)


def _gather_kernel(page_table_ref, kv_start_ref, kv_end_ref, *refs, width: int, page_size: int, block: int,
                   num_splits: int, translate: bool):
    """Program (b, s) writes the blocks of row b's live entries `[0, kv_end - kv_start)` that fall to split s."""
    if translate:
        swa_of_full_ref, out_ref = refs
    else:
        (out_ref,) = refs
    b = pl.program_id(0)
    split = pl.program_id(1)
    start = kv_start_ref[b]
    live_count = jnp.clip(kv_end_ref[b] - start, 0, width)
    # Dynamic loop bounds (lowered to scf.for): the work of a row follows its live count, not `width`.
    num_blocks = pl.cdiv(live_count, block)
    blocks_per_split = pl.cdiv(num_blocks, num_splits)
    first_block = split * blocks_per_split
    last_block = jnp.minimum(first_block + blocks_per_split, num_blocks)
    last_page = page_table_ref.shape[1] - 1

    def body(j, carry):
        i = j * block + lax.iota(jnp.int32, block)  # [block]
        live = i < live_count
        pos = start + i
        # Dead lanes of the last block look up logical page 0, so every read stays inside the row.
        logical = jnp.where(live, jnp.minimum(pos // page_size, last_page), 0)
        page = page_table_ref[b, logical]
        if translate:
            page = swa_of_full_ref[page]
        slot = jnp.where(live, page * page_size + pos % page_size, 0)
        out_ref[b, pl.ds(pl.multiple_of(j * block, block), block)] = slot
        return carry

    lax.fori_loop(first_block, last_block, body, 0)


@functools.partial(
    jax.jit,
    static_argnames=("width", "page_size", "block", "num_splits", "num_warps", "interpret"),
)
def gather_kv_indices(page_table, kv_start, kv_end, swa_of_full, *, width: int, page_size: int, block: int = 128,
                      num_splits: int = 4, num_warps: int = 4, interpret: bool | None = None):
    """Slot indices of the window `[kv_start, kv_end)` of each row (kernel of `gather_kv_indices_ref`).

    page_table: int32[B, max_pages]   full-pool page id of each logical page (0: dummy)
    kv_start, kv_end: int32[B]        absolute positions; kv_end - kv_start <= width
    swa_of_full: int32[num_full_pages] or None   full page id -> SWA page id, applied to live entries only
    width: a multiple of `block` (callers round up); block: a power of two.
    num_splits: programs per row; each walks its share of the row's live blocks (grid (B, num_splits)).
    interpret: None runs the interpreter on CPU backends and compiles with Triton elsewhere.
    Returns int32[B, width]: entry i is the slot of position kv_start + i for i < kv_end - kv_start, as in the
    reference.
    Entries past the live count inside the last live block are 0; entries in later blocks are left unwritten
    (arbitrary values on GPU); consumers mask them by position.
    """
    if block & (block - 1) or width % block:
        raise ValueError(f"block ({block}) must be a power of two dividing width ({width})")
    if interpret is None:
        interpret = interpret_by_default()
    B = page_table.shape[0]
    translate = swa_of_full is not None
    kernel = functools.partial(_gather_kernel, width=width, page_size=page_size, block=block,
                               num_splits=num_splits, translate=translate)
    operands = [page_table.astype(jnp.int32), kv_start.astype(jnp.int32), kv_end.astype(jnp.int32)]
    if translate:
        operands.append(swa_of_full.astype(jnp.int32))
    return pl.pallas_call(
        kernel,
        grid=(B, num_splits),
        out_shape=jax.ShapeDtypeStruct((B, width), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gather_kv_indices",
    )(*operands)


def gather_kv_indices_ref(page_table, kv_start, kv_end, swa_of_full, *, width: int, page_size: int):
    """The reference of `gather_kv_indices` (same arguments; it has no tuning knobs): pure jnp, every entry computed.

    Entries past the live count are 0 here (the kernel leaves later blocks unwritten; consumers mask by position).
    """
    pos = kv_start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, W]
    live = pos < kv_end[:, None]
    logical = jnp.where(live, pos // page_size, 0)
    page = jnp.take_along_axis(page_table, logical, axis=1)
    if swa_of_full is not None:
        page = swa_of_full[page]
    return jnp.where(live, page * page_size + pos % page_size, 0).astype(jnp.int32)
