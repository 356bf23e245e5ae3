"""Time LMCache 0.5.6's own controller lookup on a given index (run INSIDE the LMCache venv).

Builds LMCache's controller-side index exactly as its controller does (``RegistryTree`` fed with
``BatchedKVOperationMsg`` admits, workers registered in the order given) and runs the real
``KVController.lookup`` for each hash list. ``lookup`` normally hashes tokens with
``ChunkedTokenDatabase``; to compare on the same precomputed chunk hashes as our router, its token
database is replaced by one that yields the given hashes (``(start, end, hash)`` per 256-token
chunk), so everything else timed is LMCache's code.

Upstream behaviour (lmcache/v1/cache_controller/controllers/kv_controller.py ``KVController.lookup``
+ utils.py ``RegistryTree.find_kv``): walk the chunks in order; each chunk is credited to the FIRST
registered holder (instances in registration order, then workers, then locations); the walk stops
at the first chunk nobody holds; the answer maps each credited instance to (location, end token of
the last chunk credited to it). It is not a per-instance longest prefix.

Input (JSON file path as argv[1], or stdin)::

    {"chunk_size": 256, "repeat": 50,
     "admits": [{"instance": "i0", "worker": 0, "location": "LocalCPUBackend", "hashes": [..]}, ..],
     "lookups": [[h0, h1, ..], ..],
     "token_lookups": [[t0, t1, ..], ..]}      # optional: real token hashing path too

Output (stdout, JSON): per lookup p50/p99 in microseconds and LMCache's answer.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmcache
from lmcache.v1.cache_controller.controllers.kv_controller import KVController
from lmcache.v1.cache_controller.message import BatchedKVOperationMsg, KVOpEvent, LookupMsg, OpType
from lmcache.v1.cache_controller.utils import RegistryTree

_ADMIT_BATCH = 4096


class _GivenHashes:
    """Stands in for ChunkedTokenDatabase: yields precomputed chunk hashes."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.hashes: list[int] = []

    def process_tokens(self, tokens: Any, make_key: bool = True, **_: Any) -> Iterator[tuple[int, int, int]]:
        cs = self.chunk_size
        for i, h in enumerate(self.hashes):
            yield i * cs, (i + 1) * cs, h


def build(admits: list[dict[str, Any]]) -> RegistryTree:
    reg = RegistryTree()
    seen: set[tuple[str, int]] = set()
    for a in admits:
        iid, wid, loc = a["instance"], int(a.get("worker", 0)), a.get("location", "LocalCPUBackend")
        if (iid, wid) not in seen:
            seen.add((iid, wid))
            reg.register_worker(instance_id=iid, worker_id=wid, ip="127.0.0.1", port=0,
                                peer_init_url=None, socket=None, registration_time=time.time())
        hashes = a["hashes"]
        for s in range(0, len(hashes), _ADMIT_BATCH):
            ops = [KVOpEvent(op_type=OpType.ADMIT, key=h, seq_num=s + i)
                   for i, h in enumerate(hashes[s:s + _ADMIT_BATCH])]
            msg = BatchedKVOperationMsg(instance_id=iid, worker_id=wid, location=loc, operations=ops)
            if not reg.handle_batched_kv_operations(msg, is_full_sync=True):
                raise RuntimeError(f"admit rejected for {iid}/{wid}")
    return reg


def _run(coro: Any) -> Any:
    # lookup() is a coroutine that never awaits; driving it directly keeps event-loop cost out.
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("lookup awaited unexpectedly")


def _time(fn: Any, repeat: int) -> tuple[Any, list[float]]:
    out = None
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        out = fn()
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
    return out, samples


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text() if len(sys.argv) > 1 else sys.stdin.read())
    chunk_size = int(spec.get("chunk_size", 256))
    repeat = int(spec.get("repeat", 50))
    t0 = time.perf_counter()
    reg = build(spec["admits"])
    build_s = time.perf_counter() - t0
    kv = KVController(registry=reg)
    real_db = kv.token_database
    given = _GivenHashes(chunk_size)
    results = []
    all_samples: list[float] = []
    for i, hashes in enumerate(spec.get("lookups", [])):
        given.hashes = hashes
        kv.token_database = given
        msg = LookupMsg(event_id=f"l{i}", tokens=[])
        ret, samples = _time(lambda m=msg: _run(kv.lookup(m)), repeat)
        all_samples += samples
        results.append({"p50_us": statistics.median(samples), "p99_us": _pct(samples, 0.99),
                        "answer": {k: list(v) for k, v in ret.layout_info.items()}})
    token_results = []
    kv.token_database = real_db
    for i, tokens in enumerate(spec.get("token_lookups", [])):
        msg = LookupMsg(event_id=f"t{i}", tokens=tokens)
        ret, samples = _time(lambda m=msg: _run(kv.lookup(m)), repeat)
        token_results.append({"p50_us": statistics.median(samples), "p99_us": _pct(samples, 0.99),
                              "answer": {k: list(v) for k, v in ret.layout_info.items()}})
    print(json.dumps({
        "lmcache_version": getattr(lmcache, "__version__", "unknown"),
        "instances": len(reg.instances),
        "chunks_indexed": reg.get_total_kv_count(),
        "build_s": build_s,
        "repeat": repeat,
        "overall": {"p50_us": statistics.median(all_samples) if all_samples else None,
                    "p99_us": _pct(all_samples, 0.99) if all_samples else None},
        "lookups": results,
        "token_lookups": token_results,
    }))


if __name__ == "__main__":
    main()
