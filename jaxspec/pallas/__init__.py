"""Pallas kernels (Triton on the GPU, the interpreter on the CPU), each with its jnp reference beside it."""

from __future__ import annotations

import jax


def interpret_by_default() -> bool:
    """Whether a kernel left to choose (interpret=None) runs in Pallas's interpreter: where the programs traced now
    run on a CPU. That is the platform of jax's default device where one is set (`jax.default_device(d)`; `bench
    graph` sets an H200 described to XLA without one, so that the kernels lower to Triton on a CPU-only machine),
    else the default backend."""
    device = jax.config.jax_default_device
    platform = jax.default_backend() if device is None else device if isinstance(device, str) else device.platform
    return platform == "cpu"
