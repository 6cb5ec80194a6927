"""`python -m jaxspec.distill`: train a `gemma4_assistant` drafter for a frozen target on the target's own greedy
continuations, with exactly the objective the drafter is used with (DESIGN.md §3).

Data: prompts -> the target's greedy continuation (jitted dense forward, batched) -> one teacher-forced dense forward
over prompt + continuation giving, per position, the post-norm hidden and the store-layer K/V.

Example at continuation position p (cached_len = p): pending token tok[p], seed hidden hidden[p-1]; every drafter
layer attends its store layer's K/V window (full: [0, p); sliding: the last W+1 positions); k recurrent steps at
position p, step j+1 fed the teacher token tok[p+j] (a wrong draft rejects the rest anyway) and step j's h_next;
step j predicts tok[p+j]. All positions of a sequence run in parallel through the engine's own `draft_hidden`, with a
training `attend` that masks per query.

Head: the plain tied head over a reduced vocabulary. Only the K most frequent target outputs of the training data
get trainable rows; every other row is exactly zero (logit 0 at inference), so the loss is the exact inference
head's: logsumexp = logaddexp(lse(kept logits), log(V - K)), never the V-wide vector.

Precision: fp32 master params and optimiser state; the forward runs in --dtype (bf16 on a GPU: bf16 weights and
activations, fp32 norms and accumulation, as the engine runs it).

Outputs: the HF assistant folder (--out, bf16, loads with `load_assistant`), its packed form for shipping
(`jaxspec.model.packed`, --packed-out) and distill.json (hyperparameters, data sizes, final metrics).
Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec import corpus
from jaxspec.cli import Parser, run_cli
from jaxspec.config import SLIDING, AssistantConfig, ConfigError, TargetConfig, check_pair
from jaxspec.model import gemma4
from jaxspec.model.hf import assistant_config_from_dict, assistant_generation_config, assistant_hf_config
from jaxspec.model.assistant import draft_hidden
from jaxspec.model.packed import pack_assistant, save_assistant
from jaxspec.model.weights import F32_LEAVES, compute_dtype, load_target, random_assistant_params
from jaxspec.pallas.reference import attention


# ---- data: greedy continuations and the teacher-forced forward -------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 3))
def _greedy(params, cfg: TargetConfig, prompts, new_tokens: int):
    """Greedy continuation int32[B, new_tokens] of prompts int32[B, P] (dense cache, one scan over decode steps)."""
    B, P = prompts.shape
    cache = gemma4.init_dense_cache(cfg, B, P + new_tokens, params["embed"].dtype)

    def next_token(cache, tokens, positions):
        hidden, cache = gemma4.forward(params, cfg, tokens, positions, gemma4.dense_attend(cfg, positions), cache)
        return jnp.argmax(gemma4.logits(params, cfg, hidden[:, -1]), axis=-1).astype(jnp.int32), cache

    first, cache = next_token(cache, prompts, jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)))

    def step(carry, pos):
        token, cache = next_token(carry[1], carry[0][:, None], jnp.full((B, 1), pos, jnp.int32))
        return (token, cache), token

    _, rest = jax.lax.scan(step, (first, cache), P + jnp.arange(new_tokens - 1, dtype=jnp.int32))
    return jnp.concatenate([first[:, None], rest.T], axis=1)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _teacher(params, cfg: TargetConfig, tokens, types: tuple[str, ...]):
    """One dense forward over tokens int32[B, T]: post-norm hidden [B, T, H] and the store layers' K/V
    {'{type}_k': [B, T, KVH, d], '{type}_v': ...}."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = gemma4.init_dense_cache(cfg, B, T, params["embed"].dtype)
    hidden, cache = gemma4.forward(params, cfg, tokens, positions, gemma4.dense_attend(cfg, positions), cache)
    return {"hidden": hidden} | {f"{t}_{x}": cache[f"{t}_{x}"][-1] for t in types for x in "kv"}


