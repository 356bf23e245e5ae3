"""LMCache worker-side doubles shared by the LMCache server tests: a recording sink, a worker
(PUSH + DEALER sockets), message builders and a served server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from helpers import until

from smetric_lmc.controller import lmcache_proto as P
from smetric_lmc.controller.lmcache_server import LMCacheWorkerServer

ANY = "tcp://127.0.0.1:*"
C0, C1, C2, C3 = -9006915360733114755, 6249281391258955993, -2988454140027074458, 3938654595164371996


class RecordingSink:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def lmcache_admit(self, instance_id: str, chunk_hashes: Iterable[int]) -> None:
        self.calls.append(("admit", instance_id, sorted(chunk_hashes)))

    def lmcache_evict(self, instance_id: str, chunk_hashes: Iterable[int]) -> None:
        self.calls.append(("evict", instance_id, sorted(chunk_hashes)))

    def lmcache_cleared(self, instance_id: str) -> None:
        self.calls.append(("cleared", instance_id))

    def lmcache_worker_seen(self, instance_id: str) -> None:
        self.calls.append(("seen", instance_id))

    def changes(self) -> list[tuple]:
        return [c for c in self.calls if c[0] != "seen"]

    def held(self) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for c in self.calls:
            if c[0] == "admit":
                out.setdefault(c[1], set()).update(c[2])
            elif c[0] == "evict":
                out.setdefault(c[1], set()).difference_update(c[2])
            elif c[0] == "cleared":
                out[c[1]] = set()
        return out


class Worker:
    """Plays an LMCache worker: PUSH to pull, DEALER to reply and to heartbeat."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoints: dict[str, str]) -> None:
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(endpoints["pull"])
        self.req = ctx.socket(zmq.DEALER)
        self.req.connect(endpoints["reply"])
        self.hb = None
        if "heartbeat" in endpoints:
            self.hb = ctx.socket(zmq.DEALER)
            self.hb.connect(endpoints["heartbeat"])
        for s in (self.push, self.req, self.hb):
            if s is not None:
                s.setsockopt(zmq.LINGER, 0)

    async def ask(self, payload: bytes, *, heartbeat: bool = False) -> bytes:
        sock = self.hb if heartbeat else self.req
        assert sock is not None
        await sock.send_multipart([b"", payload])
        frames = await asyncio.wait_for(sock.recv_multipart(), 5)
        assert len(frames) == 2 and frames[0] == b""
        return frames[1]

    async def call(self, msg: msgspec.Struct, *, heartbeat: bool = False) -> P.AnyMsg:
        return P.decode(await self.ask(P.encode(msg), heartbeat=heartbeat))

    def close(self) -> None:
        for s in (self.push, self.req, self.hb):
            if s is not None:
                s.close(linger=0)


async def push(server: LMCacheWorkerServer, w: Worker, frames: list[bytes]) -> None:
    """PUSH one multipart message and wait until the server handled every frame."""
    target = server.stats["pull_frames"] + len(frames)
    await w.push.send_multipart(frames)
    await until(lambda: server.stats["pull_frames"] >= target)


def reg(iid: str, wid: int = 0, port: int = 8500, peer: str | None = None) -> P.RegisterMsg:
    return P.RegisterMsg(instance_id=iid, worker_id=wid, ip="127.0.0.1", port=port, peer_init_url=peer)


def hb(iid: str, wid: int = 0) -> P.HeartbeatMsg:
    return P.HeartbeatMsg(instance_id=iid, worker_id=wid, ip="127.0.0.1", port=8500, peer_init_url=None)


def ops(iid: str, pairs: list[tuple[str, int]], *, wid: int = 0, loc: str = "LocalCPUBackend",
        seq0: int = 0) -> bytes:
    return P.encode(P.BatchedKVOperationMsg(
        instance_id=iid, worker_id=wid, location=loc,
        operations=[P.KVOpEvent(op_type=o, key=k, seq_num=seq0 + i) for i, (o, k) in enumerate(pairs)]))



@contextlib.asynccontextmanager
async def serving(ctx: zmq.asyncio.Context, sink: Any, **kw: Any) -> AsyncIterator[tuple[LMCacheWorkerServer, Worker]]:
    """Our server on free loopback ports, and a worker (DEALER + PUSH) connected to it."""
    server = LMCacheWorkerServer(sink, pull_url=ANY, reply_url=ANY, **kw)
    await server.start()
    w = Worker(ctx, server.endpoints)
    try:
        yield server, w
    finally:
        w.close()
        await server.close()
