"""Compact native workload format: a magic line, then one msgpack document.

Block ids are delta-coded against the previous request of the same session (length of the shared
prefix + the new ids as little-endian uint64 bytes), so a session costs about its distinct blocks,
and loading restores the prefix views that keep memory low.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from smetric_lmc.lab.workload.chain import common_prefix
from smetric_lmc.lab.workload.model import TraceRequest, TraceSession, Workload, share_prefix_views

MAGIC = b"SMETRIC-WORKLOAD 1\n"
_LE_U64 = np.dtype("<u8")


class _Session(msgspec.Struct, array_like=True):
    session_id: str
    parent_id: str | None
    start_offset: float
    arrival: list[float]
    input_tokens: list[int]
    output_tokens: list[int]
    think_time: list[float]
    kind: list[str]
    turn: list[int]
    keep: list[int]  # blocks kept from the previous request's ids
    new_ids: list[bytes]  # the ids that follow them


class _Doc(msgspec.Struct):
    name: str
    block_size: int
    meta: dict[str, Any]
    sessions: list[_Session]


def _encode_session(s: TraceSession) -> _Session:
    keep: list[int] = []
    new: list[bytes] = []
    prev: np.ndarray | None = None
    for r in s.requests:
        ids = np.asarray(r.block_ids, dtype=np.uint64)
        k = common_prefix(prev, ids) if prev is not None else 0
        keep.append(k)
        new.append(ids[k:].astype(_LE_U64, copy=False).tobytes())
        prev = ids
    rs = s.requests
    return _Session(
        s.session_id,
        s.parent_id,
        float(s.start_offset),
        [float(r.arrival) for r in rs],
        [int(r.input_tokens) for r in rs],
        [int(r.output_tokens) for r in rs],
        [float(r.think_time) for r in rs],
        [r.kind for r in rs],
        [int(r.turn) for r in rs],
        keep,
        new,
    )


def _decode_session(d: _Session) -> TraceSession:
    arrays: list[np.ndarray] = []
    extends: list[bool] = []
    prev = np.empty(0, dtype=np.uint64)
    for k, raw in zip(d.keep, d.new_ids, strict=True):
        new = np.frombuffer(raw, dtype=_LE_U64).astype(np.uint64)
        ids = np.concatenate([prev[:k], new]) if k else new
        extends.append(bool(arrays) and k == len(prev))
        arrays.append(ids)
        prev = ids
    arrays = share_prefix_views(arrays, extends)
    reqs = [
        TraceRequest(a, i, o, b, t, kd, tn)
        for a, i, o, b, t, kd, tn in zip(
            d.arrival, d.input_tokens, d.output_tokens, arrays, d.think_time, d.kind, d.turn, strict=True
        )
    ]
    return TraceSession(d.session_id, reqs, d.parent_id, d.start_offset)


def save_native(workload: Workload, path: str | Path) -> Path:
    """Write `workload` in the native format; `load_native` gives back an equal workload."""
    doc = _Doc(
        workload.name, workload.block_size, workload.meta, [_encode_session(s) for s in workload.sessions]
    )
    path = Path(path)
    with open(path, "wb") as fh:
        fh.write(MAGIC)
        fh.write(msgspec.msgpack.encode(doc))
    return path


def is_native(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as fh:
        return fh.read(len(MAGIC)) == MAGIC


def load_native(path: str | Path) -> Workload:
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a native workload file (bad magic)")
    doc = msgspec.msgpack.decode(memoryview(data)[len(MAGIC) :], type=_Doc)
    return Workload(doc.name, doc.block_size, [_decode_session(s) for s in doc.sessions], doc.meta)
