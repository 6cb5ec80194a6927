"""PagePool: accounting, the SWA bound, ownership and window residency at every step, atomicity, errors, rebuild."""

import numpy as np
import pytest

from conftest import full_pages_of, swa_pages_of
from jaxspec.paged_kv.pool import PagePool


def make_pool(*, page_size=4, window=6, k=3, chunk=8, num_full_pages=64, num_swa_pages=None, max_pages=32):
    keep, max_step = window + 1, max(chunk, k + 1)
    bound = -(-(keep + max_step) // page_size) + 1
    return PagePool(
        page_size=page_size,
        num_full_pages=num_full_pages,
        num_swa_pages=bound + 1 if num_swa_pages is None else num_swa_pages,
        max_pages_per_request=max_pages,
        swa_keep=keep,
        max_step_tokens=max_step,
    )


def snapshot(pool):
    rids = pool.requests
    return dict(
        rids=rids,
        table=pool.page_table(rids),
        swa_of_full=pool.swa_of_full.copy(),
        version=pool.version,
        free=(pool.num_free_full, pool.num_free_swa),
        counts=[(full_pages_of(pool, r), swa_pages_of(pool, r)) for r in rids],
    )


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def free_checking_version(pool, rid):
    swa_of_full, version = pool.swa_of_full.copy(), pool.version
    pool.free(rid)
    assert (pool.version > version) == (not np.array_equal(swa_of_full, pool.swa_of_full))


def check_invariants(pool, windows):
    """`windows[rid]` = (start, end) of the request's last successful prepare ((0, 0) before its first)."""
    rids = pool.requests
    assert set(rids) == set(windows)
    page_size, keep = pool.page_size, pool.swa_keep
    table = pool.page_table(rids)  # [R, max_pages]
    swa = pool.swa_of_full[table]  # [R, max_pages] SWA page of each logical page, 0 if not resident

    # No page owned twice, page 0 never handed out, owned + free = all pages but the dummy.
    full_owned, swa_owned = table[table != 0], swa[swa != 0]
    assert np.unique(full_owned).size == full_owned.size
    assert np.unique(swa_owned).size == swa_owned.size
    assert full_owned.size + pool.num_free_full == pool.num_full_pages - 1
    assert swa_owned.size + pool.num_free_swa == pool.num_swa_pages - 1
    assert pool.swa_of_full[0] == 0
    # swa_of_full is nonzero exactly at the owned full pages whose SWA page is resident: no stale entries.
    assert np.count_nonzero(pool.swa_of_full) == swa_owned.size

    for row, rid in enumerate(rids):
        start, end = windows[rid]
        num_full = full_pages_of(pool, rid)
        assert (table[row, :num_full] != 0).all() and (table[row, num_full:] == 0).all()
        assert np.count_nonzero(swa[row]) == swa_pages_of(pool, rid) <= pool.swa_pages_bound
        assert (table[row, np.arange(end) // page_size] != 0).all()
        window_start = max(0, start - keep)
        assert (swa[row, np.arange(window_start, end) // page_size] != 0).all()
        assert (swa[row, : window_start // page_size] == 0).all()  # pages that left every window were released


def run_engine(seed, *, num_requests):
    """Drives a pool like an engine: prefill chunks, then verify steps of k+1 positions advancing by 1..k+1, over
    random interleavings; a failed prepare preempts the newest request (freed, re-added later from position 0)."""
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([4, 8, 16]))
    window = int(rng.integers(3, 40))
    k = int(rng.integers(1, 7))
    chunk = int(rng.integers(2, 33))
    max_pages = int(rng.integers(6, 32))
    max_running = int(rng.integers(2, 9))
    keep, max_step = window + 1, max(chunk, k + 1)
    bound = -(-(keep + max_step) // page_size) + 1
    # Tight pools, so prepares fail; a lone request always fits.
    pool = PagePool(
        page_size=page_size,
        num_full_pages=max_pages + 1 + int(rng.integers(0, max_pages)),
        num_swa_pages=bound + 1 + int(rng.integers(0, 2 * bound)),
        max_pages_per_request=max_pages,
        swa_keep=keep,
        max_step_tokens=max_step,
    )
    longest = max_pages * page_size - (k + 1)  # the last verify step still ends within the request's pages
    lengths = {}
    for rid in range(num_requests):
        total = int(rng.integers(1, longest + 1)) if rng.random() < 0.3 else int(rng.integers(1, 2 * window + 2))
        total = min(total, longest)
        lengths[rid] = (int(rng.integers(1, total + 1)), total)  # (prompt, prompt + generated)

    waiting, running, windows, cached = list(lengths), [], {}, {}
    finished = failures = 0
    while waiting or running:
        if waiting and (not running or (len(running) < max_running and rng.random() < 0.3)):
            rid = waiting.pop(0)
            pool.add(rid)
            running.append(rid)
            windows[rid], cached[rid] = (0, 0), 0
        else:
            rid = running[int(rng.integers(len(running)))]
            prompt, total = lengths[rid]
            start = cached[rid]
            end = min(prompt, start + chunk) if start < prompt else start + k + 1
            before = snapshot(pool)
            can = pool.can_prepare(rid, start, end)
            assert_same(before, snapshot(pool))
            ok = pool.prepare(rid, start, end)
            assert ok == can
            if ok:
                changed = not np.array_equal(before["swa_of_full"], pool.swa_of_full)
                assert (pool.version > before["version"]) == changed
                windows[rid] = (start, end)
                cached[rid] = end if start < prompt else min(total, start + int(rng.integers(1, k + 2)))
                if cached[rid] >= total:
                    free_checking_version(pool, rid)
                    running.remove(rid)
                    del windows[rid], cached[rid]
                    finished += 1
            else:
                failures += 1
                assert_same(before, snapshot(pool))
                assert len(running) > 1, "a lone request must always fit"
                victim = running[-1]  # the newest, as an engine would: the oldest always progresses
                free_checking_version(pool, victim)
                running.remove(victim)
                del windows[victim], cached[victim]
                waiting.append(victim)
        check_invariants(pool, windows)

    assert finished == num_requests
    assert pool.requests == ()
    assert pool.num_free_full == pool.num_full_pages - 1
    assert pool.num_free_swa == pool.num_swa_pages - 1
    assert not pool.swa_of_full.any()
    return failures


@pytest.mark.parametrize("seed", range(5))
def test_random_engine_keeps_every_invariant(seed):
    assert run_engine(seed, num_requests=100) > 0  # the pools are tight enough that prepares fail


def test_swa_bound_holds_far_past_the_window():
    pool = make_pool(page_size=4, window=6, k=3, chunk=8, num_full_pages=201, max_pages=200)
    assert pool.swa_pages_bound == -(-(7 + 8) // 4) + 1
    pool.add("a")
    windows = {"a": (0, 0)}
    steps = [(0, 8), (8, 16), (16, 19)]  # a prefill of 19, then verify steps of k+1 = 4 positions
    rng = np.random.default_rng(0)
    start = 16
    while start + 4 <= 790:  # a 790-position request, ~100x the window
        start += int(rng.integers(1, 5))
        steps.append((start, start + 4))
    for start, end in steps:
        assert pool.prepare("a", start, end)
        windows["a"] = (start, end)
        check_invariants(pool, windows)
    assert full_pages_of(pool, "a") == -(-end // 4)


@pytest.mark.parametrize("short_of", ["full", "swa"])
def test_failed_prepare_changes_nothing(short_of):
    pool = make_pool(
        page_size=4,
        window=6,
        k=3,
        chunk=8,
        max_pages=8,
        num_full_pages=8 if short_of == "full" else 64,
        num_swa_pages=20 if short_of == "full" else None,  # None: one request's bound
    )
    pool.add("a")
    pool.add("b")
    assert pool.prepare("a", 0, 8) and pool.prepare("a", 8, 16)
    if short_of == "full":
        assert pool.prepare("b", 0, 8)
        failing, retry = (12, 16), (8, 16)  # b needs two more full pages; one is free
    else:
        failing, retry = (0, 8), (0, 8)  # b needs two SWA pages; a holds four of the five
    before = snapshot(pool)
    assert not pool.can_prepare("b", *failing)
    assert not pool.prepare("b", *failing)
    assert_same(before, snapshot(pool))
    pool.free("a")
    assert pool.prepare("b", *retry)  # the failed prepare did not move b's start either


def test_released_swa_pages_count_toward_a_prepare():
    # SWA pool with exactly one request's bound: a long step only fits by reusing the pages it releases.
    pool = make_pool(page_size=4, window=6, k=3, chunk=8, max_pages=64)
    pool.add("a")
    for start in range(0, 200, 8):
        assert pool.prepare("a", start, start + 8)
    assert pool.num_free_swa + swa_pages_of(pool, "a") == pool.num_swa_pages - 1


def test_allocation_is_deterministic_and_skips_page_zero():
    tables = []
    for _ in range(2):
        pool = make_pool(num_swa_pages=40)
        for rid in "abc":
            pool.add(rid)
            assert pool.prepare(rid, 0, 8)
        pool.free("b")
        pool.add("d")
        assert pool.prepare("d", 0, 8)
        tables.append((pool.page_table(["a", None, "c", "d"], width=4), pool.swa_of_full.copy()))
    np.testing.assert_array_equal(tables[0][0], tables[1][0])
    np.testing.assert_array_equal(tables[0][1], tables[1][1])
    np.testing.assert_array_equal(tables[0][0][0], [1, 2, 0, 0])  # a fresh pool hands out pages 1, 2, ...
    np.testing.assert_array_equal(tables[0][0][1], 0)  # a None row is padding


def test_errors():
    pool = make_pool(page_size=4, window=6, k=3, chunk=8, max_pages=8)
    pool.add("a")
    with pytest.raises(ValueError, match="max_step_tokens"):
        pool.prepare("a", 0, 9)
    with pytest.raises(ValueError, match="max_step_tokens"):
        pool.can_prepare("a", 0, 9)
    with pytest.raises(ValueError, match="positions a request may hold"):
        pool.prepare("a", 30, 33)
    assert pool.prepare("a", 8, 12)
    with pytest.raises(ValueError, match="moved back"):
        pool.prepare("a", 7, 12)
    with pytest.raises(ValueError, match="already"):
        pool.add("a")
    with pytest.raises(ValueError, match="live requests"):
        pool.rebuild(num_full_pages=10)
    pool.free("a")
    pool.add("a")
    assert pool.prepare("a", 0, 8)  # free + re-add starts over
    with pytest.raises(ValueError, match="SWA pool"):
        make_pool(page_size=4, window=6, k=3, chunk=8, num_swa_pages=5)  # bound is 5, plus the dummy
    with pytest.raises(ValueError, match="at least one position"):
        make_pool(max_pages=0)


def test_rebuild_applies_new_sizes():
    pool = make_pool(page_size=4, window=6, k=3, chunk=8, num_full_pages=20, num_swa_pages=10, max_pages=8)
    pool.add("a")
    assert pool.prepare("a", 0, 8)
    pool.free("a")
    version = pool.version
    pool.rebuild(num_full_pages=50, num_swa_pages=7, page_size=8, max_pages_per_request=6)
    assert pool.version > version
    assert (pool.page_size, pool.num_full_pages, pool.num_swa_pages, pool.max_pages_per_request) == (8, 50, 7, 6)
    assert (pool.num_free_full, pool.num_free_swa) == (49, 6)
    assert pool.swa_of_full.shape == (50,) and not pool.swa_of_full.any()
    assert pool.swa_pages_bound == -(-(7 + 8) // 8) + 1
    pool.add("b")
    windows = {"b": (0, 0)}
    for start in range(0, 40, 8):
        assert pool.prepare("b", start, start + 8)
        windows["b"] = (start, start + 8)
        check_invariants(pool, windows)
    assert pool.page_table(["b"]).shape == (1, 6)
    with pytest.raises(ValueError, match="positions a request may hold"):
        pool.prepare("b", 44, 49)
    pool.free("b")
    with pytest.raises(ValueError, match="SWA pool"):
        pool.rebuild(num_swa_pages=3)
    assert pool.num_swa_pages == 7  # a rejected rebuild keeps the old pools
