"""Prefix-chained block ids built from a trace's raw per-block ids.

Raw trace ids are per-block content ids in some scope (one conversation for WEKA, global for
Bailian and Mooncake). Chaining them, id_j = xxh3_64((id_{j-1}, raw_j), seed=scope), gives ids that
are equal exactly when the whole prefix is equal, and never collide across scopes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from smetric_lmc.lab.workload.model import BLOCK_DTYPE, share_prefix_views

_PAIR = struct.Struct("<QQ")
_U64 = (1 << 64) - 1


def scope_seed(name: str) -> int:
    """A 64-bit hash seed for an id scope (a conversation id, a trace name, ...)."""
    return xxhash.xxh3_64_intdigest(name.encode())


def chain_ids(raw: Sequence[int], seed: int, prev: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """Chain `raw` onto `prev` (the id of the block before them; 0 at the start of a prompt)."""
    n = len(raw)
    res = np.empty(n, dtype=BLOCK_DTYPE) if out is None else out
    pack = _PAIR.pack
    h = xxhash.xxh3_64_intdigest
    vals = [0] * n
    for j, r in enumerate(raw):
        prev = h(pack(prev, r & _U64), seed)
        vals[j] = prev
    res[:] = vals
    return res


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id sequences (lists or arrays)."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    # The agent pattern makes full extension the common case: one C-level comparison settles it.
    if isinstance(a, list) and isinstance(b, list):
        if a[:m] == b[:m]:
            return m
        aa = np.asarray(a[:m], dtype=np.uint64)
        bb = np.asarray(b[:m], dtype=np.uint64)
    else:
        aa = np.asarray(a[:m])
        bb = np.asarray(b[:m])
    diff = np.flatnonzero(aa != bb)
    return int(diff[0]) if len(diff) else m


class SharedPrefix:
    """Ids of a prompt prefix shared across sessions (e.g. one agent framework's system prompt).

    Block j of the shared prefix is chained from position numbers, so every session that maps its
    leading blocks here gets the same ids for the same positions.
    """

    def __init__(self, key: str) -> None:
        self._seed = scope_seed("shared-prefix:" + key)
        self._ids = np.empty(0, dtype=BLOCK_DTYPE)

    def ids(self, n: int) -> np.ndarray:
        if n > len(self._ids):
            prev = int(self._ids[-1]) if len(self._ids) else 0
            more = chain_ids(range(len(self._ids), n), self._seed, prev)
            self._ids = np.concatenate([self._ids, more])
        return self._ids[:n]


def chain_session(
    raw_requests: Sequence[Sequence[int]],
    seed: int,
    shared: SharedPrefix | None = None,
    shared_blocks: int = 0,
    carry_fraction: float = 0.5,
) -> tuple[list[np.ndarray], list[int]]:
    """Chain every request of one session; return (block id arrays, turn numbers).

    Only the part of a request beyond its common prefix with the previous request is hashed, so a
    session costs about one hash per distinct block. With `shared`, the leading `shared_blocks`
    blocks of the first request (and the same raw blocks in later requests) take shared ids.

    A request carries the previous one's history, and so gets turn = previous turn + 1, when it
    repeats at least `carry_fraction` of the previous request's blocks; otherwise it starts over at
    turn 0 (history dropped, e.g. context compaction). The fraction tolerates the last few blocks
    changing between calls, which agents do (moving cache markers, trimmed tool output).
    """
    first = list(raw_requests[0][:shared_blocks]) if shared is not None and raw_requests else []
    arrays: list[np.ndarray] = []
    turns: list[int] = []
    extends: list[bool] = []
    prev_raw: Sequence[int] | None = None
    prev_ids: np.ndarray | None = None
    for raw in raw_requests:
        n = len(raw)
        ids = np.empty(n, dtype=BLOCK_DTYPE)
        lcp = 0
        if prev_raw is not None and prev_ids is not None:
            lcp = common_prefix(prev_raw, raw)
            ids[:lcp] = prev_ids[:lcp]
            carried = lcp >= carry_fraction * len(prev_raw)
            turns.append(turns[-1] + 1 if carried else 0)
            extends.append(lcp == len(prev_raw))
        else:
            turns.append(0)
            extends.append(False)
        start = lcp
        if first:
            sp = common_prefix(first, raw)
            if sp > start:
                ids[start:sp] = shared.ids(sp)[start:sp]  # type: ignore[union-attr]
                start = sp
        if start < n:
            chain_ids(raw[start:], seed, int(ids[start - 1]) if start else 0, out=ids[start:])
        arrays.append(ids)
        prev_raw, prev_ids = raw, ids
    return share_prefix_views(arrays, extends), turns