def _padded_batches(n: int, batch: int):
    """(rows, padded rows) chunks of range(n); the last chunk is padded with row 0 so every call has one shape."""
    for s in range(0, n, batch):
        rows = np.arange(s, min(n, s + batch))
        yield rows, np.concatenate([rows, np.zeros(min(batch, n) - len(rows), np.int64)])


def build_dataset(params, cfg: TargetConfig, prompts: list[list[int]], new_tokens: int, types, batch: int) -> dict:
    """Sequences ready for training, as device arrays:

    tokens int32[N, T] (prompt + greedy continuation, zero-padded; T = longest prompt + new_tokens),
    prompt_len int32[N], end int32[N] (the last position a draft may target: the continuation's end or its first
    EOS), hidden [N, T, H], '{type}_k' / '{type}_v' [N, T, KVH, d] for each store type in `types`.
    """
    N, L = len(prompts), max(len(p) for p in prompts)
    T = L + new_tokens
    tokens = np.zeros((N, T), np.int32)
    prompt_len = np.asarray([len(p) for p in prompts], np.int32)
    for P in sorted(set(prompt_len.tolist())):  # one compiled program per prompt length
        idx = np.flatnonzero(prompt_len == P)
        group = np.asarray([prompts[i] for i in idx], np.int32)
        for rows, padded in _padded_batches(len(idx), batch):
            out = np.asarray(_greedy(params, cfg, jnp.asarray(group[padded]), new_tokens))
            tokens[idx[rows], :P] = group[rows]
            tokens[idx[rows][:, None], P + np.arange(new_tokens)] = out[: len(rows)]
    pos = np.arange(T)[None, :]
    cont = (pos >= prompt_len[:, None]) & (pos < prompt_len[:, None] + new_tokens)
    eos = cont & np.isin(tokens, list(cfg.eos_token_ids))
    end = np.where(eos.any(1), np.argmax(eos, axis=1), prompt_len + new_tokens - 1).astype(np.int32)
    parts = []
    for rows, padded in _padded_batches(N, batch):
        out = _teacher(params, cfg, jnp.asarray(tokens[padded]), tuple(types))
        parts.append(jax.tree.map(lambda a: a[: len(rows)], out))
    data = jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
    return data | {"tokens": jnp.asarray(tokens), "prompt_len": jnp.asarray(prompt_len), "end": jnp.asarray(end)}


def draft_targets(data: dict) -> np.ndarray:
    """Every token a draft step is trained to predict (positions prompt_len+1 .. end of each sequence)."""
    tokens, P, end = (np.asarray(data[n]) for n in ("tokens", "prompt_len", "end"))
    pos = np.arange(tokens.shape[1])[None, :]
    return tokens[(pos > P[:, None]) & (pos <= end[:, None])]


# ---- the reduced-vocabulary head -------------------------------------------------------------------------------------


def kept_vocabulary(targets: np.ndarray, keep: int, vocab_size: int) -> np.ndarray:
    """The `keep` most frequent target tokens (ties: lower id first), as sorted ids int32[K] (K <= keep: tokens
    that never occur get no row)."""
    counts = np.bincount(targets, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[: min(keep, np.count_nonzero(counts))]).astype(np.int32)


def vocab_head(kept_ids: np.ndarray, vocab_size: int) -> dict:
    """ids int32[K] (sorted), index int32[V] (row of each token, -1: a zero row), free: the lowest zero-row id."""
    index = np.full(vocab_size, -1, np.int32)
    index[kept_ids] = np.arange(len(kept_ids), dtype=np.int32)
    zero_rows = np.flatnonzero(index < 0)
    free = int(zero_rows[0]) if len(zero_rows) else vocab_size
    return {"ids": jnp.asarray(kept_ids), "index": jnp.asarray(index), "free": jnp.asarray(free, jnp.int32)}


