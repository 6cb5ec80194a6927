"""`jaxspec.staging`: a program's per-call inputs copied into one buffer of its own before anything reads them.

What it must do, checked on XLA's own output for the CPU (the same compiler passes decide it for the GPU; `bench graph`
counts the GPU programs): values pass through bit for bit; each staged parameter is read by one kernel only (the copy),
so that on a GPU a fresh input array moves one graph node; the copy never lives in an output's allocation.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxspec import staging
from jaxspec.draft.bucketed import BucketedDrafter
from jaxspec.engine.programs import PrefillBatch
from jaxspec.sampling import SamplingMetadata

from test_bench import _bench_script
from test_drafter import make_cache, pair, random_state, seed_table  # noqa: F401  (pair: the module fixture)

DIAG = _bench_script("diag_moved")


def entry_readers(text: str) -> dict[str, tuple[str, list[str]]]:
    """Each parameter of the optimized HLO's entry computation: name -> (shape, the instructions that read it)."""
    entry = text[text.index("\nENTRY"):]
    lines = entry.splitlines()
    out = {}
    for name, shape in re.findall(r"%(\S+) = (\S+) parameter\(\d+\)", entry):
        use = re.compile(rf"[(,] ?%{re.escape(name)}[,)]")
        out[name] = (shape, [ln.split("=")[0].strip() for ln in lines if use.search(ln) and "parameter(" not in ln])
    return out


def _compile_with_dump(lowered, out):
    """`lowered` compiled with XLA's dump into `out`, the persistent compilation cache off for it: an executable loaded
    from the cache writes no dump (jax leaves the dump options out of its cache key). jax decides once a process
    whether it uses the cache, so the switch is followed by `reset_cache` both ways."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        return lowered.compile(compiler_options={"xla_dump_to": str(out)})
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def odd_inputs():
    """A pytree of what programs get each call: negative and large ints, float bit patterns XLA must not touch
    (NaN, -0.0, inf, denormals), bools, a zero-size leaf; and leaves never staged (bf16, one over the size limit)."""
    rng = np.random.default_rng(0)
    f32 = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.5], np.float32)
    big = np.arange(staging.MAX_LEAF_BYTES // 4 + 1, dtype=np.int32)
    return {"table": rng.integers(-2**31, 2**31 - 1, (3, 5), dtype=np.int64).astype(np.int32), "f32": f32,
            "u32": np.array([0, 2**32 - 1, 7], np.uint32), "flags": np.array([True, False, True]),
            "empty": np.zeros((2, 0), np.int32), "bf16": jnp.asarray([1.5, -2.0], jnp.bfloat16), "big": big}


def test_staged_values_pass_bit_for_bit():
    """stage then hold returns every leaf with its dtype, shape and bits (NaN payloads and -0.0 included); bf16 and
    over-limit leaves are left as they are (not staged)."""
    tree = odd_inputs()
    got = jax.jit(lambda t: staging.hold(staging.stage(t)[0], staging.stage(t)[1]))(tree)
    for name, want in tree.items():
        g = np.asarray(got[name])
        assert g.dtype == np.asarray(want).dtype and g.shape == np.asarray(want).shape, name
        assert np.asarray(want).tobytes() == g.tobytes(), name
    assert not staging.stageable(tree["bf16"]) and not staging.stageable(tree["big"])
    assert all(staging.stageable(tree[n]) for n in ("table", "f32", "u32", "flags", "empty"))


def test_a_misplaced_slice_fails_the_comparison(monkeypatch):
    """Sensitivity of the test above: the leaves read one word off their place in the copy are caught."""
    real = staging._from_words
    monkeypatch.setattr(staging, "_from_words", lambda w, dtype: real(jnp.roll(w, 1), dtype))
    tree = odd_inputs()
    got = jax.jit(lambda t: staging.stage(t)[0])(tree)
    assert np.asarray(tree["table"]).tobytes() != np.asarray(got["table"]).tobytes()


def test_each_staged_parameter_is_read_by_the_copy_alone(pair):  # noqa: F811
    """BucketedDrafter's program (the tiny e2b pair's drafter, bucket 3): with stage_inputs, the page table, cached
    lengths, pending tokens and seed rows arrive as one packed parameter, read by one instruction (the copy); without,
    as four, the cached lengths read by several (positions, masks, RoPE fused into each consumer) — what moves graph
    nodes on a GPU. Both give the same drafts and h, bit for bit, on changing states (host inputs, and device inputs
    packed on the device)."""
    cfg, params, acfg, aparams = pair
    readers, outs = {}, {}
    for staged in (False, True):
        cache = make_cache(cfg)
        d = BucketedDrafter(aparams, acfg, params["embed"], cfg, 3, buckets=(3,), seed_slots=9, stage_inputs=staged,
                            pinned_inputs=False)
        d.attach(cache)
        readers[staged] = {name.split(".")[0]: users for name, (_, users) in
                           entry_readers(d.executables[3].as_text()).items()}
        outs[staged] = []
        for call in range(3):
            for rid in list(cache.pool.requests):
                cache.pool.free(rid)
            _, _, pt, cl, pending = random_state(cfg, 3, seed=300 + call, cache=cache)
            inputs = (pt, cl, pending, seed_table(acfg, 9, call), np.array([4, 1, 7], np.int32))
            outs[staged].append(d.propose(*inputs))
            if call == 2:  # device inputs too (packed on the device)
                got = d.propose_bucket(3, *(jax.device_put(a) for a in inputs))
                outs[staged].append(tuple(np.asarray(g) for g in got))
    assert len(readers[True]["packed"]) == 1, readers[True]["packed"]
    assert not {"cached_len", "pending_token", "slot", "pages_page_table"} & set(readers[True])
    assert len(readers[False]["cached_len"]) > 2, readers[False]["cached_len"]  # what staging removes
    for (d0, h0), (d1, h1) in zip(outs[False], outs[True], strict=True):
        np.testing.assert_array_equal(d0, d1)
        assert np.asarray(h0).tobytes() == np.asarray(h1).tobytes()


def _assignment(fn, args, tmp_path, tag):
    """XLA's buffer assignment of `fn` compiled on the CPU, read by bench/diag_moved.py: ({allocation: (size,
    description)}, {(value, shape index): allocation})."""
    out = tmp_path / tag
    _compile_with_dump(jax.jit(fn).lower(*args), out)
    return DIAG.allocations(DIAG.read_dump(str(out), "jit_")[1])


def _copy_allocation(fn, args, tmp_path, tag) -> str:
    """The description of the allocation XLA's buffer assignment gave the staging copy (a concatenate fusion)."""
    kinds, where = _assignment(fn, args, tmp_path, tag)
    (alloc,) = {a for (name, _), a in where.items() if "concatenate" in name}
    return kinds[alloc][1]


