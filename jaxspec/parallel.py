"""Tensor parallelism on one host (`--tensor-parallel-size N`): a 1-D `jax.sharding.Mesh` over N devices and the
sharding of every array the engine holds; XLA's SPMD partitioner inserts the collectives.

Megatron-style splits, by the leaf names of `jaxspec.model.weights` (HF layout, [out, in], layer stacks first):
- attention: q_proj's rows and o_proj's columns by query head; k_proj / v_proj by KV head, and the paged K/V pools
  by KV head (`LayerKV` [L, slots, KVH, d]); where N does not divide the KV heads they are replicated, and each
  device attends its own query heads to all of them;
- MLP: gate_up's rows and down's columns by the intermediate dimension; MoE: experts by expert;
- the embedding (and a separate LM head) and the PLE table by vocabulary row.
A split that N does not divide is left replicated. Norms, scalars, the router, page tables and the decode state are
replicated; so is the assistant (it reads the target's K/V shards through the partitioner). Sampling and acceptance
run on replicated values, so every device holds the same tokens.

With kernels (`--kernels on`; off by default at N > 1), each Pallas call runs per device under `shard_map` (the
partitioner cannot split a kernel): the index kernel on replicated operands, the attention kernel on the device's
query heads and its K/V heads (`per_device_attention`). The assistant's queries are split the same way there, so each
device's drafter attends only to its own K/V shard.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.config import AssistantConfig, ConfigError, TargetConfig

AXIS = "tp"


def make_mesh(n: int) -> Mesh:
    devices = jax.devices()
    if n > len(devices):
        raise ConfigError(f"--tensor-parallel-size {n} needs {n} devices; this backend ({jax.default_backend()}) "
                          f"has {len(devices)}")
    return Mesh(np.asarray(devices[:n]), (AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _split(mesh: Mesh, shape: tuple[int, ...], axis: int, parts: int | None = None) -> NamedSharding:
    """Split `axis` over the mesh when its size (or `parts`, the heads / experts it holds) divides evenly."""
    n = mesh.shape[AXIS]
    count = shape[axis] if parts is None else parts
    if count % n or shape[axis] % n:
        return replicated(mesh)
    spec = [None] * len(shape)
    spec[axis] = AXIS
    return NamedSharding(mesh, P(*spec))


def target_shardings(params: dict, cfg: TargetConfig, mesh: Mesh) -> dict:
    """A NamedSharding for every leaf of the target's params (`load_target`'s layout)."""
    def layer(name: str, shape, kv_heads: int):
        # shapes carry the layer-stack axis first
        if name == "q_proj":
            return _split(mesh, shape, 1, cfg.num_heads)
        if name == "o_proj":
            return _split(mesh, shape, 2, cfg.num_heads)
        if name in ("k_proj", "v_proj"):
            return _split(mesh, shape, 1, kv_heads)
        if name == "gate_up":
            return _split(mesh, shape, 1, shape[1] // 2)  # gate rows, then up rows: each half splits evenly
        if name == "down":
            return _split(mesh, shape, 2)
        if name in ("experts_gate_up", "experts_down"):
            return _split(mesh, shape, 1)
        return replicated(mesh)

    out = {}
    for name, value in params.items():
        if name == "layers":
            out["layers"] = {}
            for gname, group in value.items():
                kvh = _group_kv_heads(group)
                out["layers"][gname] = {n: layer(n, a.shape, kvh) for n, a in group.items()}
        elif name in ("embed", "lm_head", "ple_embed"):
            out[name] = _split(mesh, value.shape, 0)
        else:
            out[name] = replicated(mesh)
    return out


def _group_kv_heads(group: dict) -> int:
    """The KV heads of a layer group (its k_proj rows / head dim), 0 for a group without K/V."""
    if "k_proj" not in group or "k_norm" not in group:
        return 0
    return group["k_proj"].shape[1] // group["k_norm"].shape[-1]


def assistant_shardings(aparams: dict, acfg: AssistantConfig, mesh: Mesh) -> dict:
    return jax.tree.map(lambda _: replicated(mesh), aparams)


def kv_shardings(kv: dict, mesh: Mesh) -> dict:
    """The paged pools: LayerKV k / v [L, slots, KVH, d] split by KV head where N divides them."""
    return jax.tree.map(lambda a: _split(mesh, a.shape, 2), kv)


def place(tree, shardings):
    return jax.device_put(tree, shardings)


def per_device(mesh: Mesh | None, kernel):
    """kernel (operands and results replicated) run whole on every device under shard_map; unchanged without a mesh."""
    if mesh is None:
        return kernel
    return jax.shard_map(kernel, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)


def per_device_attention(mesh: Mesh, kernel, num_heads: int, kv_heads: int, layer: int):
    """The attention kernel (`paged_attention`'s signature, keyword arguments bound) per device, or None where the
    heads do not split evenly (the caller then runs the reference through the partitioner). Queries [B, T, H, d] go
    by head; the K/V stacks [L, slots, KVH, d] as `kv_shardings` placed them: by KV head where N divides them, else
    whole on every device, which then reads the layer's KV heads its query heads use (a copy of that layer)."""
    n = mesh.shape[AXIS]
    if num_heads % n:
        return None
    group, local = num_heads // kv_heads, num_heads // n
    kv_split = kv_heads % n == 0
    if not kv_split and local % group and group % local:
        return None
    head = P(None, None, AXIS, None)

    def attend(q, k, v, read, kv_start, q_lo, q_hi):
        if kv_split:
            return kernel(q, k, v, read, kv_start, q_lo, q_hi, layer=layer)
        first = jax.lax.axis_index(AXIS) * local // group
        take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=first, slice_size=max(local // group, 1),
                                 axis=1)
        return kernel(q, take(k[layer]), take(v[layer]), read, kv_start, q_lo, q_hi)

    kv = head if kv_split else P()
    return jax.shard_map(attend, mesh=mesh, in_specs=(head, kv, kv, P(), P(), P(), P()), out_specs=head,
                         check_vma=False)
