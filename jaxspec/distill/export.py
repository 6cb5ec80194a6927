"""What a distillation run leaves on disk: the HF assistant folder (bf16, loads with `load_assistant`) with its
generation config, and distill.json (hyperparameters, data sizes, final metrics)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from jaxspec.config import AssistantConfig, TargetConfig
from jaxspec.model.hf import assistant_generation_config
from jaxspec.model.packed import save_assistant


def export_params(params, kept_ids, vocab_size: int) -> dict:
    """The inference tree (`load_assistant`'s layout): embed [V, Ha] zero outside the kept rows; every value rounded
    to bf16 (the saved dtype) and held in fp32, so it equals what the saved checkpoint loads to in fp32."""
    rnd = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    out = jax.tree.map(rnd, {n: a for n, a in params.items() if n != "kept_embed"})
    kept = rnd(params["kept_embed"])
    out["embed"] = jnp.zeros((vocab_size, kept.shape[1]), jnp.float32).at[jnp.asarray(kept_ids)].set(kept)
    return out


def kept_view(aparams, kept_ids) -> dict:
    """An inference tree back in the training layout (kept_embed = its kept rows)."""
    return {n: a for n, a in aparams.items() if n != "embed"} | {"kept_embed": aparams["embed"][jnp.asarray(kept_ids)]}


def save_hf_folder(out_dir: str, cfg: TargetConfig, config: dict, acfg: AssistantConfig, aparams, k: int) -> None:
    """The HF assistant folder for target `cfg`: config.json (`config`, read back as `acfg`), generation_config.json
    (k draft tokens a round) and model.safetensors (`aparams`, an `export_params` tree, in bf16)."""
    save_assistant(out_dir, config, acfg, aparams,
                   extra_json={"generation_config.json": assistant_generation_config(cfg, k)})


def write_report(out_dir: str, report: dict) -> None:
    with open(os.path.join(out_dir, "distill.json"), "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
