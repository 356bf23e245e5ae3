"""Client of the controller's ``route`` service (ZMQ DEALER, msgpack or JSON).

Sync::

    from smetric_lmc.client import RouteClient
    with RouteClient("tcp://127.0.0.1:5600") as c:
        hs = c.hash_settings()  # the controller's own: client-side hashes then match its index
        d = c.route("req-1", token_ids=ids, turn=2, est_hit_tokens=4096, hashing=hs)
        ...  # send the request to d.endpoint
        c.done("req-1", instance_id=d.instance_id, output_tokens=n)

Async (``AsyncRouteClient``): same methods, awaitable; many requests may be in flight at once on
one client (each carries a correlation frame the controller echoes).

``hashing=HashSettings`` hashes token ids here so only the chained block hashes cross the wire;
take the settings from the controller (``hash_settings()``) so they match its index: each chain
carries its root, and the controller refuses (``hash_mismatch``) hashes from any other. Errors from the controller raise ``RouteError(code, message)``; no reply within
``timeout_s`` raises ``RouteTimeout`` and the socket is replaced, so a late reply can never be
taken for the answer to the next request.

Replicas: ``url`` may be a list of controller replicas (or one string of comma-separated URLs).
A call that times out or fails in transport is retried on the next replica, ``retries`` times
(default: once per other replica), each attempt with its own ``timeout_s``; the client stays on
the replica that answered. Only when every attempt failed does the call raise (the last error).
A ``route`` that timed out may still have been counted by the replica that was slow; its load is
released when that replica's in-flight entry expires (``load.lost_done_grace_s``) or its engine
metrics say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from smetric_lmc.curve import HandshakeWatch
from smetric_lmc.hashing import HashSettings, TokenIds
from smetric_lmc.wire import (
    DoneAck,
    DoneReport,
    ErrorReply,
    HashChain,
    HealthReply,
    HealthRequest,
    InstanceInfo,
    InstancesReply,
    InstancesRequest,
    PrefilledAck,
    PrefilledReport,
    RouteDecision,
    RouteRequest,
    StatsReply,
    StatsRequest,
    WireError,
    decode_reply,
    encode,
)

__all__ = ["AsyncRouteClient", "RouteClient", "RouteError", "RouteRefused", "RouteTimeout", "build_route_request"]


class RouteError(Exception):
    """The controller answered with an error (or something that is not the expected reply)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RouteTimeout(RouteError, TimeoutError):
    """No reply within the timeout; the client's socket has been reset."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)


class RouteRefused(RouteTimeout):
    """The controller refused this client's security handshake (CURVE key unknown or missing)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = "refused"


def build_route_request(
    request_id: str,
    *,
    token_ids: TokenIds | None = None,
    hashes: Sequence[HashChain] | None = None,
    prompt_tokens: int | None = None,
    turn: int | None = None,
    est_hit_tokens: int | None = None,
    model: str = "",
    hashing: HashSettings | None = None,
) -> RouteRequest:
    """The ``route`` message for a prompt; with ``hashing`` its token ids are hashed here.

    Client-side hashing replaces the token ids on the wire with the fast chain (and the LMCache
    chunk chain when the controller indexes chunks), each tagged with its root.
    """
    chains = list(hashes or ())
    ids: list[int] | None = None
    if token_ids is not None:
        if hashing is not None:
            chains.extend(hashing.chains(token_ids))
            if prompt_tokens is None:
                prompt_tokens = len(token_ids)
        else:
            ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
    return RouteRequest(
        request_id=request_id,
        model=model,
        token_ids=ids,
        hashes=chains,
        prompt_tokens=prompt_tokens,
        turn=turn,
        est_hit_tokens=est_hit_tokens,
    )


def _done_report(request_id: str, **kw: Any) -> DoneReport:
    return DoneReport(request_id=request_id, **kw)


def _settings_of(stats: dict[str, Any]) -> HashSettings:
    try:
        return HashSettings.from_stats(stats.get("hashing"))
    except ValueError as exc:
        raise RouteError("bad_reply", str(exc)) from None


