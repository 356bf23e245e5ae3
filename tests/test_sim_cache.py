"""The simulator's run-granular prefix cache."""

from __future__ import annotations

import numpy as np

from smetric_lmc.lab.sim.cache import PrefixCache


def chain(n: int, seed: int) -> np.ndarray:
    # Distinct ids per seed; prefix-chained in the sense the cache relies on (equal at j => equal before).
    return (np.arange(n, dtype=np.uint64) + np.uint64(seed * 1_000_000 + 1)).astype(np.uint64)


def test_match_insert_and_extend_in_place() -> None:
    c = PrefixCache(100)
    a = chain(30, 1)
    node, new = c.insert(a, 10, 0.0)
    assert new == 0 and c.used == 10
    assert c.match(a) == (node, 10)
    node2, new2 = c.insert(a, 25, 1.0)
    assert node2 is node and new2 == 10 and c.used == 25  # grown in place: one run per session
    assert c.match(a[:7])[1] == 7
    assert c.held_blocks() == 25


def test_divergence_splits_and_shares_prefix() -> None:
    c = PrefixCache(100)
    a = chain(20, 1)
    b = a.copy()
    b[12:] = chain(8, 2)  # same first 12 blocks, then different content
    c.insert(a, 20, 0.0)
    assert c.match(b)[1] == 12
    _, new = c.insert(b, 20, 1.0)
    assert new == 12
    assert c.used == 28
    assert len(c.nodes()) == 3  # shared [0,12) + two tails


def test_lru_evicts_tail_of_least_recent_unpinned() -> None:
    removed: list[tuple[int, int, int]] = []
    c = PrefixCache(30, on_removed=lambda ch, s, e: removed.append((int(ch[s]), s, e)))
    a, b = chain(20, 1), chain(20, 2)
    na, _ = c.insert(a, 15, 0.0)
    nb, _ = c.insert(b, 15, 1.0)
    c.pin(nb, 2.0)
    assert c.reserve(5)  # free was 0: evicts 5 blocks from a's tail (LRU, unpinned)
    assert removed == [(int(a[10]), 10, 15)]
    assert c.match(a)[1] == 10
    # b is pinned: a goes entirely before b could be touched
    assert c.reserve(10)
    assert c.match(a)[1] == 0 and c.match(b)[1] == 15
    assert not c.reserve(1)  # only pinned blocks left
    c.unpin(nb, 3.0)
    assert c.reserve(1) and c.match(b)[1] == 14


def test_split_keeps_pins_valid() -> None:
    c = PrefixCache(100)
    a = chain(20, 1)
    na, _ = c.insert(a, 20, 0.0)
    c.pin(na, 0.0)
    b = a.copy()
    b[5:] = chain(15, 3)
    c.insert(b, 20, 1.0)  # splits a's run at 5; the pinned reference keeps the lower half
    c.unpin(na, 2.0)
    assert all(n.ref == 0 for n in c.nodes())
    assert c.make_room(100 - 0)  # everything unpinned is evictable
    assert c.used == 0 and c.nodes() == []
