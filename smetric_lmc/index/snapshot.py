"""Index snapshots: what a restarted controller reloads before it replays the engines' events.

A snapshot is one msgpack document (``IndexSnapshot``): the index's hashing (block size, chunk
size, fast root: a snapshot made under other settings is refused), and per instance its GPU rows
(our chain hash, parent hash, the engine's own hash, stale flag), its LMCache chunks, and the last
KV-event batch applied (``seq``, ``ts``) so the subscriber resumes with a replay from ``seq + 1``;
plus the global tier's chunks. Arrays travel as little-endian bytes. ``write`` replaces the file
atomically (a temporary file in the same folder, fsync, rename): a crash mid-write leaves the
previous snapshot. ``fork_write`` takes and writes it in a forked child: the fork (page
tables only) is all the caller's thread pays, and the child sees the index and
the event positions frozen at that instant (copy on write), however long the export takes. ``restore`` rebuilds through the index's public store calls only (runs of
blocks, parents first), so it does not depend on how the index lays out its rows.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from smetric_lmc.index.tier import TierIndex

FORMAT_VERSION = 1


class SnapshotError(ValueError):
    """The file is not a snapshot this index can load (corrupt, another version or hashing)."""


class InstanceSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    hash: bytes
    parent: bytes
    eng: bytes
    stale: bytes
    chunks: bytes
    seq: int | None = None  # last KV-event batch applied before the snapshot
    ts: float | None = None  # its timestamp (tells an engine restart from a replay)


class IndexSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    created: float  # wall-clock seconds
    block_size: int
    chunk_size: int
    fast_root: int
    instances: dict[str, InstanceSnapshot]
    global_chunks: bytes

    def blocks(self) -> int:
        return sum(len(i.hash) // 8 for i in self.instances.values())


_U64 = np.dtype("<u8")
_dec = msgspec.msgpack.Decoder(IndexSnapshot)
_enc = msgspec.msgpack.Encoder()


def take(index: TierIndex, positions: Mapping[str, tuple[int | None, float | None]] | None = None) -> IndexSnapshot:
    """The index now, with each instance's last applied event batch from ``positions``. Runs on
    the caller's thread in one go: no event can land between the export and the positions."""
    positions = positions or {}
    out: dict[str, InstanceSnapshot] = {}
    for iid in index.instances:
        st = index.export_instance(iid)
        seq, ts = positions.get(iid, (None, None))
        out[iid] = InstanceSnapshot(
            hash=st["hash"].astype(_U64).tobytes(), parent=st["parent"].astype(_U64).tobytes(),
            eng=st["eng"].astype(_U64).tobytes(), stale=st["stale"].astype(np.uint8).tobytes(),
            chunks=st["chunks"].astype(_U64).tobytes(), seq=seq, ts=ts,
        )
    return IndexSnapshot(
        version=FORMAT_VERSION, created=time.time(), block_size=index.block_size, chunk_size=index.chunk_size,
        fast_root=index.fast_root, instances=out, global_chunks=index.export_global().astype(_U64).tobytes(),
    )


def encode(snap: IndexSnapshot) -> bytes:
    return _enc.encode(snap)


def decode(data: bytes) -> IndexSnapshot:
    try:
        snap = _dec.decode(data)
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"not an index snapshot: {exc}") from None
    if snap.version != FORMAT_VERSION:
        raise SnapshotError(f"snapshot format {snap.version}; this version reads {FORMAT_VERSION}")
    for iid, inst in snap.instances.items():
        n = len(inst.hash)
        if n % 8 or len(inst.parent) != n or len(inst.eng) != n or len(inst.stale) * 8 != n or len(inst.chunks) % 8:
            raise SnapshotError(f"instance {iid!r}: arrays of mismatched lengths")
    if len(snap.global_chunks) % 8:
        raise SnapshotError("global chunks: not a whole number of hashes")
    return snap


def write(path: str | Path, snap: IndexSnapshot) -> int:
    """Write atomically; returns the bytes written."""
    path = Path(path)
    data = encode(snap)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # Temporary files of writers that were killed mid-write (a snapshot child dies with its
    # controller): one writer per path, so any left now is such a leftover.
    for stray in path.parent.glob(f".{path.name}.*"):
        with contextlib.suppress(OSError):
            stray.unlink()
    return len(data)