def head_outputs(kept_embed, head: dict, vocab_size: int, hn, labels):
    """Cross-entropy and greedy token of the inference head (logits hn·E over all V rows, zero outside the kept
    rows), computed on the kept rows only. hn: [M, Ha]; labels int32[M]. Returns (ce fp32[M], token int32[M])."""
    logits = jnp.einsum("mh,kh->mk", hn, kept_embed, preferred_element_type=jnp.float32)  # [M, K]
    zero_rows = vocab_size - kept_embed.shape[0]
    lse = jax.nn.logsumexp(logits, axis=-1)
    if zero_rows:
        lse = jnp.logaddexp(lse, math.log(zero_rows))
    row = head["index"][labels]
    label_logit = jnp.take_along_axis(logits, jnp.maximum(row, 0)[:, None], axis=1)[:, 0]
    ce = lse - jnp.where(row >= 0, label_logit, 0.0)
    best, kept_token = jnp.max(logits, axis=-1), head["ids"][jnp.argmax(logits, axis=-1)]
    # argmax over the full vector: a zero row (the lowest free id) wins unless a kept logit beats 0; ties go to the
    # lower id, as jnp.argmax does (kept ids are sorted, so argmax over them already picks the lowest)
    kept_wins = (best > 0) | ((best == 0) & (kept_token < head["free"])) | (head["free"] >= vocab_size)
    return ce, jnp.where(kept_wins, kept_token, head["free"]).astype(jnp.int32)


# ---- the training forward: every continuation position of every sequence at once -------------------------------------


def window_mask(layer_type: str, cached_len, num_keys: int, window: int):
    """bool[B, Q, S]: the keys a drafter query at cached_len int32[B, Q] reads (DESIGN.md §3): full layers
    [0, cached_len), sliding layers the last W+1 positions [max(0, cached_len - W - 1), cached_len)."""
    kpos = jnp.arange(num_keys, dtype=jnp.int32)
    c = cached_len[..., None]
    valid = kpos < c
    if layer_type == SLIDING:
        valid &= kpos >= c - window - 1
    return valid


def training_attend(acfg: AssistantConfig, cached_len, num_keys: int):
    """An `Attend` for `draft_hidden` over dense per-sequence store K/V (the `cache` argument: {'{t}_k': [B, S, KVH,
    d], ...}); drafter rows are the B*Q (sequence, position) pairs of cached_len int32[B, Q]."""
    B, Q = cached_len.shape
    types = acfg.text.layer_types
    masks = {t: window_mask(t, cached_len, num_keys, acfg.text.sliding_window) for t in set(types)}

    def attend(store, i, q, k, v):
        t = types[i]
        out = attention(q.reshape(B, Q, *q.shape[2:]), store[f"{t}_k"], store[f"{t}_v"], masks[t])
        return out.reshape(q.shape), store

    return attend


def draft_forward(params, acfg: AssistantConfig, target_embed, batch: dict, k: int, num_queries: int):
    """k teacher-forced drafter steps at the first `num_queries` continuation positions of each sequence.

    batch: a slice of `build_dataset`'s arrays (B sequences). params: the drafter weights `draft_hidden` reads.
    Returns hn [k, B*Q, Ha], labels int32[k, B*Q] (step j's target tok[p + j]) and mask bool[k, B*Q].
    """
    tokens = batch["tokens"]
    B, T = tokens.shape
    cached_len = batch["prompt_len"][:, None] + jnp.arange(num_queries, dtype=jnp.int32)[None, :]  # [B, Q]

    def token_at(pos):
        return jnp.take_along_axis(tokens, jnp.minimum(pos, T - 1), axis=1).reshape(-1)

    seed = jnp.take_along_axis(batch["hidden"], (cached_len - 1)[:, :, None], axis=1).reshape(B * num_queries, -1)
    store = {f"{t}_{x}": batch[f"{t}_{x}"] for t in set(acfg.text.layer_types) for x in "kv"}
    attend = training_attend(acfg, cached_len, T)
    positions = cached_len.reshape(-1)
    tok, h, hns, labels, masks = token_at(cached_len), seed, [], [], []
    for j in range(1, k + 1):
        hn, h = draft_hidden(params, acfg, target_embed, tok, h, positions, attend, store)
        tok = token_at(cached_len + j)  # step j's target, and step j+1's input
        hns.append(hn)
        labels.append(tok)
        masks.append((cached_len + j <= batch["end"][:, None]).reshape(-1))
    return jnp.stack(hns), jnp.stack(labels), jnp.stack(masks)


