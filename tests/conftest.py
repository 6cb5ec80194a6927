import os
import shutil

# CPU compiles dominate the suite's time; LLVM optimisation level 0 keeps IEEE semantics and compiles ~3x faster.
_platforms = os.environ.get("JAX_PLATFORMS", "")
if _platforms == "cpu" or (not _platforms and shutil.which("nvidia-smi") is None):
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import jax
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def golden_path(*parts) -> str:
    return os.path.join(GOLDEN, *parts)


def load_reference(case: str) -> dict:
    path = golden_path(case, "reference.npz")
    if not os.path.isfile(path):
        pytest.fail(f"golden file {path} missing: run tests/oracle/make_goldens.py (see tests/oracle/README.md)")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"
