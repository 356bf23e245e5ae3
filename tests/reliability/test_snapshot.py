"""Index snapshots: a round trip rebuilds the same index through the public API."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from kit.index_content import same_content

from smetric_lmc.hashing import fast_chain
from smetric_lmc.index import TierIndex
from smetric_lmc.index import snapshot as S

BS = 4


def _engine_events(index: TierIndex, iid: str, rng: random.Random, sessions: int) -> None:
    """vLLM-like BlockStored runs (engine hashes of their own) under shared and private prefixes."""
    shared = [rng.randrange(50_000) for _ in range(BS * 3)]
    for s in range(sessions):
        toks = shared + [rng.randrange(50_000) for _ in range(BS * rng.randrange(1, 6))]
        eng = [rng.getrandbits(64) | 1 for _ in range(len(toks) // BS)]
        # Stored in two events: the second under the first's last engine hash (its parent).
        cut = 3
        index.gpu_stored(iid, eng[:cut], None, toks[: cut * BS], BS)
        index.gpu_stored(iid, eng[cut:], eng[cut - 1], toks[cut * BS :], BS)
        if s % 5 == 4:
            index.gpu_removed(iid, eng[-1:])


def _build() -> TierIndex:
    rng = random.Random(7)
    idx = TierIndex(BS, 8)
    for iid in ("a", "b", "c"):
        idx.register_instance(iid)
        _engine_events(idx, iid, rng, 40)
        idx.lmcache_admit(iid, [rng.getrandbits(64) for _ in range(20)])
    idx.gpu_stored_hashes("c", fast_chain(list(range(BS * 5)), BS, root=idx.fast_root))  # no engine hashes
    idx.mark_stale("b")
    _engine_events(idx, "b", rng, 3)  # some of b fresh again
    idx.global_stored([rng.getrandbits(64) for _ in range(30)])
    return idx


def test_round_trip_restores_the_same_index(tmp_path: Path) -> None:
    idx = _build()
    snap = S.take(idx, {"a": (41, 1.5)})
    path = tmp_path / "index.snap"
    assert S.write(path, snap) == path.stat().st_size
    back = S.read(path)
    assert back is not None and back.instances["a"].seq == 41 and back.instances["b"].seq is None
    fresh = TierIndex(BS, 8)
    restored = S.restore(fresh, back)
    assert restored["a"] == idx.gpu_blocks_of("a") > 0
    assert same_content(idx, fresh) == []
    assert fresh.stale_instances() == ["b"] and 0 < sum(back.instances["b"].stale) < idx.gpu_blocks_of("b")
    assert same_content(idx, TierIndex(BS, 8)) != []  # (the comparison can tell)
    # Engine hashes came back too, an instance's own included (c hashed the shared prefix
    # differently from a): a removal reported by engine hash lands the same in both.
    c = idx.export_instance("c")
    root_engs = [int(e) for e, par in zip(c["eng"], c["parent"]) if par == 0 and e]
    assert root_engs
    assert idx.gpu_removed("c", root_engs[:1]) == fresh.gpu_removed("c", root_engs[:1]) == 1
    assert same_content(idx, fresh) == []
    assert idx.gpu_blocks_of("c") == fresh.gpu_blocks_of("c") == 5  # only the hash-space chain is left


def test_a_snapshot_from_other_hashing_or_a_torn_file_is_refused(tmp_path: Path) -> None:
    snap = S.take(_build())
    with pytest.raises(S.SnapshotError, match="block_size"):
        S.restore(TierIndex(BS * 2, 8), snap)
    data = S.encode(snap)
    with pytest.raises(S.SnapshotError):
        S.decode(data[: len(data) // 2])
    assert S.read(tmp_path / "none") is None


def test_a_forked_write_saves_the_index_as_it_was_at_the_fork(tmp_path: Path) -> None:
    idx = _build()
    before = S.take(idx, {"a": (7, 2.0)})
    path = tmp_path / "index.snap"
    job = S.fork_write(path, idx, {"a": (7, 2.0)})
    # The parent goes on changing the index while the child exports: none of it reaches the file.
    idx.gpu_cleared("a")
    idx.gpu_stored_hashes("b", fast_chain(list(range(BS * 9)), BS, root=idx.fast_root))
    assert job.wait() == path.stat().st_size
    back = S.read(path)
    assert back is not None and back.instances["a"].seq == 7
    restored, expected = TierIndex(BS, 8), TierIndex(BS, 8)
    S.restore(restored, back)
    S.restore(expected, before)
    assert restored.gpu_blocks_of("a") > 0 and same_content(restored, expected) == []


def test_a_write_removes_what_a_writer_killed_mid_write_left(tmp_path: Path) -> None:
    stray = tmp_path / ".index.snap.k1ll3d"
    stray.write_bytes(b"half a snapshot")
    other = tmp_path / ".other.snap.tmp"
    other.write_bytes(b"")
    S.write(tmp_path / "index.snap", S.take(_build()))
    assert not stray.exists() and other.exists()
    assert S.read(tmp_path / "index.snap") is not None


def test_a_forked_write_that_fails_reports_why(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    job = S.fork_write(blocker / "index.snap", _build())  # a folder that cannot be made
    with pytest.raises(OSError, match="snapshot child exited with 1: .*Error"):
        job.wait()
