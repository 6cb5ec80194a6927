"""The engine's device programs as pure functions over typed inputs (compiled per batch bucket by the runner).

- `prefill`: one chunk of prompt positions per row; the last chunk of a request writes its row of the decode state.
- `decode_rounds`: R speculative rounds in a device loop (draft -> verify -> accept, DESIGN.md §3), each round
  reading and writing only the decode state, so round n+1 needs nothing from the host; the loop stops early when
  every row is done. It returns every round's committed tokens and counts in one array (the call's one
  device -> host transfer).

A row stops on the device at EOS, max_new_tokens or a full context, exactly where the host's `Stopping` stops it
(stop strings are the host's alone: the host cuts the output and discards what the device computed past the end).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec import sampling
from jaxspec.config import AssistantConfig, TargetConfig
from jaxspec.draft.bucketed import draft
from jaxspec.model import gemma4
from jaxspec.paged_kv.metadata import CacheSpec, PageTables, step_metadata
from jaxspec.sampling import SamplingMetadata
from jaxspec.staging import hold, stage_step


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    target: dict  # the target's params (stacked leaves; its embedding is also the drafter's input embedding)
    assistant: dict | None  # the drafter's params (None without a device drafter)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What carries a request from one round to the next, one row per slot (S = max_running + 1); slot 0 belongs to
    padding rows and is always done."""

    cached_len: jax.Array  # i32[S]   positions whose K/V the target wrote and kept
    pending_token: jax.Array  # i32[S] the last committed token, not yet run by the target (at position cached_len)
    seed_hidden: jax.Array  # [S, H_target] target hidden at position cached_len - 1 (the drafter's first seed)
    num_generated: jax.Array  # i32[S] output tokens committed (the prefill's included)
    max_new_tokens: jax.Array  # i32[S]
    ignore_eos: jax.Array  # bool[S]
    done: jax.Array  # bool[S]        the row computes nothing more
    sampling: SamplingMetadata  # [S] each

    @staticmethod
    def empty(slots: int, hidden: int, dtype) -> "DecodeState":
        i32 = functools.partial(jnp.zeros, (slots,), jnp.int32)
        return DecodeState(cached_len=i32(), pending_token=i32(), seed_hidden=jnp.zeros((slots, hidden), dtype),
                           num_generated=i32(), max_new_tokens=i32(), ignore_eos=jnp.zeros(slots, bool),
                           done=jnp.ones(slots, bool),
                           sampling=SamplingMetadata(temperature=jnp.zeros(slots, jnp.float32), top_k=i32(),
                                                     top_p=jnp.ones(slots, jnp.float32), seed=i32()))

    def rows(self, slot) -> "DecodeState":
        return jax.tree.map(lambda a: a[slot], self)

    def put(self, slot, rows: "DecodeState", write) -> "DecodeState":
        """Rows written back at `slot` where `write` (bool[B]); other rows are dropped, never written."""
        idx = jnp.where(write, slot, self.cached_len.shape[0])  # out of bounds: dropped
        return jax.tree.map(lambda table, r: table.at[idx].set(r, mode="drop"), self, rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """One chunk of prompt positions per row; padding rows have num_new 0, slot 0 and last False."""

    tokens: jax.Array  # i32[B, T]
    cached_len: jax.Array  # i32[B]   first position of the chunk
    num_new: jax.Array  # i32[B]      positions in the chunk
    slot: jax.Array  # i32[B]
    last: jax.Array  # bool[B]        the chunk ends the request's prefill: its decode-state row is written
    pending_token: jax.Array  # i32[B] -1: the token this prefill chooses (a new request); else a recomputed request's
    num_generated: jax.Array  # i32[B] output tokens once this prefill's token (if any) is committed
    max_new_tokens: jax.Array  # i32[B]
    ignore_eos: jax.Array  # bool[B]
    sampling: SamplingMetadata  # [B] each


@dataclasses.dataclass(frozen=True, kw_only=True)
class Programs:
    """The static side of the programs: configs, cache shape, options. Methods return the pure functions to compile."""

    cfg: TargetConfig
    acfg: AssistantConfig | None
    spec: CacheSpec
    k: int
    draft_mode: str
    use_kernels: bool
    eos: tuple[int, ...]
    fused_draft: bool | None = None  # the drafter step through its fused kernels (`bucketed.use_fused`)
    unroll_rounds: bool = True  # R > 1: the rounds one after another in the program, not a `while` loop (below)
    mesh: object = None  # the tensor-parallel mesh (`jaxspec.parallel`): the kernels run per device
    # > 0: batch-invariant decode (`EngineConfig.batch_invariant`): every decode / verify step computes this many
    # positions a row (>= k + 1, the rest padding) with the attention split at fixed positions
    invariant_positions: int = 0
    # the call's per-call inputs (slots, page tables, a prefill's batch) copied into one buffer of the program's
    # before anything reads them, so that a fresh upload moves one graph node, not every node that reads one
    # (`jaxspec.staging`; JAXSPEC_STAGE_INPUTS)
    stage_inputs: bool = False

    def _forward(self, weights: Weights, kv, pages: PageTables, tokens, cached_len, num_new, invariant=False):
        meta = step_metadata(self.cfg, self.spec, pages, cached_len, num_new, tokens.shape[1],
                             use_kernels=self.use_kernels, mesh=self.mesh, invariant=invariant)
        return gemma4.paged_forward(weights.target, self.cfg, kv, meta, tokens, use_kernels=self.use_kernels,
                                    mesh=self.mesh)

    def prefill(self, sample: bool):
        def prefill(weights: Weights, kv, state: DecodeState, batch: PrefillBatch, pages: PageTables):
            batch, pages, words = self._stage(batch, pages)
            hidden, kv = self._forward(weights, kv, pages, batch.tokens, batch.cached_len, batch.num_new)
            h_last = jnp.take_along_axis(hidden, jnp.maximum(batch.num_new - 1, 0)[:, None, None], axis=1)[:, 0]
            logits = gemma4.logits(weights.target, self.cfg, h_last)  # [B, V]
            if sample:
                s = batch.sampling
                token = sampling.choose(logits, s.temperature, s.top_k, s.top_p,
                                        sampling.row_keys(s.seed, batch.cached_len + batch.num_new, salt=0))
            else:
                token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            rows = DecodeState(
                cached_len=batch.cached_len + batch.num_new,
                pending_token=jnp.where(batch.pending_token >= 0, batch.pending_token, token),
                seed_hidden=h_last, num_generated=batch.num_generated, max_new_tokens=batch.max_new_tokens,
                ignore_eos=batch.ignore_eos, done=jnp.zeros_like(batch.last), sampling=batch.sampling)
            return kv, state.put(batch.slot, rows, batch.last), hold(token, words)

        return prefill

    def _stage(self, inputs, pages: PageTables):
        """(inputs, pages, the staging buffer): with stage_inputs, read from one copy made at the program's start."""
        if not self.stage_inputs:
            return inputs, pages, None
        return stage_step(inputs, pages)

    def decode_rounds(self, rounds: int, sample: bool):
        """R rounds; with draft_mode "eager" the drafts of its one round are an argument (the host's reference)."""
        k = self.k

        def one_round(weights: Weights, kv, pages: PageTables, rows: DecodeState, drafts):
            B = rows.cached_len.shape[0]
            active = ~rows.done
            if drafts is None and k:
                drafts, _ = draft(weights.assistant, weights.target["embed"], kv, pages, rows.cached_len,
                                  rows.pending_token, rows.seed_hidden, acfg=self.acfg, target=self.cfg,
                                  spec=self.spec, k=k, use_kernels=self.use_kernels, fused=self.fused_draft,
                                  mesh=self.mesh)
            elif drafts is None:
                drafts = jnp.zeros((B, 0), jnp.int32)
            tokens = jnp.concatenate([rows.pending_token[:, None], drafts], axis=1)  # [B, k+1]
            P = self.invariant_positions
            if P:  # padded to P positions: the same program shapes whatever k is (k = 0: plain decoding)
                tokens = jnp.pad(tokens, ((0, 0), (0, P - (k + 1))))
            hidden, kv = self._forward(weights, kv, pages, tokens, rows.cached_len, jnp.where(active, k + 1, 0),
                                       invariant=P > 0)
            logits = gemma4.logits(weights.target, self.cfg, hidden)  # [B, P or k+1, V]
            if P:  # every row of the head computed (no slice pushed up into its product), then the real ones kept
                logits = jax.lax.optimization_barrier(logits)[:, : k + 1]
                hidden = hidden[:, : k + 1]
            if sample:
                s = rows.sampling
                n, committed = sampling.accept(logits, drafts, s.temperature, s.top_k, s.top_p,
                                               sampling.row_keys(s.seed, rows.cached_len, salt=1))
            else:
                n, committed = sampling.accept_greedy(logits, drafts)
            return kv, self._advance(rows, active, n, committed, hidden)

        def decode_rounds(weights: Weights, kv, state: DecodeState, slot, pages: PageTables, drafts=None):
            (slot, drafts), pages, words = self._stage((slot, drafts), pages)
            B = slot.shape[0]
            out = jnp.zeros((B, rounds, k + 2), jnp.int32)  # per round: committed tokens, then their count

            def body(carry):
                i, kv, rows, out = carry
                kv, (rows, committed, count) = one_round(weights, kv, pages, rows, drafts)
                out = out.at[:, i, : k + 1].set(committed).at[:, i, k + 1].set(count)
                return i + 1, kv, rows, out

            carry = (jnp.int32(0), kv, state.rows(slot), out)
            if rounds == 1 or self.unroll_rounds:
                # Unrolled (R > 1, the default): XLA:GPU runs a `while` from the host, its body outside the call's
                # graph (one predicate read per iteration; E4B rounds took twice as long as at R 1, BENCHMARKS.md
                # session 11); straight-line, the call is one graph. No early exit: rounds after every row is done
                # change nothing (rows not active commit nothing) and cost their time. R times the program to compile.
                # JAXSPEC_UNROLL_ROUNDS=0 keeps the `while` loop (for comparisons).
                for _ in range(rounds):
                    carry = body(carry)
            else:
                carry = jax.lax.while_loop(lambda c: (c[0] < rounds) & jnp.any(~c[2].done), body, carry)
            _, kv, rows, out = carry
            return kv, state.put(slot, rows, slot > 0), hold(out, words)

        return decode_rounds

    def _advance(self, rows: DecodeState, active, n, committed, hidden):
        """The decode state after accepting n drafts and the bonus (rows not active stay as they are), with the
        round's committed tokens and their count (0 for rows not active)."""
        k = self.k
        count = jnp.where(active, n + 1, 0)
        cached_len = rows.cached_len + count
        generated = rows.num_generated + count
        in_round = jnp.arange(k + 1)[None, :] <= n[:, None]
        eos = jnp.asarray(self.eos or (-1,), jnp.int32)
        eos_hit = jnp.any(in_round & jnp.any(committed[..., None] == eos, axis=-1), axis=1) & ~rows.ignore_eos
        # the host's rule: a request ends when another round would not fit the context (pending + k + 1 positions)
        full = cached_len + k + 2 > self.spec.max_context
        done = rows.done | (active & (eos_hit | (generated >= rows.max_new_tokens) | full))
        bonus = jnp.take_along_axis(committed, n[:, None], axis=1)[:, 0]
        seed = jnp.take_along_axis(hidden, n[:, None, None], axis=1)[:, 0]  # target hidden of row n
        rows = dataclasses.replace(
            rows, cached_len=cached_len, num_generated=generated, done=done,
            pending_token=jnp.where(active, bonus, rows.pending_token),
            seed_hidden=jnp.where(active[:, None], seed, rows.seed_hidden))
        return rows, committed, count
