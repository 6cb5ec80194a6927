"""Token choice on the device: greedy, sampling with temperature / top-k / top-p, and the speculative accept rule.

All functions are traced inside the engine's jitted steps. Per-row parameters are arrays, so one executable serves
a batch that mixes greedy and sampled requests. Randomness is keyed by (request seed, position), never by batch
layout, so a request's samples do not depend on which other requests share its batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters, one pytree (a program argument, or a per-slot table in the decode state)."""

    temperature: jax.Array  # f32[B]  0: greedy
    top_k: jax.Array  # i32[B]        0: off
    top_p: jax.Array  # f32[B]        1: off
    seed: jax.Array  # i32[B]         keys are derived from (seed, position)

    @staticmethod
    def build(params: list, rows: int) -> "SamplingMetadata":
        """Host arrays for `params` (objects with temperature / top_k / top_p / seed), padded greedy to `rows`."""
        pad = rows - len(params)
        arr = lambda xs, dt: np.pad(np.asarray(xs, dt), (0, pad))  # noqa: E731
        return SamplingMetadata(temperature=arr([p.temperature for p in params], np.float32),
                                top_k=arr([p.top_k for p in params], np.int32),
                                top_p=np.pad(np.asarray([p.top_p for p in params], np.float32), (0, pad),
                                             constant_values=1.0),
                                seed=arr([p.seed for p in params], np.int32))


def row_keys(seeds, positions, salt: int):
    """One PRNG key per row from its request seed and the position being decided. seeds, positions: int32[B]."""
    def key(s, p):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), salt)
    return jax.vmap(key)(seeds, positions)


def filtered_probs(logits, temperature, top_k, top_p):
    """Tempered, top-k and top-p filtered distribution. logits: [B, ..., V] fp32; per-row temperature (> 0), top_k
    (0: off), top_p (1: off) of shape [B]. Returns probabilities [B, ..., V] (fp32)."""
    extra = logits.ndim - 1
    bshape = (-1,) + (1,) * extra
    x = logits / temperature.reshape(bshape)
    V = x.shape[-1]
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V).reshape((-1,) + (1,) * (extra - 1) + (1,))
    kth = jnp.take_along_axis(sorted_x, (k - 1).astype(jnp.int32) * jnp.ones(sorted_x.shape[:-1] + (1,), jnp.int32),
                              axis=-1)
    x = jnp.where(x >= kth, x, -jnp.inf)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p (the crossing token included)
    sorted_p = jax.nn.softmax(jnp.where(sorted_x >= kth, sorted_x, -jnp.inf), axis=-1)
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each sorted token
    keep_sorted = before < top_p.reshape(bshape)
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x >= cutoff, x, -jnp.inf)
    return jax.nn.softmax(x, axis=-1)


def choose(logits, temperature, top_k, top_p, keys):
    """One token per row: argmax where temperature == 0, else a sample. logits: [B, V]; keys: [B]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = filtered_probs(logits, jnp.where(temperature > 0, temperature, 1.0), top_k, top_p)
    sampled = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, probs).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def accept_greedy(logits, drafts):
    """The greedy accept rule: d_{j+1} is accepted iff it is the argmax of verify row j; the bonus is the argmax of
    row n. logits: [B, k+1, V]; drafts: int32[B, k]. Returns (n int32[B], committed int32[B, k+1])."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    k = drafts.shape[1]
    n = jnp.sum(jnp.cumprod((drafts == target[:, :k]).astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return n, target  # target[:, :n] == drafts[:, :n] and target[:, n] is the bonus


def accept(logits, drafts, temperature, top_k, top_p, keys):
    """The speculative accept rule (DESIGN.md §3) for point-mass drafts.

    logits: [B, k+1, V] fp32, row j follows d_j (row 0 follows the pending token); drafts: int32[B, k].
    Greedy rows accept d_{j+1} iff it is the argmax of row j. Sampled rows accept d_{j+1} with probability
    p_j(d_{j+1}); at the first rejection, row n samples from p_n with d_{n+1} removed (renormalised); if all k are
    accepted the bonus is sampled from p_k. This keeps the output distribution equal to sampling the target alone.
    Returns (n_accepted int32[B], committed int32[B, k+1]: d_1..d_n then the bonus, the rest unspecified).
    """
    B, K1, V = logits.shape
    k = K1 - 1
    sampled = temperature > 0
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    probs = filtered_probs(logits, jnp.where(sampled, temperature, 1.0), top_k, top_p)  # [B, k+1, V]
    u_key, s_key = jax.vmap(lambda kk: jax.random.split(kk, 2))(keys).transpose(1, 0)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (max(k, 1),)))(u_key)[:, :k]  # [B, k]
    p_draft = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, k]
    ok = jnp.where(sampled[:, None], u < p_draft, drafts == greedy_ids[:, :k])
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # leading accepts
    p_n = jnp.take_along_axis(probs, n[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = jnp.take_along_axis(jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], 1), n[:, None], 1)[:, 0]
    residual = jnp.where((n < k)[:, None] & (jnp.arange(V)[None, :] == rejected[:, None]), 0.0, p_n)
    bonus_sampled = jax.vmap(lambda kk, p: jax.random.categorical(kk, jnp.log(p)))(s_key, residual).astype(jnp.int32)
    bonus = jnp.where(sampled, bonus_sampled, jnp.take_along_axis(greedy_ids, n[:, None], 1)[:, 0])
    committed = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    committed = committed.at[jnp.arange(B), n].set(bonus)
    return n, committed