def _expect(reply: Any, kind: type) -> Any:
    if isinstance(reply, ErrorReply):
        raise RouteError(reply.code, reply.message)
    if not isinstance(reply, kind):
        raise RouteError("bad_reply", f"expected {kind.__name__}, got {type(reply).__name__}")
    return reply


def _decode(frame: bytes) -> Any:
    try:
        return decode_reply(frame)
    except WireError as exc:
        raise RouteError("bad_reply", str(exc)) from None


def _curve_setup(
    sock: zmq.Socket, server_key: str | None, public_key: str | None, secret_key: str | None
) -> None:
    if not server_key:
        return
    if not (public_key and secret_key):
        public_key, secret_key = (k.decode() for k in zmq.curve_keypair())  # an anonymous client key
    sock.curve_serverkey = server_key.encode()
    sock.curve_publickey = public_key.encode()
    sock.curve_secretkey = secret_key.encode()


def replica_urls(url: str | Sequence[str]) -> list[str]:
    """Controller URLs from one URL, a comma-separated string or a list; at least one."""
    parts = url.split(",") if isinstance(url, str) else list(url)
    urls = [u.strip() for u in parts if u and u.strip()]
    if not urls:
        raise ValueError("no controller URL given")
    return urls


def _failover(exc: RouteError) -> bool:
    """Worth another replica: no answer (timeout, refused handshake) or a broken transport."""
    return isinstance(exc, RouteTimeout) or exc.code == "transport"


class _Base:
    def __init__(
        self,
        url: str | Sequence[str],
        *,
        json: bool = False,
        timeout_s: float = 2.0,
        retries: int | None = None,
        curve_server_key: str | None = None,
        curve_public_key: str | None = None,
        curve_secret_key: str | None = None,
    ) -> None:
        self.urls = replica_urls(url)
        self._cur = 0
        self.json = json
        self.timeout_s = timeout_s
        self.retries = len(self.urls) - 1 if retries is None else retries
        if self.retries < 0:
            raise ValueError("retries must be >= 0")
        self.failovers = 0  # calls moved on to another replica
        self._curve = (curve_server_key, curve_public_key, curve_secret_key)

    @property
    def url(self) -> str:
        """The replica calls go to now."""
        return self.urls[self._cur]

    def _next_replica(self, failed: str) -> None:
        if self.url == failed:  # concurrent failures on one replica move on once
            self._cur = (self._cur + 1) % len(self.urls)
            self.failovers += 1

    def _configure(self, sock: zmq.Socket, url: str) -> HandshakeWatch:
        sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a controller we are not connected to: a request that times out must
        # not be delivered (and counted as load) minutes later when the controller comes back.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        _curve_setup(sock, *self._curve)
        watch = HandshakeWatch(sock)
        sock.connect(url)
        return watch


def _timeout(watch: HandshakeWatch | None, url: str, message: str) -> RouteTimeout:
    """A timeout, or a refusal when the handshake failed (no reply will ever come)."""
    reason = watch.failure() if watch is not None else None
    return RouteRefused(f"{url}: {reason}") if reason else RouteTimeout(message)


