"""Ahead-of-time compilation: the one place where jaxspec turns a program into an executable.

The engine's prefill and round programs and the bucketed drafter are all compiled here, per batch bucket, before
serving starts; serving then calls the executables under `jax.no_tracing`, so an accidental recompile is an error.
With JAX's persistent compilation cache on (`jaxspec.cache.enable_compile_cache`, the CLI's default), `compile()`
loads an executable that any earlier process compiled for the same program and compiler options (on the CPU too,
Pallas interpret-mode kernels included: tests/test_cache.py); the program is still traced and lowered, for its key.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os

import jax
import jax.numpy as jnp


def abstract(tree, sharding=None):
    """The shapes, dtypes and shardings of a pytree of arrays (ShapeDtypeStructs pass through). `sharding`: for
    leaves that have none, e.g. replicated over a mesh (None: jax places them by default)."""
    def leaf(x):
        own = x.sharding if isinstance(x, jax.Array) else getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=own or sharding) if (own or sharding) \
            else jax.ShapeDtypeStruct(x.shape, x.dtype)

    return jax.tree.map(leaf, tree)


def matmul_precision(dtype):
    """The matmul precision a model in `dtype` computes with: fp32 means fp32 (an fp32 dot on an H200 otherwise runs in
    TF32, a relative error of ~3e-4 that moved greedy tokens against transformers); lower dtypes keep the default."""
    return "highest" if jnp.dtype(dtype).itemsize >= 4 else None


def lower_ahead(fn, *args, donate_argnames: tuple[str, ...] = (), compiler_options: dict | None = None,
                precision: str | None = None, in_sharding=None, out_shardings=None, keep_unused: bool = False):
    """Trace and lower fn for the shapes of `args` (arrays or ShapeDtypeStructs; pytrees of them): a `Lowered`.

    Donated arguments are named, never counted: `donate_argnames=("kv", "state")`. precision: the default matmul
    precision while tracing (`matmul_precision`). in_sharding: for inputs without a sharding of their own;
    out_shardings: jit's (on a mesh, so the donated state comes back as it went in). keep_unused: jit's; an argument
    the program does not read is dropped from the executable unless kept, and a dropped argument is never donated
    (so a buffer passed only for its outputs to reuse must be kept).
    """
    options = {} if out_shardings is None else {"out_shardings": out_shardings}
    jitted = jax.jit(fn, donate_argnames=donate_argnames, compiler_options=compiler_options, keep_unused=keep_unused,
                     **options)
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        return jitted.lower(*abstract(args, in_sharding))


def compile_ahead(fn, *args, **options):
    """`lower_ahead(fn, *args, **options)`, compiled."""
    return lower_ahead(fn, *args, **options).compile()


def compile_threads() -> int:
    """`$JAXSPEC_COMPILE_THREADS`, else 1 on the CPU backend (XLA's CPU compiler already uses every core: two threads
    on 2 cores compiled `generate`'s 8 programs no faster, 87.1 vs 84.0 s, in 15% more memory) and the CPU count on
    an accelerator (the H200's 16-core host compiled a server's 24 programs one after another for over 270 s)."""
    from jaxspec.config import compile_threads_env

    value = compile_threads_env()
    if value is None:
        return 1 if jax.default_backend() == "cpu" else os.cpu_count() or 1
    return value


def compile_all(lowerings: dict, on_done=None) -> dict:
    """{key: executable} of {key: a function returning the program's `Lowered`} (`lower_ahead`). With
    `compile_threads()` > 1 every program is lowered first (tracing holds the GIL) and then compiled side by side in
    threads (XLA compiles without the GIL: a server's many bucket programs then take the time of the slowest few on a
    many-core host, not of their sum); with 1, each is lowered and compiled in turn. on_done(key) is called as each
    one finishes."""
    workers = min(len(lowerings), compile_threads())
    if workers <= 1:
        out = {}
        for key, lower in lowerings.items():
            out[key] = lower().compile()
            if on_done:
                on_done(key)
        return out
    lowered = {key: lower() for key, lower in lowerings.items()}
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxspec-compile") as pool:
        futures = {pool.submit(low.compile): key for key, low in lowered.items()}
        out = {}
        for f in concurrent.futures.as_completed(futures):
            out[futures[f]] = f.result()
            if on_done:
                on_done(futures[f])
    return {key: out[key] for key in lowered}