def compute_params(params, dtype):
    """The forward's copy of fp32 master params: matrices in `dtype`, norms and scalars fp32 (as the engine loads)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if path[-1].key in F32_LEAVES else x.astype(dtype), params)


# ---- training --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    k: int = 3
    steps: int = 2000
    batch: int = 32  # sequences per step (each gives new_tokens - 1 positions x k steps)
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    dtype: str = "fp32"  # forward dtype; master params are fp32


def make_optimizer(tc: TrainConfig):
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, max(tc.steps, tc.warmup + 1), tc.lr * 0.1)
    decay = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731  (no decay on norms, scalars)
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay))


def init_params(acfg: AssistantConfig, num_kept: int, seed: int) -> dict:
    """fp32 master params: `draft_hidden`'s weights (random matrices, unit norms and layer scalars, q_norm at
    d^-1/2 so initial attention logits are O(1) at attention scale 1) and kept_embed [K, Ha]."""
    params = {n: a for n, a in random_assistant_params(acfg, seed, jnp.float32).items() if n != "embed"}
    params["final_norm"] = jnp.ones_like(params["final_norm"])
    for w in params["layers"].values():
        w["norms"], w["layer_scalar"] = jnp.ones_like(w["norms"]), jnp.ones_like(w["layer_scalar"])
        w["q_norm"] = jnp.full_like(w["q_norm"], w["q_norm"].shape[-1] ** -0.5)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 7)
    params["kept_embed"] = 0.02 * jax.random.normal(key, (num_kept, acfg.hidden_size), jnp.float32)
    return params


def _metrics(params, acfg, tc: TrainConfig, num_queries, head, target_embed, batch):
    """(mean loss, (sums: per-step ce / correct / count, lead int32[B, Q], full bool[B, Q])).

    lead: the leading correct drafts at each position, -1 where no step has a target. Teacher inputs equal the
    drafts up to the first wrong one, so this is exactly what the engine accepts at that cached_len.
    full: positions where all k steps have a target.
    """
    cparams = compute_params(params, compute_dtype(tc.dtype))
    hn, labels, mask = draft_forward(cparams, acfg, target_embed, batch, tc.k, num_queries)
    ce, token = head_outputs(cparams["kept_embed"], head, acfg.vocab_size, hn.reshape(-1, hn.shape[-1]),
                             labels.reshape(-1))
    ce, correct = ce.reshape(labels.shape), (token.reshape(labels.shape) == labels) & mask
    count = mask.sum(axis=1)
    lead = jnp.where(mask[0], jnp.cumprod(correct, axis=0).sum(axis=0), -1)
    rows = (batch["tokens"].shape[0], num_queries)
    sums = {"ce": jnp.where(mask, ce, 0.0).sum(axis=1), "correct": correct.sum(axis=1), "count": count}
    return sums["ce"].sum() / jnp.maximum(count.sum(), 1), (sums, lead.reshape(rows), mask.all(axis=0).reshape(rows))


def _gather(data, rows):
    return {n: a[rows] for n, a in data.items()}


@functools.partial(jax.jit, static_argnums=(1, 2, 3), donate_argnums=(0,))
def train_step(state, acfg: AssistantConfig, tc: TrainConfig, num_queries: int, head, target_embed, data, rows):
    grad_fn = jax.value_and_grad(_metrics, has_aux=True)
    (_, (sums, _, _)), grads = grad_fn(state["params"], acfg, tc, num_queries, head, target_embed,
                                       _gather(data, rows))
    updates, opt_state = make_optimizer(tc).update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
            "step": state["step"] + 1}, sums


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def eval_step(params, acfg: AssistantConfig, tc: TrainConfig, num_queries: int, head, target_embed, data, rows, live):
    batch = _gather(data, rows)
    batch["end"] = jnp.where(live, batch["end"], -1)  # padding rows target nothing
    return _metrics(params, acfg, tc, num_queries, head, target_embed, batch)[1]


def summarize(sums) -> dict:
    s = jax.device_get(sums)
    count = np.maximum(s["count"], 1)
    return {"loss": float(s["ce"].sum() / max(s["count"].sum(), 1)),
            "loss_per_step": (s["ce"] / count).tolist(), "accuracy_per_step": (s["correct"] / count).tolist(),
            "positions": int(s["count"][0])}


def replay_rounds(lead: np.ndarray) -> np.ndarray:
    """Accept lengths of the engine's greedy rounds along each continuation (lead int[N, Q] from `_metrics`): the
    first round runs at the first continuation position, a round at q commits lead[q] + 1 tokens and the next one
    starts right after them, until a position without targets (-1)."""
    lengths = []
    for row in lead:
        q = 0
        while q < len(row) and row[q] >= 0:
            lengths.append(int(row[q]) + 1)
            q += int(row[q]) + 1
    return np.asarray(lengths)


def evaluate(params, acfg, tc: TrainConfig, num_queries: int, head, target_embed, data) -> dict:
    """Loss and per-step accuracy over every position of every sequence of `data`, and the accept length:
    `expected_accept_length` replays the engine's greedy rounds along each continuation (what `generate` reports on
    these prompts with max_new_tokens = new_tokens); `accept_length_per_position` is the mean of leading correct
    drafts + 1 over every position with k targets (higher: easy stretches take one round, but count at each
    position)."""
    n = data["tokens"].shape[0]
    total, leads, fulls = None, [], []
    for rows, padded in _padded_batches(n, tc.batch):
        live = jnp.arange(len(padded)) < len(rows)
        sums, lead, full = eval_step(params, acfg, tc, num_queries, head, target_embed, data, jnp.asarray(padded),
                                     live)
        total = sums if total is None else jax.tree.map(jnp.add, total, sums)
        leads.append(np.asarray(lead)[: len(rows)])
        fulls.append(np.asarray(full)[: len(rows)])
    lead, full = np.concatenate(leads), np.concatenate(fulls)
    rounds = replay_rounds(lead)
    return summarize(total) | {
        "expected_accept_length": float(rounds.mean()) if len(rounds) else 0.0, "rounds": int(len(rounds)),
        "accept_length_per_position": float((lead[full] + 1).mean()) if full.any() else 0.0}


def checkpoint_vocabulary(ckpt_dir: str, run: dict, targets: np.ndarray, vocab_size: int) -> np.ndarray:
    """The kept ids of the run checkpointed in ckpt_dir: a resumed run keeps its vocabulary (regenerated data may
    differ) and must have the same drafter, k and --keep-vocab (`run`); a new directory records this run's."""
    os.makedirs(ckpt_dir, exist_ok=True)
    run_path, ids_path = os.path.join(ckpt_dir, "run.json"), os.path.join(ckpt_dir, "kept_ids.npy")
    if os.path.isfile(run_path) and os.path.isfile(ids_path):
        with open(run_path) as f:
            saved = json.load(f)
        differ = sorted(n for n in run.keys() | saved.keys() if run.get(n) != saved.get(n))
        if differ:
            raise ConfigError(f"the checkpoint in {ckpt_dir} does not match this run (other {', '.join(differ)})")
        return np.load(ids_path)
    kept_ids = kept_vocabulary(targets, run["keep_vocab"], vocab_size)
    np.save(ids_path, kept_ids)
    with open(run_path, "w") as f:
        json.dump(run, f, indent=1)
    return kept_ids


