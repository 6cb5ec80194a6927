"""Ahead-of-time compilation: the one place where jaxspec turns a program into an executable.

The engine's prefill and round programs and the bucketed drafter are all compiled here, per batch bucket, before
serving starts; serving then calls the executables under `jax.no_tracing`, so an accidental recompile is an error.
With JAX's persistent compilation cache on (`jaxspec.cache.enable_compile_cache`, the CLI's default), `compile()`
loads an executable that any earlier process compiled for the same program and compiler options (on the CPU too,
Pallas interpret-mode kernels included: tests/test_cache.py); the program is still traced and lowered, for its key.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def abstract(tree):
    """The shapes and dtypes of a pytree of arrays (ShapeDtypeStructs pass through)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def matmul_precision(dtype):
    """The matmul precision a model in `dtype` computes with: fp32 means fp32 (an fp32 dot on an H200 otherwise runs in
    TF32, a relative error of ~3e-4 that moved greedy tokens against transformers); lower dtypes keep the default."""
    return "highest" if jnp.dtype(dtype).itemsize >= 4 else None


def compile_ahead(fn, *args, donate_argnames: tuple[str, ...] = (), compiler_options: dict | None = None,
                  precision: str | None = None):
    """Compile fn for the shapes of `args` (arrays or ShapeDtypeStructs; pytrees of them).

    Donated arguments are named, never counted: `donate_argnames=("kv", "state")`. precision: the default matmul
    precision while tracing (`matmul_precision`).
    """
    jitted = jax.jit(fn, donate_argnames=donate_argnames, compiler_options=compiler_options)
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        return jitted.lower(*abstract(args)).compile()