class ForkedWrite:
    """A snapshot being written by a forked child (see :func:`fork_write`)."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self._fd = fd

    def wait(self) -> int:
        """Block until the child is done (run it on a thread); returns the bytes written or
        raises ``OSError`` with the child's reason."""
        try:
            chunks = []
            while chunk := os.read(self._fd, 4096):
                chunks.append(chunk)
        finally:
            os.close(self._fd)
        _, status = os.waitpid(self.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        msg = b"".join(chunks).decode("utf-8", "replace")
        if code != 0 or not msg.startswith("ok "):
            raise OSError(f"snapshot child exited with {code}: {msg or 'no reason given'}")
        return int(msg[3:])


def fork_write(path: str | Path, index: TierIndex,
               positions: Mapping[str, tuple[int | None, float | None]] | None = None) -> ForkedWrite:
    """Fork a child that takes the snapshot of ``index`` (as it is at the fork) and writes it to
    ``path``; returns at once. POSIX only (``os.fork``)."""
    prctl = _prctl()  # resolved here: the child must not load libraries (another thread's locks)
    r, w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        os.close(w)
        return ForkedWrite(pid, r)
    # The child: never returns into the caller (its event loop, its sockets are the parent's).
    code = 1
    try:
        gc.disable()  # no finalizer may run on the parent's objects (a ZMQ socket's would hang)
        _child_setup(parent, w, prctl)
        n = write(path, take(index, positions))
        os.write(w, b"ok %d" % n)
        code = 0
    except BaseException as exc:  # the reason goes to the parent, which logs it
        with contextlib.suppress(OSError):
            os.write(w, repr(exc).encode("utf-8", "replace")[:2000])
    finally:
        os._exit(code)


def _prctl() -> Any:
    global _PRCTL
    if _PRCTL is None:
        try:
            import ctypes

            _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
        except (OSError, AttributeError):
            _PRCTL = False
    return _PRCTL


_PRCTL: Any = None


def _child_setup(parent: int, keep: int, prctl: Any) -> None:
    """Let go of everything the child inherited that the parent relies on: its bound sockets
    (a controller restarted while a child lives must be able to bind again), its signal
    handlers and wake-up fd (a signal to the child must not reach the parent's loop); and die
    with the parent (Linux ``PR_SET_PDEATHSIG``)."""
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    with contextlib.suppress(ValueError):  # only allowed on the main thread
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
    if prctl:
        prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)  # the parent died before the line above


def read(path: str | Path) -> IndexSnapshot | None:
    """The snapshot at ``path``; None when there is none."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    return decode(data)


def check_compatible(index: TierIndex, snap: IndexSnapshot) -> None:
    mine = (index.block_size, index.chunk_size, index.fast_root)
    theirs = (snap.block_size, snap.chunk_size, snap.fast_root)
    if mine != theirs:
        raise SnapshotError(f"snapshot hashed with (block_size, chunk_size, fast_root)={theirs}, index uses {mine}")


def restore(index: TierIndex, snap: IndexSnapshot, instances: set[str] | frozenset[str] | None = None) -> dict[str, int]:
    """Load ``snap`` into ``index`` (instances limited to ``instances`` when given; others are
    skipped). Returns blocks restored per instance."""
    restored: dict[str, int] = {}
    for _ in restore_slices(index, snap, instances, restored):
        pass
    return restored


def restore_slices(
    index: TierIndex,
    snap: IndexSnapshot,
    instances: set[str] | frozenset[str] | None,
    restored: dict[str, int],
    slice_blocks: int = 20_000,
) -> Iterator[None]:
    """``restore`` a slice at a time: yields after about ``slice_blocks`` blocks, so a caller on
    an event loop can let other work run; ``restored`` fills with blocks per instance."""
    check_compatible(index, snap)
    for iid, inst in snap.instances.items():
        if instances is not None and iid not in instances:
            continue
        index.register_instance(iid)
        h = np.frombuffer(inst.hash, _U64).tolist()
        p = np.frombuffer(inst.parent, _U64).tolist()
        e = np.frombuffer(inst.eng, _U64).tolist()
        stale = np.frombuffer(inst.stale, np.uint8).astype(bool)
        restored[iid] = 0
        for n in _store_runs(index, iid, h, p, e, range(len(h)), slice_blocks):
            restored[iid] += n
            yield
        if stale.any():
            # Stale rows hang below fresh ones (a store refreshes ancestors): mark everything
            # stale, then store the fresh rows again, which turns them (and only them) fresh.
            index.mark_stale(iid)
            for _n in _store_runs(index, iid, h, p, e, np.flatnonzero(~stale).tolist(), slice_blocks):
                yield
        chunks = np.frombuffer(inst.chunks, _U64).tolist()
        if chunks:
            index.lmcache_admit(iid, chunks)
    g = np.frombuffer(snap.global_chunks, _U64).tolist()
    if g:
        index.global_stored(g)


def _store_runs(index: TierIndex, iid: str, h: list[int], p: list[int], e: list[int], rows: Any,
                slice_blocks: int) -> Iterator[int]:
    """Store ``rows`` as runs; yields the blocks stored about every ``slice_blocks``."""
    n = 0
    for run in _runs(h, p, rows):
        parent = p[run[0]] or None
        hashes = [h[i] for i in run]
        engs = [e[i] for i in run]
        # Engine hashes go along where the engine reported them (0: none, e.g. simulator rows).
        for lo, hi, has_eng in _segments(engs):
            n += index.gpu_stored_hashes(iid, hashes[lo:hi], parent if lo == 0 else hashes[lo - 1],
                                         engine_hashes=engs[lo:hi] if has_eng else None)
        if n >= slice_blocks:
            yield n
            n = 0
    yield n


def _runs(h: list[int], p: list[int], rows: Any) -> Iterator[list[int]]:
    """Rows as chains (each row the child of the one before), every chain after its parent's."""
    rows = list(rows)
    present = {h[i] for i in rows}
    kids: dict[int, list[int]] = {}
    roots = []
    for i in rows:
        if p[i] and p[i] in present:
            kids.setdefault(p[i], []).append(i)
        else:
            roots.append(i)
    stack = roots[::-1]
    while stack:
        run = [stack.pop()]
        while True:
            ks = kids.get(h[run[-1]])
            if not ks:
                break
            stack.extend(ks[:0:-1])
            run.append(ks[0])
        yield run


def _segments(engs: list[int]) -> Iterator[tuple[int, int, bool]]:
    lo = 0
    for i in range(1, len(engs) + 1):
        if i == len(engs) or bool(engs[i]) != bool(engs[lo]):
            yield lo, i, bool(engs[lo])
            lo = i