def _restore(mgr, state, ckpt_dir: str):
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    try:
        return mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(abstract))
    except (ValueError, KeyError) as e:  # another run's checkpoint (other sizes, vocabulary or optimiser)
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"the checkpoint in {ckpt_dir} does not match this run: {first_line}") from None


def train(params, acfg: AssistantConfig, tc: TrainConfig, num_queries: int, head, target_embed, data, *,
          ckpt_dir: str | None = None, ckpt_every: int = 500, eval_data=None, eval_every: int = 0,
          log_every: int = 10, progress: bool = True):
    """Run tc.steps optimiser steps on `data`, saving the training state to ckpt_dir every ckpt_every steps and
    resuming from its latest checkpoint. Returns (fp32 params, the step training resumed from)."""
    import orbax.checkpoint as ocp

    state = {"params": params, "opt_state": make_optimizer(tc).init(params), "step": jnp.zeros((), jnp.int32)}
    if not ckpt_dir:
        return _train_steps(state, None, acfg, tc, num_queries, head, target_embed, data, ckpt_every, eval_data,
                            eval_every, log_every, progress)
    with ocp.CheckpointManager(os.path.abspath(ckpt_dir), options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=False)) as mgr:
        if mgr.latest_step() is not None:
            state = _restore(mgr, state, ckpt_dir)
        return _train_steps(state, mgr, acfg, tc, num_queries, head, target_embed, data, ckpt_every, eval_data,
                            eval_every, log_every, progress)