def test_the_copy_never_lives_in_an_output(tmp_path):
    """A program whose staged inputs are last read before a larger output is made: without `hold`, XLA's buffer
    assignment puts the copy in that output's allocation (a fresh output of a caller that still holds the last one
    moves, and with it every node reading the copy); with `hold` the copy stays a temporary of the program."""
    def program(hold):
        def fn(table, lengths, w):
            (table, lengths), words = staging.stage((table, lengths))
            pos = jnp.sum(table * lengths[:, None], axis=1).astype(jnp.float32)  # the copy's last reader
            h = jnp.sin(jnp.tanh(w * pos[:, None]) @ (w.T @ w)) * 3
            return staging.hold((h, pos), words) if hold else (h, pos)
        return fn

    args = (np.arange(600, dtype=np.int32).reshape(2, 300), np.array([5, 7], np.int32), np.ones((2, 4096), np.float32))
    assert "maybe-live-out" in _copy_allocation(program(False), args, tmp_path, "without")
    held = _copy_allocation(program(True), args, tmp_path, "with")
    assert "live-out" not in held and "temp" in held, held
    np.testing.assert_array_equal(jax.jit(program(True))(*args)[0], jax.jit(program(False))(*args)[0])


def test_a_prefill_batch_stages_whole():
    """Every field of the engine's prefill batch is staged (ints, bools, the sampling floats): one copy."""
    B, T = 4, 8
    i32 = lambda: np.arange(B, dtype=np.int32)  # noqa: E731
    batch = PrefillBatch(tokens=np.ones((B, T), np.int32), cached_len=i32(), num_new=i32(), slot=i32(),
                         last=np.ones(B, bool), pending_token=i32(), num_generated=i32(), max_new_tokens=i32(),
                         ignore_eos=np.zeros(B, bool),
                         sampling=SamplingMetadata(temperature=np.full(B, 0.7, np.float32), top_k=i32(),
                                                   top_p=np.full(B, 0.9, np.float32), seed=i32()))
    assert all(staging.stageable(a) for a in jax.tree.leaves(batch))
    got = jax.jit(lambda b: staging.stage(b)[0])(batch)
    for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(got)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("leaves", [1, 2])