class RouteClient(_Base):
    """Blocking client; one request at a time (use one client per thread)."""

    def __init__(self, url: str | Sequence[str], *, ctx: zmq.Context | None = None, **kw: Any) -> None:
        super().__init__(url, **kw)
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._watch: HandshakeWatch | None = None
        self._seq = itertools.count()
        self._tag = os.urandom(4)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            self._watch = self._configure(sock, self.url)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self._reset()

    def __enter__(self) -> RouteClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _call(self, msg: msgspec.Struct) -> Any:
        payload = encode(msg, json=self.json)
        for attempt in range(self.retries + 1):
            url = self.url
            try:
                return self._call_once(payload, url)
            except RouteError as exc:
                if not _failover(exc) or attempt == self.retries:
                    raise
                self._next_replica(url)
        raise AssertionError("unreachable")

    def _call_once(self, payload: bytes, url: str) -> Any:
        sock = self._socket()
        corr = self._tag + next(self._seq).to_bytes(8, "big")
        timeout_ms = max(1, int(self.timeout_s * 1000))
        try:
            if not sock.poll(timeout_ms, zmq.POLLOUT):
                raise _timeout(self._watch, url, f"controller at {url} not reachable within {self.timeout_s}s")
            sock.send_multipart([corr, b"", payload], flags=zmq.NOBLOCK)
            while True:
                if not sock.poll(timeout_ms, zmq.POLLIN):
                    raise _timeout(self._watch, url, f"no reply from {url} within {self.timeout_s}s")
                frames = sock.recv_multipart()
                if len(frames) == 3 and frames[0] == corr and frames[1] == b"":
                    return _decode(frames[2])
                # A reply for someone else cannot happen on a fresh socket; skip it defensively.
        except RouteTimeout:
            self._reset()
            raise
        except zmq.ZMQError as exc:
            self._reset()
            raise RouteError("transport", str(exc)) from exc

    def route(self, request_id: str, **kw: Any) -> RouteDecision:
        """Ask where ``request_id`` should go; keyword arguments as :func:`build_route_request`."""
        return _expect(self._call(build_route_request(request_id, **kw)), RouteDecision)

    def done(self, request_id: str, **kw: Any) -> DoneAck:
        """Report a request finished (instance_id, prompt_tokens, output_tokens, cached_tokens, ttft_s, e2e_s, ok)."""
        return _expect(self._call(_done_report(request_id, **kw)), DoneAck)

    def prefilled(self, request_id: str, instance_id: str | None = None) -> PrefilledAck:
        """Report the request's first output token arrived (its prompt is prefilled)."""
        return _expect(self._call(PrefilledReport(request_id=request_id, instance_id=instance_id)), PrefilledAck)

    def stats(self) -> dict[str, Any]:
        return _expect(self._call(StatsRequest()), StatsReply).stats

    def hash_settings(self) -> HashSettings:
        """The controller's hashing, to hash prompts here exactly as its index does."""
        return _settings_of(self.stats())

    def health(self) -> HealthReply:
        return _expect(self._call(HealthRequest()), HealthReply)

    def instances(self) -> list[InstanceInfo]:
        return _expect(self._call(InstancesRequest()), InstancesReply).instances


class _Conn:
    """One replica's socket, its reply reader and the calls waiting on it."""

    def __init__(self, sock: zmq.asyncio.Socket, watch: HandshakeWatch) -> None:
        self.sock = sock
        self.watch = watch
        self.pending: dict[bytes, asyncio.Future[Any]] = {}
        self.reader: asyncio.Task[None] | None = None