def _train_steps(state, mgr, acfg, tc: TrainConfig, num_queries, head, target_embed, data, ckpt_every, eval_data,
                 eval_every, log_every, progress):
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    start = int(state["step"])
    n = data["tokens"].shape[0]
    B = min(tc.batch, n)
    with tqdm(total=tc.steps, initial=start, desc="distill", file=sys.stderr, disable=not progress) as bar:
        for s in range(start, tc.steps):
            rows = np.random.default_rng([tc.seed, s]).choice(n, B, replace=False)
            state, sums = train_step(state, acfg, tc, num_queries, head, target_embed, data, jnp.asarray(rows))
            bar.update(1)
            done = s + 1
            if done % log_every == 0 or done == tc.steps:
                m = summarize(sums)
                bar.set_postfix_str(f"loss {m['loss']:.3f} acc "
                                    + "/".join(f"{a:.2f}" for a in m["accuracy_per_step"]))
            if mgr is not None and (done % ckpt_every == 0 or done == tc.steps):
                mgr.save(done, args=ocp.args.StandardSave(state))
            if eval_data is not None and eval_every and done % eval_every == 0 and done < tc.steps:
                m = evaluate(state["params"], acfg, tc, num_queries, head, target_embed, eval_data)
                bar.write(f"step {done}: held-out loss {m['loss']:.3f}, accuracy "
                          + " ".join(f"{a:.3f}" for a in m["accuracy_per_step"])
                          + f", accept length {m['expected_accept_length']:.2f}")
    return state["params"], start


# ---- export ----------------------------------------------------------------------------------------------------------


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


# ---- CLI -------------------------------------------------------------------------------------------------------------



