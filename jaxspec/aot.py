"""Ahead-of-time compilation: the one place where jaxspec turns a program into an executable.

The engine's prefill and round programs and the bucketed drafter are all compiled here, per batch bucket, before
serving starts; serving then calls the executables under `jax.no_tracing`, so an accidental recompile is an error.
"""

from __future__ import annotations

import jax


def abstract(tree):
    """The shapes and dtypes of a pytree of arrays (ShapeDtypeStructs pass through)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def compile_ahead(fn, *args, donate_argnames: tuple[str, ...] = (), compiler_options: dict | None = None):
    """Compile fn for the shapes of `args` (arrays or ShapeDtypeStructs; pytrees of them).

    Donated arguments are named, never counted: `donate_argnames=("kv", "state")`.
    """
    jitted = jax.jit(fn, donate_argnames=donate_argnames, compiler_options=compiler_options)
    return jitted.lower(*abstract(args)).compile()
