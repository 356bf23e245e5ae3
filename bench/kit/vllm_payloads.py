"""vLLM-shaped KV event payloads for the ingest benchmark (``bench/controller.py``)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from smetric_lmc.controller.vllm_plan import GpuBlockSink, apply_batch
from smetric_lmc.controller.vllm_wire import decode_payload


def synthetic_payloads(n_events: int, seed: int = 0) -> tuple[list[bytes], int]:
    """vLLM-shaped payloads holding at least ``n_events`` block events.

    Each engine step stores one new 16-block prompt (16 tokens per block, rooted at the
    hash seed) and evicts the prompt stored two steps earlier as 16 single-block
    ``BlockRemoved`` events, tail first, the order in which vLLM's free queue gives blocks
    up. Hashes span the full u64 range. Returns (payloads, block events).
    """
    rng = random.Random(seed)
    enc = msgspec.msgpack.Encoder()
    payloads: list[bytes] = []
    history: list[list[int]] = []
    total = 0
    ts = 1.7e9
    while total < n_events:
        hashes = [rng.getrandbits(64) for _ in range(16)]
        events: list[dict[str, Any]] = [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None,
                "token_ids": [rng.randrange(150_000) for _ in range(256)],
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None] * 16,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ]
        total += 16
        history.append(hashes)
        if len(history) > 2:
            for h in reversed(history.pop(0)):
                events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0})
                total += 1
        ts += 0.01
        payloads.append(enc.encode([ts, events, 0]))
    return payloads, total


def ingest_benchmark(sink: GpuBlockSink | Callable[[], GpuBlockSink], n_events: int, instance_id: str = "bench",
                     repeats: int = 1) -> float:
    """Decoded + applied block events per second on synthetic vLLM-shaped payloads.

    Blocks are 16 tokens; a real index must be configured for that block size and know
    ``instance_id`` before the run. With ``repeats`` > 1, ``sink`` is a factory called for a fresh
    sink per pass and the best pass counts (the one least disturbed by other load).
    """
    payloads, total = synthetic_payloads(n_events)
    best = 0.0
    for _ in range(repeats):
        target = sink() if callable(sink) else sink
        applied = 0
        t0 = time.perf_counter()
        for payload in payloads:
            applied += apply_batch(decode_payload(payload), target, instance_id)
        elapsed = time.perf_counter() - t0
        if applied != total:
            raise RuntimeError(f"applied {applied} of {total} block events")
        best = max(best, total / elapsed)
    return best