def parse_args(argv=None):
    p = Parser(prog="python -m jaxspec.distill", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="target checkpoint folder (HF layout)")
    p.add_argument("--out", required=True, help="HF assistant folder to write")
    p.add_argument("--packed-out", default=None, help="packed form for shipping (default OUT/packed)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", default=None, help="prompt_ids JSONL (python -m jaxspec.corpus); no tokenizer")
    src.add_argument("--corpus", choices=("pydoc",), default=None,
                     help="built-in corpus (the default; needs the model folder's tokenizer)")
    p.add_argument("--heldout-out", default=None, help="with --corpus: write the held-out prompts as text lines")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64, help="with --corpus: tokens per prompt")
    p.add_argument("--stride", type=int, default=None, help="with --corpus: tokens between prompts (default len/2)")
    p.add_argument("--num-prompts", type=int, default=4096, help="at most this many training prompts")
    p.add_argument("--num-heldout", type=int, default=256, help="at most this many held-out prompts")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--k", type=int, default=3, help="draft steps trained (num_speculative_tokens)")
    p.add_argument("--keep-vocab", type=int, default=16384, help="tokens with a trainable embedding row")
    p.add_argument("--assistant-hidden", type=int, default=256)
    p.add_argument("--assistant-layers", type=int, default=4)
    p.add_argument("--assistant-heads", type=int, default=4)
    p.add_argument("--assistant-intermediate", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen-batch", type=int, default=256, help="sequences per target forward while building data")
    p.add_argument("--ckpt-dir", default=None, help="orbax checkpoints of the training state (resumed if present)")
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=500, help="held-out evaluation every N steps (0: at the end)")
    p.add_argument("--dtype", default=None, help="forward dtype bf16 or fp32 (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _check_args(args) -> None:
    for name in ("new_tokens", "steps", "batch", "k", "keep_vocab", "gen_batch", "ckpt_every", "num_prompts",
                 "num_heldout"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.new_tokens < args.k + 1:
        raise ConfigError(f"--new-tokens {args.new_tokens} leaves no position with {args.k} draft targets "
                          f"(needs >= k + 1 = {args.k + 1})")
    if args.lr <= 0 or args.warmup < 0 or args.weight_decay < 0 or args.clip <= 0 or args.eval_every < 0:
        raise ConfigError("--lr and --clip must be > 0; --warmup, --weight-decay and --eval-every >= 0")
    if args.heldout_out and args.prompts:
        raise ConfigError("--heldout-out writes corpus prompts as text; it needs --corpus, not --prompts")


def _prompts(args, cfg: TargetConfig) -> tuple[list, list, str]:
    """(train, held-out) prompt ids, subsampled deterministically, and a description of the source."""
    if args.prompts:
        rows, source = corpus.read_prompt_ids(args.prompts), args.prompts
    else:
        tokenizer = corpus.load_tokenizer_or_fail(args.model)
        rows = corpus.cut_prompts(tokenizer, corpus.pydoc_topics(), args.prompt_len,
                                  args.stride or max(1, args.prompt_len // 2))
        source = f"pydoc_data.topics (prompt_len {args.prompt_len})"
        if args.heldout_out:
            corpus.write_heldout_text(args.heldout_out, tokenizer, rows)
    train_ids, held_ids = corpus.split_rows(rows)
    if not train_ids or not held_ids:
        raise ConfigError(f"{source}: needs both training and held-out prompts "
                          f"(got {len(train_ids)} and {len(held_ids)})")
    rng = np.random.default_rng(args.seed)
    train_ids = [train_ids[i] for i in sorted(rng.permutation(len(train_ids))[: args.num_prompts])]
    held_ids = [held_ids[i] for i in sorted(rng.permutation(len(held_ids))[: args.num_heldout])]
    for ids in train_ids + held_ids:
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} outside the vocabulary (0..{cfg.vocab_size - 1})")
        if len(ids) + args.new_tokens > cfg.max_position_embeddings:
            raise ConfigError(f"a prompt of {len(ids)} tokens + {args.new_tokens} new tokens exceeds the context of "
                              f"{cfg.max_position_embeddings}")
    return train_ids, held_ids, source


def run(args) -> int:
    _check_args(args)
    dtype_name = args.dtype or ("fp32" if jax.default_backend() == "cpu" else "bf16")
    dtype = compute_dtype(dtype_name)
    cfg, tparams = load_target(args.model, dtype)
    config = assistant_hf_config(cfg, hidden_size=args.assistant_hidden, num_layers=args.assistant_layers,
                                 num_heads=args.assistant_heads, intermediate_size=args.assistant_intermediate)
    acfg = assistant_config_from_dict(config)
    check_pair(cfg, acfg)
    train_ids, held_ids, source = _prompts(args, cfg)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))  # noqa: E731
    log(f"target {args.model} ({cfg.model_type}); {len(train_ids)} train / {len(held_ids)} held-out prompts "
        f"from {source}; {jax.default_backend()} {dtype_name}")

    t0 = time.perf_counter()
    types = tuple(sorted(set(acfg.text.layer_types)))
    train_data = build_dataset(tparams, cfg, train_ids, args.new_tokens, types, args.gen_batch)
    held_data = build_dataset(tparams, cfg, held_ids, args.new_tokens, types, args.gen_batch)
    jax.block_until_ready(held_data)
    t_data = time.perf_counter() - t0
    log(f"data: {len(train_ids) + len(held_ids)} sequences of up to {train_data['tokens'].shape[1]} tokens in "
        f"{t_data:.1f} s")

    targets = draft_targets(train_data)
    if not len(targets):
        raise ConfigError("the training continuations have no draft targets (every one ends at once with EOS)")
    if args.ckpt_dir:
        kept_ids = checkpoint_vocabulary(args.ckpt_dir, {"assistant": config, "k": args.k,
                                                         "keep_vocab": args.keep_vocab}, targets, cfg.vocab_size)
    else:
        kept_ids = kept_vocabulary(targets, args.keep_vocab, cfg.vocab_size)
    head = vocab_head(kept_ids, cfg.vocab_size)
    num_queries = args.new_tokens - 1
    tc = TrainConfig(k=args.k, steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup,
                     weight_decay=args.weight_decay, clip=args.clip, seed=args.seed, dtype=dtype_name)
    target_embed = tparams["embed"]
    log(f"{len(kept_ids)} kept tokens cover {np.isin(targets, kept_ids).mean():.4f} of the training targets")

    t0 = time.perf_counter()
    params, resumed = train(init_params(acfg, len(kept_ids), args.seed), acfg, tc, num_queries, head, target_embed,
                            train_data, ckpt_dir=args.ckpt_dir, ckpt_every=args.ckpt_every, eval_data=held_data,
                            eval_every=args.eval_every, progress=not args.quiet)
    t_train = time.perf_counter() - t0

    aparams = export_params(params, kept_ids, cfg.vocab_size)
    save_assistant(args.out, config, acfg, aparams,
                   extra_json={"generation_config.json": assistant_generation_config(cfg, args.k)})
    final = kept_view(aparams, kept_ids)  # metrics of the saved (bf16-rounded) weights
    sample = {n: a[: held_data["tokens"].shape[0]] for n, a in train_data.items()}
    train_m = evaluate(final, acfg, tc, num_queries, head, target_embed, sample)
    held_m = evaluate(final, acfg, tc, num_queries, head, target_embed, held_data)
    report = {
        "target": os.path.abspath(args.model), "target_model_type": cfg.model_type, "k": args.k,
        "assistant": {"hidden_size": acfg.hidden_size, "num_layers": acfg.text.num_layers,
                      "num_heads": acfg.text.num_heads, "intermediate_size": acfg.text.intermediate_size,
                      "layer_types": list(acfg.text.layer_types), "sliding_window": acfg.text.sliding_window},
        "vocab": {"size": cfg.vocab_size, "keep_vocab": args.keep_vocab, "kept": int(len(kept_ids)),
                  "kept_target_coverage": float(np.isin(targets, kept_ids).mean())},
        "data": {"source": source, "train_prompts": len(train_ids), "heldout_prompts": len(held_ids),
                 "new_tokens": args.new_tokens, "prompt_lengths": sorted({len(p) for p in train_ids + held_ids}),
                 "train_draft_targets": int(len(targets))},
        "train": dataclasses.asdict(tc) | {"master_dtype": "fp32", "resumed_from_step": resumed,
                                           "saved_dtype": "bf16"},
        "final": {"train_sample": train_m, "heldout": held_m,
                  "expected_accept_length_heldout": held_m["expected_accept_length"]},
        "seconds": {"data": round(t_data, 1), "train": round(t_train, 1)},
    }
    with open(os.path.join(args.out, "distill.json"), "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    packed_out = args.packed_out or os.path.join(args.out, "packed")
    files = pack_assistant(args.out, packed_out)
    acc = " ".join(f"{a:.3f}" for a in held_m["accuracy_per_step"])
    print(f"held-out loss {held_m['loss']:.4f}, accuracy per step {acc}, expected accept length "
          f"{held_m['expected_accept_length']:.2f} (per position {held_m['accept_length_per_position']:.2f}); "
          f"train sample loss {train_m['loss']:.4f}")
    print(f"assistant -> {args.out}; packed ({len(files)} files) -> {packed_out}")
    return 0


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
