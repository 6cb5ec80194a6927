"""Target and assistant configs, read from an HF `config.json` (`jaxspec.model.hf`) or built from named presets.

Frozen, keyword-only dataclasses: everything the forward needs is derived here once (per-layer head dims, KV heads,
KV-sharing modes, store layers, layer groups for stacked weights), so the model code never re-reads the raw dict.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

TARGET_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "gemma3_text")
ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")


class ConfigError(ValueError):
    """A config, checkpoint or argument that jaxspec cannot use; the CLI prints it as one line and exits 2."""


def compile_threads_env() -> int | None:
    """`$JAXSPEC_COMPILE_THREADS` (programs compiled side by side, `jaxspec.aot.compile_all`), None when unset."""
    value = os.environ.get("JAXSPEC_COMPILE_THREADS")
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise ConfigError(f"JAXSPEC_COMPILE_THREADS must be a whole number >= 1, got {value!r}")
    return int(value)


# on/off environment switches, for comparing runs
SWITCHES = ("JAXSPEC_PRIME", "JAXSPEC_GC_FREEZE", "JAXSPEC_UNROLL_ROUNDS", "JAXSPEC_ATTN_GATHER_Q",
            "JAXSPEC_FUSE_QKV", "JAXSPEC_FUSED_NORMS", "JAXSPEC_JOINT_QK_NORM", "JAXSPEC_QKV_KERNEL",
            "JAXSPEC_STAGE_INPUTS", "JAXSPEC_PINNED_INPUTS", "JAXSPEC_SHARED_Q_IN_ATTENTION",
            "JAXSPEC_QKV_IN_ATTENTION", "JAXSPEC_VERIFY_IN_ATTENTION")
# switches whose code was removed with the form they chose (measured slower on the GPU; BENCHMARKS.md sessions 37 and
# 47), and the layer products kernel's site list beside them, each with the value that runs the form that stayed (what
# older result files that set it measured as shipped: `bench goals`): read no more, a set one is named in a note on
# stderr (`launch.check_args`)
RETIRED_SWITCHES = {"JAXSPEC_ATTN_MERGED": "0", "JAXSPEC_ATTN_PREFETCH": "0", "JAXSPEC_GEMV": "0",
                    "JAXSPEC_SPLIT_PRODUCTS": "0", "JAXSPEC_PIN_OUTPUT": "0", "JAXSPEC_LAYER_PRODUCTS": "0",
                    "JAXSPEC_LAYER_PRODUCT_SITES": "0", "JAXSPEC_STEP_KEYS_APART": "1"}
# jaxlib's own environment that changes how a program is run and timed (1: PJRT's TFRT GPU client instead of the
# stream-executor one, other transfer and launch paths); benchmark results record them beside SWITCHES
CLIENT_ENV = ("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT",)


def env_switch(name: str) -> bool | None:
    """An on/off switch of the environment (one of SWITCHES): "1" on, "0" off, None when unset."""
    value = os.environ.get(name)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def read_utf8(path: str, what: str = "file") -> str:
    """The text of the file at `path`; a missing file or one that is not UTF-8 is a ConfigError (saying where)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{what} not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rope:
    theta: float
    partial_factor: float = 1.0  # "proportional": only the first factor*d/2 frequencies rotate, denominator stays d
    scale: float = 1.0  # linear scaling factor (inv_freq / scale)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerGroup:
    """Layers whose weights have identical shapes, stacked on a leading axis."""

    name: str
    layer_type: str
    reuse: bool  # reads the store layer's K/V instead of computing its own
    layers: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    global_head_dim: int
    num_global_kv_heads: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rms_norm_eps: float = 1e-6
    rope_sliding: Rope = Rope(theta=10_000.0)
    rope_full: Rope = Rope(theta=1_000_000.0, partial_factor=0.25)
    final_logit_softcapping: float | None = 30.0
    hidden_size_per_layer_input: int = 0  # PLE width P (0: no per-layer embeddings)
    vocab_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    attention_k_eq_v: bool = False
    max_position_embeddings: int = 131072
    # gemma3_text switches
    norm_plus_one: bool = False  # RMSNorm weight applied as (1 + w)
    query_scale: float = 1.0  # gemma3: query_pre_attn_scalar ** -0.5
    use_v_norm: bool = True
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0
    bos_token_id: int = 2

    # ---- derived geometry -------------------------------------------------------------------------------------
    def layer_head_dim(self, i: int) -> int:
        return self.global_head_dim if self.layer_types[i] == FULL else self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        return self.num_global_kv_heads if self.layer_types[i] == FULL else self.num_kv_heads

    def type_head_dim(self, layer_type: str) -> int:
        return self.global_head_dim if layer_type == FULL else self.head_dim

    def type_kv_heads(self, layer_type: str) -> int:
        return self.num_global_kv_heads if layer_type == FULL else self.num_kv_heads

    def rope(self, layer_type: str) -> Rope:
        return self.rope_full if layer_type == FULL else self.rope_sliding

    @property
    def first_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def is_reuse(self, i: int) -> bool:
        return i >= self.first_shared_layer

    def has_v_proj(self, i: int) -> bool:
        return not (self.attention_k_eq_v and self.layer_types[i] == FULL)

    def mlp_size(self, i: int) -> int:
        return self.intermediate_size * (2 if self.use_double_wide_mlp and self.is_reuse(i) else 1)

    @functools.cached_property
    def store_layers(self) -> dict[str, int]:
        """For each attention type, the last non-shared layer of that type: the K/V the drafter reads."""
        out = {}
        for i in range(self.first_shared_layer):
            out[self.layer_types[i]] = i
        return out

    @functools.cached_property
    def kv_layers(self) -> dict[str, tuple[int, ...]]:
        """Non-shared layers of each type, in order: the layers that own K/V storage."""
        return {t: tuple(i for i in range(self.first_shared_layer) if self.layer_types[i] == t) for t in LAYER_TYPES}

    def kv_slot(self, i: int) -> tuple[str, int]:
        """(layer_type, index into that type's K/V stack) that layer i writes or, for a reuse layer, reads."""
        t = self.layer_types[i]
        src = self.store_layers[t] if self.is_reuse(i) else i
        return t, self.kv_layers[t].index(src)

    @functools.cached_property
    def groups(self) -> tuple[LayerGroup, ...]:
        out = []
        for t in LAYER_TYPES:
            for reuse in (False, True):
                layers = tuple(i for i in range(self.num_layers) if self.layer_types[i] == t and self.is_reuse(i) == reuse)
                if layers:
                    name = ("full" if t == FULL else "sliding") + ("_shared" if reuse else "")
                    out.append(LayerGroup(name=name, layer_type=t, reuse=reuse, layers=layers))
        return tuple(out)

    def group_of(self, i: int) -> tuple[str, int]:
        """(group name, index in its stack) of layer i."""
        return self._group_index[i]

    @functools.cached_property
    def _group_index(self) -> dict[int, tuple[str, int]]:
        return {i: (g.name, j) for g in self.groups for j, i in enumerate(g.layers)}

    def check_sizes(self) -> None:
        """Every count and width at least 1 (a 0 would divide by zero or build empty arrays further on)."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "global_head_dim", "num_global_kv_heads", "sliding_window",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    def validate(self) -> None:
        self.check_sizes()
        if self.num_kv_shared_layers >= self.num_layers:
            raise ConfigError(f"num_kv_shared_layers={self.num_kv_shared_layers} leaves no layer that stores K/V")
        for t in set(self.layer_types):
            if t not in LAYER_TYPES:
                raise ConfigError(f"unknown layer type {t!r}")
            if t not in self.store_layers:
                raise ConfigError(f"no non-shared {t} layer: shared layers of that type would have no K/V to read")
        if self.num_heads % self.num_kv_heads or self.num_heads % self.num_global_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of the KV head counts")
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ConfigError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AssistantConfig:
    model_type: str
    text: TargetConfig  # the drafter's own decoder (all layers "reuse": Q-only)
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_top_k: int = 32

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size


def check_pair(target: TargetConfig, assistant: AssistantConfig) -> None:
    """The drafter's queries attend the target's store-layer K/V: geometries must agree."""
    a = assistant.text
    problems = []
    if assistant.backbone_hidden_size != target.hidden_size:
        problems.append(f"backbone_hidden_size {assistant.backbone_hidden_size} != target hidden_size {target.hidden_size}")
    if a.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {a.vocab_size} != target vocab_size {target.vocab_size}")
    for t in sorted(set(a.layer_types)):
        if t not in target.store_layers:
            problems.append(f"target has no store layer of type {t}")
            continue
        if a.type_head_dim(t) != target.type_head_dim(t):
            problems.append(f"{t} head_dim {a.type_head_dim(t)} != target {target.type_head_dim(t)}")
        if a.type_kv_heads(t) != target.type_kv_heads(t):
            problems.append(f"{t} num_kv_heads {a.type_kv_heads(t)} != target {target.type_kv_heads(t)}")
    if a.num_heads % a.num_kv_heads or a.num_heads % a.num_global_kv_heads:
        problems.append(f"assistant num_attention_heads {a.num_heads} is not a multiple of its KV heads")
    if problems:
        raise ConfigError("assistant does not match target: " + "; ".join(problems))


# ---- presets: the public sizes (gemma4_arch.md §1.4), for random-weight benchmarks --------------------------------


def _pattern(n: int, every: int) -> tuple[str, ...]:
    t = [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]
    t[-1] = FULL
    return tuple(t)


PRESETS: dict[str, TargetConfig] = {
    "E2B": TargetConfig(
        model_type="gemma4_text", vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_layers=35,
        num_heads=8, num_kv_heads=1, head_dim=256, global_head_dim=512, num_global_kv_heads=1,
        layer_types=_pattern(35, 5), sliding_window=512, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144, num_kv_shared_layers=20, use_double_wide_mlp=True),
    "E4B": TargetConfig(
        model_type="gemma4_text", vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_layers=42,
        num_heads=8, num_kv_heads=2, head_dim=256, global_head_dim=512, num_global_kv_heads=2,
        layer_types=_pattern(42, 6), sliding_window=512, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144, num_kv_shared_layers=18),
    "26B-A4B": TargetConfig(
        model_type="gemma4_text", vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_layers=30,
        num_heads=16, num_kv_heads=8, head_dim=256, global_head_dim=512, num_global_kv_heads=2,
        layer_types=_pattern(30, 6), sliding_window=1024, attention_k_eq_v=True, enable_moe_block=True,
        num_experts=128, top_k_experts=8, moe_intermediate_size=704, max_position_embeddings=262144),
    "31B": TargetConfig(
        model_type="gemma4_text", vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_layers=60,
        num_heads=32, num_kv_heads=16, head_dim=256, global_head_dim=512, num_global_kv_heads=4,
        layer_types=_pattern(60, 6), sliding_window=1024, attention_k_eq_v=True, max_position_embeddings=262144),
}


def assistant_preset(target: TargetConfig, *, hidden_size: int = 256, num_layers: int = 4, num_heads: int = 4,
                     intermediate_size: int = 2048, ordered: bool = True, num_centroids: int = 2048,
                     centroid_top_k: int = 32) -> AssistantConfig:
    """A drafter shaped like the public ones (E2B/E4B: hidden 256, [S,S,S,F], 2048 centroids, top-32)."""
    types = tuple([SLIDING] * (num_layers - 1) + [FULL])
    text = dataclasses.replace(
        target, model_type="gemma4_text", hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, layer_types=types, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, num_kv_shared_layers=num_layers, use_double_wide_mlp=False,
        enable_moe_block=False, num_experts=0, top_k_experts=0, moe_intermediate_size=0,
        final_logit_softcapping=None)
    return AssistantConfig(model_type="gemma4_assistant", text=text, backbone_hidden_size=target.hidden_size,
                           use_ordered_embeddings=ordered, num_centroids=num_centroids, centroid_top_k=centroid_top_k)


# The benchmarks' "tiny" preset: E4B's structure (PLE, KV sharing, both attention types) at CPU sizes. Here, not in
# jaxspec.bench, so that the peer benchmark scripts (bench/peers, their own environments) share it without jax.
TINY = dataclasses.replace(
    PRESETS["E4B"], vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6, head_dim=16,
    global_head_dim=32, layer_types=(SLIDING, SLIDING, FULL) * 2, sliding_window=8, hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=512, num_kv_shared_layers=2)


def bench_pair(name: str) -> tuple[TargetConfig, AssistantConfig]:
    """(target, drafter) configs of a benchmark preset: "tiny" or a PRESETS name with its public-shaped drafter."""
    if name == "tiny":
        return TINY, assistant_preset(TINY, hidden_size=32, intermediate_size=64, num_centroids=16, centroid_top_k=4)
    return PRESETS[name], assistant_preset(PRESETS[name])


def rope_inv_freq(rope: Rope, head_dim: int, dtype=None):
    """Inverse frequencies [head_dim // 2] (numpy, computed in float32 as transformers does, or float64 for oracle
    runs); proportional RoPE leaves the tail at 0 (unrotated) and divides by the full head_dim."""
    import numpy as np

    dt = np.dtype(dtype or np.float32)
    rotated = int(rope.partial_factor * head_dim // 2)
    exponent = np.arange(0, 2 * rotated, 2).astype(dt) / dt.type(head_dim)
    inv = dt.type(1.0) / (dt.type(rope.theta) ** exponent)
    return (np.concatenate([inv, np.zeros(head_dim // 2 - rotated, dt)]) / dt.type(rope.scale)).astype(dt)


def embed_scale(hidden: int) -> float:
    return math.sqrt(hidden)