def test_even_one_leaf_is_copied(leaves):
    """A single staged leaf is still copied (a concatenate of one array would be the array itself)."""
    def fn(*xs):
        xs, words = staging.stage(xs)
        return staging.hold(tuple(x * 2 + 1 for x in xs), words)

    xs = [np.arange(6, dtype=np.int32) + i for i in range(leaves)]
    readers = entry_readers(jax.jit(fn).lower(*xs).compile().as_text())
    users = [u for _, u in readers.values()]
    assert len(users) == leaves and all(len(u) == 1 for u in users) and len({u[0] for u in users}) == 1
    assert all("concatenate" in u[0] for u in users), users


def test_diag_moved_counts_the_kernels_a_moved_buffer_re_records(tmp_path):
    """bench/diag_moved.py, on a CPU compile's dump of a program whose lengths feed several kernels: unstaged, a moved
    lengths parameter touches more than one kernel; staged, exactly one (the copy) — the same count the H200 programs'
    dumps give in BENCHMARKS.md session 27 (propose, verify, round). A moved output touches at least its producer."""
    diag = DIAG

    def program(staged):
        def fn(lengths, w):
            if staged:
                (lengths,), words = staging.stage((lengths,))
            pos = lengths[:, None] + jnp.arange(8)
            a = jnp.sin(w * pos) @ w.T
            b = jnp.tanh(a + jnp.max(lengths)) @ w
            c = jnp.cumsum(b * lengths[:, None], axis=1)
            return staging.hold(c, words) if staged else c
        return fn

    args = (np.array([3, 9], np.int32), np.linspace(0, 1, 16, dtype=np.float32).reshape(2, 8))
    counts = {}
    for staged in (False, True):
        out = tmp_path / str(staged)
        _compile_with_dump(jax.jit(program(staged)).lower(*args), out)
        hlo, assignment = diag.read_dump(str(out), "jit_fn")
        kinds, where = diag.allocations(assignment)
        kernels = diag.kernel_allocations(hlo, where)
        _, lengths = diag.parse_set("lengths=p0", kinds)
        outputs = diag.standard_sets(kinds)["outputs"]
        counts[staged] = (diag.count(kernels, lengths), diag.count(kernels, outputs))
    assert counts[False][0] > 1 and counts[True][0] == 1, counts
    assert counts[False][1] >= 1 and counts[True][1] >= 1, counts


def _output_values(fn, args, tmp_path, tag) -> list[str]:
    """The values XLA's buffer assignment put in the allocation of the program's first output (f32[2, 4096], the
    only output allocation of its size)."""
    kinds, where = _assignment(fn, args, tmp_path, tag)
    (alloc,) = [a for a, (size, k) in kinds.items() if size == 32768 and "maybe-live-out" in k and "parameter" not in k]
    return [name for (name, _), a in where.items() if a == alloc]


