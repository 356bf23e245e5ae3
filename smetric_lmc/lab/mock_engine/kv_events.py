"""vLLM KV cache events, published the way vLLM 0.32's ``ZmqEventPublisher`` publishes them.

One multipart message per engine step: ``[topic, seq (u64 big-endian, from 0), payload]`` where the
payload is msgpack ``[ts, [events], data_parallel_rank]`` and each event is a map whose keys come in
vLLM's field order (``type`` first). A ROUTER on the replay endpoint answers ``[id, b"", start_seq]``
with every buffered batch from ``start_seq`` on, then the end marker ``[id, b"", b"", 0xff..ff, b""]``.
The byte layout is checked against frames recorded from a real vLLM (tests/test_mock_engine.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from smetric_lmc.controller.tasks import cancel_and_wait

log = logging.getLogger(__name__)

END_SEQ = ((1 << 64) - 1).to_bytes(8, "big")
_ENCODER = msgspec.msgpack.Encoder()


def block_stored(block_hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int) -> dict[str, Any]:
    """A ``BlockStored`` event with every field vLLM 0.32 sends for a full-attention GPU block."""
    return {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(block_hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def block_removed(block_hash: int) -> dict[str, Any]:
    """vLLM sends one ``BlockRemoved`` per evicted block."""
    return {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU", "group_idx": 0}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[dict[str, Any]], ts: float, dp_rank: int = 0) -> bytes:
    return _ENCODER.encode([ts, events, dp_rank])


class KVEventPublisher:
    """PUB socket + replay ROUTER + ring buffer of the last ``buffer_steps`` batches."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: str = "kv",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        self.replays = 0

    def start(self) -> None:
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[dict[str, Any]], ts: float | None = None) -> int:
        """Send one batch (one engine step); returns its seq."""
        seq = self._seq
        self._seq += 1
        payload = encode_batch(events, time.time() if ts is None else ts)
        self._buffer.append((seq, payload))
        # A PUB socket never blocks: beyond the HWM it drops, as vLLM's does (subscribers replay).
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self.batches += 1
        return seq

    def buffered(self) -> list[tuple[int, bytes]]:
        """The batches kept for replay requests, (seq, payload), oldest first."""
        return list(self._buffer)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("mock engine: invalid replay request with %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays += 1
            for seq, payload in self.buffered():
                if seq >= start_seq:
                    await self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
