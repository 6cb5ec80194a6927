"""Training: AdamW on fp32 master params (the forward in TrainConfig.dtype), the jitted train and eval steps, the
loop with its resumable orbax checkpoints, and the evaluation (loss, per-step accuracy, the engine's accept length).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.config import AssistantConfig, ConfigError
from jaxspec.distill.data import kept_vocabulary, padded_batches
from jaxspec.distill.objective import compute_params, draft_forward, head_outputs
from jaxspec.model.weights import compute_dtype, random_assistant_params


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainContext:
    """What every train and eval step of a run shares besides the params and the data: static fields (compiled into
    the step programs) and the arrays the objective reads."""

    acfg: AssistantConfig = dataclasses.field(metadata=dict(static=True))
    tc: TrainConfig = dataclasses.field(metadata=dict(static=True))
    num_queries: int = dataclasses.field(metadata=dict(static=True))  # continuation positions per sequence
    head: dict  # `vocab_head`: ids int32[K], index int32[V], free int32[]
    target_embed: jax.Array  # [V, Ht] the target's embedding (the drafter's token input)


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


def _metrics(params, ctx: TrainContext, batch):
    """(mean loss, (sums: per-step ce / correct / count, lead int32[B, Q], full bool[B, Q])).

    lead: the leading correct drafts at each position, -1 where no step has a target. Teacher inputs equal the
    drafts up to the first wrong one, so this is exactly what the engine accepts at that cached_len.
    full: positions where all k steps have a target.
    """
    cparams = compute_params(params, compute_dtype(ctx.tc.dtype))
    hn, labels, mask = draft_forward(cparams, ctx.acfg, ctx.target_embed, batch, ctx.tc.k, ctx.num_queries)
    ce, token = head_outputs(cparams["kept_embed"], ctx.head, ctx.acfg.vocab_size, hn.reshape(-1, hn.shape[-1]),
                             labels.reshape(-1))
    ce, correct = ce.reshape(labels.shape), (token.reshape(labels.shape) == labels) & mask
    count = mask.sum(axis=1)
    lead = jnp.where(mask[0], jnp.cumprod(correct, axis=0).sum(axis=0), -1)
    rows = (batch["tokens"].shape[0], ctx.num_queries)
    sums = {"ce": jnp.where(mask, ce, 0.0).sum(axis=1), "correct": correct.sum(axis=1), "count": count}
    return sums["ce"].sum() / jnp.maximum(count.sum(), 1), (sums, lead.reshape(rows), mask.all(axis=0).reshape(rows))


def _gather(data, rows):
    return {n: a[rows] for n, a in data.items()}


@functools.partial(jax.jit, donate_argnums=(0,))
def train_step(state, ctx: TrainContext, data, rows):
    """One optimiser step on the sequences `rows` int32[B] of `data`; returns (state, sums of `_metrics`)."""
    grad_fn = jax.value_and_grad(_metrics, has_aux=True)
    (_, (sums, _, _)), grads = grad_fn(state["params"], ctx, _gather(data, rows))
    updates, opt_state = make_optimizer(ctx.tc).update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
            "step": state["step"] + 1}, sums


@jax.jit
def eval_step(params, ctx: TrainContext, data, rows, live):
    """`_metrics`' (sums, lead, full) of the sequences `rows` int32[B] of `data`; rows where live bool[B] is False
    are padding."""
    batch = _gather(data, rows)
    batch["end"] = jnp.where(live, batch["end"], -1)  # padding rows target nothing
    return _metrics(params, ctx, batch)[1]


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


def evaluate(params, ctx: TrainContext, data) -> dict:
    """Loss and per-step accuracy over every position of every sequence of `data`, and the accept length:
    `expected_accept_length` replays the engine's greedy rounds along each continuation (what `generate` reports on
    these prompts with max_new_tokens = new_tokens); `accept_length_per_position` is the mean of leading correct
    drafts + 1 over every position with k targets (higher: easy stretches take one round, but count at each
    position)."""
    n = data["tokens"].shape[0]
    total, leads, fulls = None, [], []
    for rows, padded in padded_batches(n, ctx.tc.batch):
        live = jnp.arange(len(padded)) < len(rows)
        sums, lead, full = eval_step(params, ctx, data, jnp.asarray(padded), live)
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


def train(params, ctx: TrainContext, data, *, ckpt_dir: str | None = None, ckpt_every: int = 500, eval_data=None,
          eval_every: int = 0, patience: int = 0, deadline: float | None = None, log_every: int = 10,
          progress: bool = True):
    """Run up to ctx.tc.steps optimiser steps on `data`, saving the training state to ckpt_dir every ckpt_every
    steps and resuming from its latest checkpoint.

    With `eval_data`, the held-out set is evaluated every `eval_every` steps and at the end, and the params of the
    best evaluation (highest `expected_accept_length`) are returned: early stopping. Training stops after
    `patience` evaluations in a row without a new best (0: never) or at the first step past `deadline`
    (`time.monotonic()`). Returns (fp32 params, the step training resumed from, the record of the stop:
    evaluations, best step, reason)."""
    import orbax.checkpoint as ocp

    state = {"params": params, "opt_state": make_optimizer(ctx.tc).init(params), "step": jnp.zeros((), jnp.int32)}
    best = {"params": jax.tree.map(jnp.copy, params), "metric": jnp.full((), -jnp.inf, jnp.float32),
            "step": jnp.zeros((), jnp.int32), "bad": jnp.zeros((), jnp.int32)}
    loop = functools.partial(_train_steps, ctx=ctx, data=data, ckpt_every=ckpt_every, eval_data=eval_data,
                             eval_every=eval_every, patience=patience, deadline=deadline, log_every=log_every,
                             progress=progress)
    if not ckpt_dir:
        return loop(state, best, None)
    with ocp.CheckpointManager(os.path.abspath(ckpt_dir), options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=False)) as mgr:
        if mgr.latest_step() is not None:
            saved = _restore(mgr, {**state, "best": best}, ckpt_dir)
            best = saved.pop("best")
            state = saved
        return loop(state, best, mgr)


def _train_steps(state, best, mgr, *, ctx: TrainContext, data, ckpt_every, eval_data, eval_every, patience,
                 deadline, log_every, progress):
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    tc = ctx.tc
    start = int(state["step"])
    n = data["tokens"].shape[0]
    B = min(tc.batch, n)
    evals, reason = [], "steps"
    first = start
    if patience and eval_data is not None and int(best["bad"]) >= patience:  # a resumed run that had stopped
        first, reason = tc.steps, f"{patience} evaluations without a better held-out accept length"
    with tqdm(total=tc.steps, initial=start, desc="distill", file=sys.stderr, disable=not progress) as bar:
        for s in range(first, tc.steps):
            rows = np.random.default_rng([tc.seed, s]).choice(n, B, replace=False)
            state, sums = train_step(state, ctx, data, jnp.asarray(rows))
            bar.update(1)
            done = s + 1
            if done % log_every == 0 or done == tc.steps:
                m = summarize(sums)
                bar.set_postfix_str(f"loss {m['loss']:.3f} acc "
                                    + "/".join(f"{a:.2f}" for a in m["accuracy_per_step"]))
            late = deadline is not None and time.monotonic() > deadline
            stop = done == tc.steps or late
            if eval_data is not None and (stop or (eval_every and done % eval_every == 0)):
                m = evaluate(state["params"], ctx, eval_data)
                evals.append({"step": done, "expected_accept_length": m["expected_accept_length"], "loss": m["loss"]})
                if m["expected_accept_length"] > float(best["metric"]):
                    best = {"params": jax.tree.map(jnp.copy, state["params"]),
                            "metric": jnp.asarray(m["expected_accept_length"], jnp.float32),
                            "step": jnp.asarray(done, jnp.int32), "bad": jnp.zeros((), jnp.int32)}
                else:
                    best = best | {"bad": best["bad"] + 1}
                bar.write(f"step {done}: held-out loss {m['loss']:.3f}, accuracy "
                          + " ".join(f"{a:.3f}" for a in m["accuracy_per_step"])
                          + f", accept length {m['expected_accept_length']:.2f}"
                          + f" (best {float(best['metric']):.2f} at step {int(best['step'])})")
                if patience and int(best["bad"]) >= patience:
                    stop, reason = True, f"{patience} evaluations without a better held-out accept length"
            if late and stop and reason == "steps":
                reason = "time limit"
            if mgr is not None and (done % ckpt_every == 0 or stop):
                mgr.save(done, args=ocp.args.StandardSave({**state, "best": best}))
            if stop:
                break
    record = {"stopped_at_step": int(state["step"]), "reason": reason, "evaluations": evals}
    if eval_data is None:
        return state["params"], start, record
    return best["params"], start, record | {"best_step": int(best["step"]),
                                           "best_heldout_expected_accept_length": float(best["metric"])}