def test_pinned_outputs_hold_no_temporaries(tmp_path):
    """stage(..., outputs=...) makes the outputs' buffers at the program's start and `hold` writes the outputs into
    them in place (two dynamic-update-slices: one of the whole buffer XLA would fold back into the output itself):
    the output's allocation then holds nothing but its own values, while without the pin XLA puts the program's
    temporaries in it (the nodes a moved output makes XLA re-record). Values bit for bit either way."""
    shapes = (jax.ShapeDtypeStruct((2, 4096), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32))

    def program(pinned):
        def fn(table, lengths, w):
            (table, lengths), staged = staging.stage((table, lengths), outputs=shapes if pinned else None)
            pos = jnp.sum(table * lengths[:, None], axis=1).astype(jnp.float32)
            a = jnp.tanh(w * pos[:, None])
            b = jnp.sin(a * 2.0) + jnp.cos(a)
            # the products' operands are small integers, so their sums are exact in any order: the GPU's two
            # programs may tile them differently (different fusions) and still agree bit for bit
            wq = jnp.round(w * 8)
            h = jnp.sin(jnp.round(jnp.tanh(b * pos[:, None]) * 8) @ (wq.T @ wq)) * 3
            return staging.hold((h, pos), staged)
        return fn

    args = (np.arange(600, dtype=np.int32).reshape(2, 300), np.array([5, 7], np.int32),
            np.linspace(-1, 1, 2 * 4096, dtype=np.float32).reshape(2, 4096))
    pinned = _output_values(program(True), args, tmp_path, "pinned")
    loose = _output_values(program(False), args, tmp_path, "loose")
    # instruction names as the backend's fusion pass leaves them: the CPU's `dynamic-update-slice.1`, the GPU's
    # `loop_dynamic_update_slice_fusion.1`
    assert all(("broadcast" in v or "dynamic-update-slice" in v.replace("_", "-")) for v in pinned), pinned
    assert len(pinned) == 3, pinned  # the buffer made at the start, then its two in-place writes
    assert len(loose) > 1, loose  # temporaries beside the output
    got, want = jax.jit(program(True))(*args), jax.jit(program(False))(*args)
    for g, w in zip(got, want):
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


def test_diag_moved_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    """No dump, a malformed set, an unknown parameter or allocation: one line on stderr, exit status 2."""
    out = tmp_path / "dump"
    _compile_with_dump(jax.jit(lambda x: x * 2).lower(np.arange(4, dtype=np.int32)), out)
    for argv in ([str(tmp_path / "none")], [str(out), "x"], [str(out), "x=p7"], [str(out), "x=999"],
                 [str(out), "x=p0,"]):
        assert DIAG.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    assert DIAG.main([str(out), "x=p0"]) == 0
    assert "x (allocations" in capsys.readouterr().out


def _drafts_of_changing_states(cfg, acfg, aparams, params, calls=5, **kw):
    """BucketedDrafter (bucket 3) on `calls` changing host states, then once on device inputs: [(drafts, h)]."""
    cache = make_cache(cfg)
    d = BucketedDrafter(aparams, acfg, params["embed"], cfg, 3, buckets=(3,), seed_slots=9, **kw)
    d.attach(cache)
    out = []
    for call in range(calls):
        for rid in list(cache.pool.requests):
            cache.pool.free(rid)
        _, _, pt, cl, pending = random_state(cfg, 3, seed=500 + call, cache=cache)
        inputs = (pt, cl, pending, seed_table(acfg, 9, call), np.array([4, 1, 7], np.int32))
        out.append(tuple(np.asarray(g) for g in d.propose_bucket(3, *inputs)))
        if call == calls - 1:
            out.append(tuple(np.asarray(g) for g in d.propose_bucket(3, *(jax.device_put(a) for a in inputs))))
    return d, out


def test_pinned_inputs_give_the_staged_drafts(pair):  # noqa: F811
    """pinned_inputs (the packed input written by the host into a persistent pinned host array, copied to the device
    by the program): the same drafts and h, bit for bit, as the staged program given a transfer a call, on five
    changing states (the ring of two arrays wraps twice) and on device inputs; the inputs really arrive through the
    pinned arrays (their memory kind, the program's parameter) and the states really differ."""
    cfg, params, acfg, aparams = pair
    d, pinned = _drafts_of_changing_states(cfg, acfg, aparams, params, pinned_inputs=True)
    _, staged = _drafts_of_changing_states(cfg, acfg, aparams, params, pinned_inputs=False)
    assert d.pinned_inputs and all(a.sharding.memory_kind == staging.PINNED for a in d.rings[3].arrays)
    assert "S(5)" in d.executables[3].as_text() or staging.PINNED in str(d.executables[3].input_shardings)
    for (d0, h0), (d1, h1) in zip(staged, pinned, strict=True):
        np.testing.assert_array_equal(d0, d1)
        assert h0.tobytes() == h1.tobytes()
    assert len({h.tobytes() for _, h in staged}) >= 4  # the calls' inputs (and so their results) differ


