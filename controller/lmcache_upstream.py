"""Forwarding of raw LMCache worker frames to a real LMCache controller (the "upstream")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from smetric_lmc.controller import lmcache_proto as P

log = logging.getLogger(__name__)

UPSTREAM_HWM = 10_000


@dataclass
class Channel:
    """Upstream state of one worker."""

    sock: zmq.asyncio.Socket
    task: asyncio.Task[None] | None = None
    inflight: int = 0
    since: float = 0.0
    backlog: list[list[bytes]] = field(default_factory=list)
    commands: list[P.HeartbeatCommand] = field(default_factory=list)


class Upstream:
    """Forwards raw worker frames to a real LMCache controller and consumes its replies."""

    def __init__(self, ctx: zmq.asyncio.Context, pull_url: str | None, reply_url: str | None,
                 timeout_s: float) -> None:
        self._ctx = ctx
        self._pull_url = pull_url
        self._reply_url = reply_url
        self._timeout = timeout_s
        self._push: zmq.asyncio.Socket | None = None
        self._channels: dict[tuple[str, int], Channel] = {}
        self.stats = dict.fromkeys(
            ("upstream_forwarded", "upstream_dropped", "upstream_replies", "upstream_errors"), 0)

    def start(self) -> None:
        if self._pull_url is not None:
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.setsockopt(zmq.SNDHWM, UPSTREAM_HWM)
            self._push.connect(self._pull_url)

    async def close(self) -> None:
        tasks = [c.task for c in self._channels.values() if c.task is not None]
        for key in list(self._channels):
            self.drop_worker(key, flush=False)
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._push is not None:
            self._push.close(linger=0)

    def take_commands(self, key: tuple[str, int]) -> list[P.HeartbeatCommand]:
        ch = self._channels.get(key)
        if ch is None or not ch.commands:
            return []
        out, ch.commands = ch.commands, []
        return out

    def drop_worker(self, key: tuple[str, int], *, flush: bool = True) -> None:
        ch = self._channels.pop(key, None)
        if ch is None:
            return
        if flush:
            self._flush(ch)
        if ch.task is not None:
            ch.task.cancel()
        ch.sock.close(linger=0)

    def forward_push(self, frames: list[bytes], key: tuple[str, int] | None) -> None:
        if self._push is None:
            return
        ch = self._channels.get(key) if key is not None else None
        if ch is not None and ch.inflight:
            if time.monotonic() - ch.since < self._timeout:
                # The worker sent this after getting our reply to its request; the upstream must
                # see that request first (e.g. ops right after a RegisterMsg), so hold it back.
                if len(ch.backlog) >= UPSTREAM_HWM:
                    self.stats["upstream_dropped"] += 1
                else:
                    ch.backlog.append(frames)
                return
            ch.inflight = 0  # upstream silent: stop holding back, forward best effort
            self._flush(ch)
        self._send_push(frames)

    def forward_request(self, key: tuple[str, int], frame: bytes) -> None:
        if self._reply_url is None:
            return
        ch = self._channels.get(key)
        if ch is None:
            # One DEALER per worker: the upstream sees each worker as its own peer, and every
            # reply on this socket belongs to this worker.
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, UPSTREAM_HWM)
            sock.connect(self._reply_url)
            ch = self._channels[key] = Channel(sock=sock)
            ch.task = asyncio.create_task(self._read(key, ch), name="lmcache-upstream")
        try:
            ch.sock.send_multipart([b"", frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.stats["upstream_dropped"] += 1
            return
        self.stats["upstream_forwarded"] += 1
        if not ch.inflight:
            ch.since = time.monotonic()
        ch.inflight += 1

    def _flush(self, ch: Channel) -> None:
        backlog, ch.backlog = ch.backlog, []
        for frames in backlog:
            self._send_push(frames)

    def _send_push(self, frames: list[bytes]) -> None:
        assert self._push is not None
        try:
            self._push.send_multipart(frames, flags=zmq.NOBLOCK)
            self.stats["upstream_forwarded"] += 1
        except zmq.ZMQError as exc:
            self.stats["upstream_dropped"] += 1
            log.debug("upstream PUSH failed: %s", exc)

    async def _read(self, key: tuple[str, int], ch: Channel) -> None:
        while True:
            try:
                frames = await ch.sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return
            self.stats["upstream_replies"] += 1
            if ch.inflight:
                ch.inflight -= 1
                ch.since = time.monotonic()
                if not ch.inflight:
                    self._flush(ch)
            try:
                reply = P.decode(frames[-1])
            except P.ProtocolError as exc:
                self.stats["upstream_errors"] += 1
                log.debug("undecodable upstream reply: %s", exc)
                continue
            if isinstance(reply, P.ErrorMsg):
                self.stats["upstream_errors"] += 1
                log.debug("upstream error for %s: %s", key, reply.error)
            elif isinstance(reply, P.HeartbeatRetMsg) and reply.commands:
                ch.commands = list(reply.commands)