class AsyncRouteClient(_Base):
    """asyncio client; concurrent calls share one socket per replica, replies matched by
    correlation frame."""

    def __init__(self, url: str | Sequence[str], *, ctx: zmq.asyncio.Context | None = None, **kw: Any) -> None:
        super().__init__(url, **kw)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._conns: dict[str, _Conn] = {}
        self._seq = itertools.count()
        self._tag = os.urandom(4)
        self.late_replies = 0

    def _conn(self, url: str) -> _Conn:
        conn = self._conns.get(url)
        if conn is None:
            sock = self._ctx.socket(zmq.DEALER)
            conn = _Conn(sock, self._configure(sock, url))
            conn.reader = asyncio.get_running_loop().create_task(self._read(conn))
            self._conns[url] = conn
        return conn

    async def _read(self, conn: _Conn) -> None:
        while True:
            try:
                frames = await conn.sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) != 3 or frames[1] != b"":
                continue
            fut = conn.pending.pop(frames[0], None)
            if fut is None or fut.done():
                self.late_replies += 1  # answer to a request that already timed out
                continue
            try:
                fut.set_result(_decode(frames[2]))
            except RouteError as exc:
                fut.set_exception(exc)

    async def _call(self, msg: msgspec.Struct) -> Any:
        payload = encode(msg, json=self.json)
        for attempt in range(self.retries + 1):
            url = self.url
            try:
                return await self._call_once(payload, url)
            except RouteError as exc:
                if not _failover(exc) or attempt == self.retries:
                    raise
                self._next_replica(url)
        raise AssertionError("unreachable")

    async def _call_once(self, payload: bytes, url: str) -> Any:
        conn = self._conn(url)
        corr = self._tag + next(self._seq).to_bytes(8, "big")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        conn.pending[corr] = fut
        deadline = loop.time() + self.timeout_s
        try:
            sent = conn.sock.send_multipart([corr, b"", payload])
            if not sent.done():  # the socket's queue is full: wait for room, within the deadline
                await asyncio.wait_for(sent, self.timeout_s)
            sent.result()
            # A timer on the reply's future instead of wait_for: no task per call on the hot path.
            timer = loop.call_later(max(0.0, deadline - loop.time()), _expire, fut)
            try:
                return await fut
            finally:
                timer.cancel()
        except asyncio.TimeoutError:
            conn.pending.pop(corr, None)
            error = _timeout(conn.watch, url, f"no reply from {url} within {self.timeout_s}s")
            if not conn.pending:
                # Nothing else in flight: drop the socket so anything still queued for the
                # controller is discarded rather than delivered late.
                await self._drop(url)
            raise error from None
        except zmq.ZMQError as exc:
            conn.pending.pop(corr, None)
            raise RouteError("transport", str(exc)) from exc

    async def _drop(self, url: str) -> None:
        conn = self._conns.pop(url, None)
        if conn is None:
            return
        conn.watch.close()
        if conn.reader is not None:
            conn.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await conn.reader
        conn.sock.close(linger=0)
        for fut in conn.pending.values():
            if not fut.done():
                fut.set_exception(RouteError("transport", "client closed"))
        conn.pending.clear()

    async def _reset(self) -> None:
        for url in list(self._conns):
            await self._drop(url)

    async def close(self) -> None:
        await self._reset()

    async def __aenter__(self) -> AsyncRouteClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def route(self, request_id: str, **kw: Any) -> RouteDecision:
        return _expect(await self._call(build_route_request(request_id, **kw)), RouteDecision)

    async def done(self, request_id: str, **kw: Any) -> DoneAck:
        return _expect(await self._call(_done_report(request_id, **kw)), DoneAck)

    async def prefilled(self, request_id: str, instance_id: str | None = None) -> PrefilledAck:
        return _expect(await self._call(PrefilledReport(request_id=request_id, instance_id=instance_id)), PrefilledAck)

    async def stats(self) -> dict[str, Any]:
        return _expect(await self._call(StatsRequest()), StatsReply).stats

    async def hash_settings(self) -> HashSettings:
        return _settings_of(await self.stats())

    async def health(self) -> HealthReply:
        return _expect(await self._call(HealthRequest()), HealthReply)

    async def instances(self) -> list[InstanceInfo]:
        return _expect(await self._call(InstancesRequest()), InstancesReply).instances


class InProcessRouteClient(AsyncRouteClient):
    """The route client of a gateway that runs in the controller's own process and event loop.

    Each call is the same encoded request the socket would carry, answered by the controller's
    ``RouteCore.handle`` (the same checks, limits, counters and reply), without the ZMQ round trip
    and the second process it crosses: what a one-process deployment (``smetric gateway
    --with-controller``, ``smetric router``) saves on every request."""

    def __init__(self, answer: Callable[[bytes], bytes], **kw: Any) -> None:
        super().__init__("inproc://controller", **kw)
        self._answer = answer

    async def _call(self, msg: msgspec.Struct) -> Any:
        return _decode(self._answer(encode(msg, json=self.json)))


def _expire(fut: asyncio.Future[Any]) -> None:
    """The route client's deadline passed without a reply."""
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())