def test_a_ring_that_does_not_write_fails_the_comparison(pair, monkeypatch):  # noqa: F811
    """Sensitivity of the test above: a ring that hands back its arrays without writing the new input (each call then
    drafts from whatever its array held) gives other drafts than the staged program's."""
    cfg, params, acfg, aparams = pair
    monkeypatch.setattr(staging.ctypes, "memmove", lambda *a: None)
    _, stale = _drafts_of_changing_states(cfg, acfg, aparams, params, calls=3, pinned_inputs=True)
    monkeypatch.undo()
    _, staged = _drafts_of_changing_states(cfg, acfg, aparams, params, calls=3, pinned_inputs=False)
    assert any(h0.tobytes() != h1.tobytes() for (_, h0), (_, h1) in zip(staged, stale, strict=True))


class _Call:
    """A stand-in for the outputs of a call that read a ring's array: running (not ready) until finished."""

    def __init__(self, events):
        self.events, self.ready = events, False

    def is_ready(self):
        return self.ready

    def is_deleted(self):
        return False

    def block_until_ready(self):
        self.events.append(("wait", self))
        self.ready = True
        return self


def test_the_ring_writes_an_array_only_after_its_last_reader(monkeypatch):
    """PinnedRing.write: the array written last again while its call is done (its address stays), the other one while
    that call runs, and with both calls running it waits for the older one's before writing; a slot whose outputs
    were deleted gets a fresh array when no other is free; a wrong shape is an error."""
    dev = jax.devices()[0]
    ring = staging.PinnedRing((4,), np.int32, dev)
    events = []
    real_memmove = staging.ctypes.memmove
    monkeypatch.setattr(staging.ctypes, "memmove", lambda *a: (events.append("write"), real_memmove(*a))[1])
    monkeypatch.setattr(staging.jax, "block_until_ready", lambda x: jax.tree.map(lambda c: c.block_until_ready(), x))
    a0 = ring.write(np.arange(4))
    ring.used_by(jnp.arange(3) + 1)  # a finished call (its outputs computed)
    assert ring.write(np.arange(4) + 10) is a0 and events == ["write", "write"]
    assert np.asarray(a0).tolist() == [10, 11, 12, 13]
    first = _Call(events)
    ring.used_by(first)  # a0's call still running: the other array
    events.clear()
    a1 = ring.write(np.arange(4) + 20)
    assert a1 is not a0 and events == ["write"] and np.asarray(a1).tolist() == [20, 21, 22, 23]
    second = _Call(events)
    ring.used_by(second)  # both running: wait for the older call (a0's), then write a0
    events.clear()
    assert ring.write(np.arange(4) + 30) is a0 and events == [("wait", first), "write"] and not second.ready
    assert np.asarray(a0).tolist() == [30, 31, 32, 33]
    gone = jnp.arange(2) + 5
    ring.used_by(gone)
    gone.delete()  # a0's reader unknown, a1's still running: a fresh array in a0's slot, no wait
    events.clear()
    fresh = ring.write(np.ones(4))
    assert fresh is not a0 and fresh is not a1 and events == ["write"] and np.asarray(fresh).tolist() == [1] * 4
    assert np.asarray(a0).tolist() == [30, 31, 32, 33]  # the old array, untouched
    with pytest.raises(ValueError, match="shape"):
        ring.write(np.zeros(5))


def test_pinned_inputs_are_on_by_default_on_a_gpu_only(monkeypatch):
    """JAXSPEC_PINNED_INPUTS: unset, the pinned input is the GPU's default and not the CPU's; 0 and 1 decide on both;
    anything else is a configuration error."""
    from jaxspec.config import ConfigError

    for backend, want in (("gpu", True), ("cpu", False)):
        monkeypatch.setattr(staging.jax, "default_backend", lambda b=backend: b)
        monkeypatch.delenv("JAXSPEC_PINNED_INPUTS", raising=False)
        assert staging.pinned_enabled() is want
        for value in ("0", "1"):
            monkeypatch.setenv("JAXSPEC_PINNED_INPUTS", value)
            assert staging.pinned_enabled() is (value == "1")
    monkeypatch.setenv("JAXSPEC_PINNED_INPUTS", "yes")
    with pytest.raises(ConfigError, match="JAXSPEC_PINNED_INPUTS"):
        staging.pinned_enabled()
