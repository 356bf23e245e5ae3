"""vLLM-side doubles shared by the KV-event subscriber tests: a recording sink, a fake engine
(PUB + replay ROUTER, as vLLM's publisher), and a subscriber wired to it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import zmq
import zmq.asyncio

from smetric_lmc.controller.vllm_events import VllmEventSubscriber

END = b"\xff" * 8


class Recorder:
    """Sink double: the live GPU blocks per instance plus every call, in order."""

    def __init__(self) -> None:
        self.live: dict[str, set[int]] = {}
        self.calls: list[tuple[str, str, int]] = []

    def gpu_stored(
        self,
        instance_id: str,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> int:
        assert len(token_ids) == len(block_hashes) * block_size
        self.live.setdefault(instance_id, set()).update(block_hashes)
        self.calls.append(("stored", instance_id, len(block_hashes)))
        return len(block_hashes)

    def gpu_removed(self, instance_id: str, block_hashes: Sequence[int]) -> int:
        self.live.setdefault(instance_id, set()).difference_update(block_hashes)
        self.calls.append(("removed", instance_id, len(block_hashes)))
        return len(block_hashes)

    def gpu_cleared(self, instance_id: str) -> None:
        self.live[instance_id] = set()
        self.calls.append(("cleared", instance_id, 0))

    def mark_stale(self, instance_id: str) -> None:
        self.calls.append(("stale", instance_id, 0))

    def n(self, kind: str) -> int:
        return sum(1 for c in self.calls if c[0] == kind)


class FakeEngine:
    """What vLLM's ZmqEventPublisher does on the wire: PUB (XPUB here, so the test can see the
    subscription arrive) plus a ROUTER serving its replay buffer."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        bind: bool,
        replay: bool = True,
        answer_replay: bool = True,
        canned_replay: list[list[bytes]] | None = None,
    ) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if bind:
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self.raw_requests: list[list[bytes]] = []
        self._canned = canned_replay
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._task: asyncio.Task[None] | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._answer = answer_replay
            self._task = asyncio.create_task(self._serve())

    async def subscribed(self) -> None:
        msg = await asyncio.wait_for(self.pub.recv(), 5)
        assert msg[:1] == b"\x01"

    async def publish(self, seq: int, payload: bytes, *, drop: bool = False) -> None:
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            ident, *request = await self.router.recv_multipart()
            self.raw_requests.append(request)
            start = request[-1]
            self.replay_requests.append(int.from_bytes(start, "big"))
            if not self._answer:
                continue
            if self._canned is not None:
                for reply in self._canned:
                    await self.router.send_multipart([ident, *reply])
                continue
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([ident, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", b"", END, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_with_subscriber(
    ctx: zmq.asyncio.Context, sink: Recorder, engine_kw: dict[str, Any] | None = None, **sub_kw: Any
) -> tuple[FakeEngine, VllmEventSubscriber]:
    """A fake engine binding a free loopback port and a subscriber connected to it (and its replay)."""
    engine = FakeEngine(ctx, "tcp://127.0.0.1:*", bind=True, **(engine_kw or {}))
    ep = engine.pub.getsockopt_string(zmq.LAST_ENDPOINT)
    sub_kw.setdefault("replay_endpoint", engine.replay_endpoint)
    return engine, VllmEventSubscriber(ep, "e0", sink, bind=False, ctx=ctx, **sub_kw)


@contextlib.asynccontextmanager
async def running(sub: VllmEventSubscriber) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(sub.run())
    try:
        yield task
    finally:
        await sub.close()
        await asyncio.wait_for(task, 2)  # a clean close ends run() without an exception
