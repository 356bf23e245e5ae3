"""Loaders for the JSON-lines traces: Qwen-Bailian usage traces and Mooncake FAST'25 traces."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from smetric_lmc.lab.workload.chain import chain_ids, common_prefix, scope_seed
from smetric_lmc.lab.workload.model import TraceRequest, TraceSession, Workload, share_prefix_views

log = logging.getLogger(__name__)

BAILIAN_BLOCK_SIZE = 16
MOONCAKE_BLOCK_SIZE = 512


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield msgspec.json.decode(line)
            except msgspec.DecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e


class _Chainer:
    """Chains raw ids in one global scope, hashing each distinct (prefix, block) only once.

    Requests in these traces share prefixes across sessions, so the chained prefix of the most
    similar recent request (the parent, when there is one) is reused before hashing the rest.
    """

    def __init__(self, scope: str) -> None:
        self.seed = scope_seed(scope)

    def chain(self, raw: list[int], base_raw: list[int] | None, base_ids: np.ndarray | None) -> np.ndarray:
        lcp = common_prefix(base_raw, raw) if base_raw is not None else 0
        ids = np.empty(len(raw), dtype=np.uint64)
        if lcp:
            ids[:lcp] = base_ids[:lcp]  # type: ignore[index]
        if lcp < len(raw):
            chain_ids(raw[lcp:], self.seed, int(ids[lcp - 1]) if lcp else 0, out=ids[lcp:])
        return ids


def load_bailian(path: str | Path) -> Workload:
    """Qwen-Bailian usage trace: sessions are chat_id / parent_chat_id chains, 16-token blocks.

    Every request whose parent chain ends in the same root belongs to that root's session, ordered
    by timestamp. `turn` is the request's depth in its chain; a chain whose top request names a
    parent that is not in the file (a sampled trace) starts at the recorded turn of that request.
    `think_time` is the gap to the parent's arrival: the trace has no completion times, so it is an
    upper bound on the client's think time.
    """
    rows = list(iter_jsonl(path))
    if not rows:
        return Workload(Path(path).stem, BAILIAN_BLOCK_SIZE, [], {"source": "bailian", "format": "bailian"})
    by_id: dict[Any, dict[str, Any]] = {}
    for r in rows:
        by_id[r["chat_id"]] = r
    # The recorded turn may be 0- or 1-based; calibrate on requests that are roots by the trace.
    root_turns = [int(r.get("turn", 0)) for r in rows if r.get("parent_chat_id", -1) == -1]
    turn_base = min(root_turns) if root_turns else 0

    depth: dict[Any, int] = {}
    root: dict[Any, Any] = {}

    def resolve(cid: Any) -> None:
        path_ids = []
        cur = cid
        while cur not in depth:
            r = by_id[cur]
            p = r.get("parent_chat_id", -1)
            if p == -1 or p not in by_id or p in path_ids or p == cur:
                depth[cur] = 0 if p == -1 else max(1, int(r.get("turn", turn_base + 1)) - turn_base)
                root[cur] = cur
                break
            path_ids.append(cur)
            cur = p
        for c in reversed(path_ids):
            parent = by_id[c]["parent_chat_id"]
            depth[c] = depth[parent] + 1
            root[c] = root[parent]

    for cid in by_id:
        resolve(cid)

    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in by_id.values():
        groups[root[r["chat_id"]]].append(r)
    t0 = min(float(r["timestamp"]) for r in rows)
    chainer = _Chainer("bailian:" + Path(path).name)
    sessions: list[TraceSession] = []
    for rid, reqs in groups.items():
        reqs.sort(key=lambda r: (float(r["timestamp"]), depth[r["chat_id"]]))
        start = float(reqs[0]["timestamp"])
        chained: dict[Any, np.ndarray] = {}
        arrays: list[np.ndarray] = []
        extends: list[bool] = []
        out: list[TraceRequest] = []
        prev_raw: list[int] | None = None
        for r in reqs:
            raw = list(r.get("hash_ids", []))
            parent = by_id.get(r.get("parent_chat_id", -1))
            base = parent if parent is not None and parent["chat_id"] in chained else None
            base_raw = list(base.get("hash_ids", [])) if base is not None else prev_raw
            base_ids = chained[base["chat_id"]] if base is not None else (arrays[-1] if arrays else None)
            ids = chainer.chain(raw, base_raw, base_ids)
            chained[r["chat_id"]] = ids
            extends.append(prev_raw is not None and raw[: len(prev_raw)] == prev_raw)
            arrays.append(ids)
            prev_raw = raw
            ts = float(r["timestamp"])
            think = ts - float(parent["timestamp"]) if parent is not None else 0.0
            out.append(
                TraceRequest(
                    arrival=ts - start,
                    input_tokens=int(r.get("input_length", 0)),
                    output_tokens=int(r.get("output_length", 0)),
                    block_ids=ids,
                    think_time=max(0.0, think),
                    kind=str(r.get("type", "")),
                    turn=depth[r["chat_id"]],
                )
            )
        for req, ids in zip(out, share_prefix_views(arrays, extends), strict=True):
            req.block_ids = ids
        sessions.append(TraceSession(f"chat{rid}", out, None, start - t0))
    sessions.sort(key=lambda s: (s.start_offset, s.session_id))
    meta = {
        "source": "qwen-bailian",
        "format": "bailian",
        "path_name": Path(path).name,
        "absolute_starts": True,
        "notes": [
            "sessions from chat_id / parent_chat_id chains; root start_offset = first timestamp - trace start",
            "think_time = gap to the parent request's arrival (no completion times recorded)",
        ],
    }
    return Workload(Path(path).stem, BAILIAN_BLOCK_SIZE, sessions, meta)


def load_mooncake(path: str | Path) -> Workload:
    """Mooncake FAST'25 trace: 512-token blocks, timestamps in ms, no session fields.

    Each request becomes its own single-request session with turn 0 (nothing says which requests
    continue a conversation), starting at its timestamp relative to the first one.
    """
    rows = list(iter_jsonl(path))
    rows.sort(key=lambda r: float(r.get("timestamp", 0)))
    t0 = float(rows[0].get("timestamp", 0)) if rows else 0.0
    chainer = _Chainer("mooncake:" + Path(path).name)
    # Requests sharing a first block usually share more: reuse the chained prefix of the latest one.
    last_by_head: dict[int, tuple[list[int], np.ndarray]] = {}
    sessions = []
    for i, r in enumerate(rows):
        raw = list(r.get("hash_ids", []))
        base = last_by_head.get(raw[0]) if raw else None
        ids = chainer.chain(raw, base[0] if base else None, base[1] if base else None)
        if raw:
            last_by_head[raw[0]] = (raw, ids)
        req = TraceRequest(
            arrival=0.0,
            input_tokens=int(r.get("input_length", 0)),
            output_tokens=int(r.get("output_length", 0)),
            block_ids=ids,
            kind="",
            turn=0,
        )
        sessions.append(TraceSession(f"req{i}", [req], None, (float(r.get("timestamp", 0)) - t0) / 1000.0))
    meta = {
        "source": "mooncake",
        "format": "mooncake",
        "path_name": Path(path).name,
        "absolute_starts": True,
        "no_sessions": True,
        "notes": ["no sessions: every request is its own session and a first turn (turn 0)"],
    }
    return Workload(Path(path).stem, MOONCAKE_BLOCK_SIZE, sessions, meta)
