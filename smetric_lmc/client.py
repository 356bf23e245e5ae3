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
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Sequence
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


class _Base:
    def __init__(
        self,
        url: str,
        *,
        json: bool = False,
        timeout_s: float = 2.0,
        curve_server_key: str | None = None,
        curve_public_key: str | None = None,
        curve_secret_key: str | None = None,
    ) -> None:
        self.url = url
        self.json = json
        self.timeout_s = timeout_s
        self._curve = (curve_server_key, curve_public_key, curve_secret_key)

    def _configure(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a controller we are not connected to: a request that times out must
        # not be delivered (and counted as load) minutes later when the controller comes back.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        _curve_setup(sock, *self._curve)
        self._close_watch()
        self._watch: HandshakeWatch | None = HandshakeWatch(sock)
        sock.connect(self.url)

    def _timeout(self, message: str) -> RouteTimeout:
        """A timeout, or a refusal when the handshake failed (no reply will ever come)."""
        watch = getattr(self, "_watch", None)
        reason = watch.failure() if watch is not None else None
        return RouteRefused(f"{self.url}: {reason}") if reason else RouteTimeout(message)

    def _close_watch(self) -> None:
        watch, self._watch = getattr(self, "_watch", None), None
        if watch is not None:
            watch.close()


class RouteClient(_Base):
    """Blocking client; one request at a time (use one client per thread)."""

    def __init__(self, url: str, *, ctx: zmq.Context | None = None, **kw: Any) -> None:
        super().__init__(url, **kw)
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._seq = itertools.count()
        self._tag = os.urandom(4)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            self._configure(sock)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        self._close_watch()
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
        sock = self._socket()
        corr = self._tag + next(self._seq).to_bytes(8, "big")
        timeout_ms = max(1, int(self.timeout_s * 1000))
        try:
            if not sock.poll(timeout_ms, zmq.POLLOUT):
                raise self._timeout(f"controller at {self.url} not reachable within {self.timeout_s}s")
            sock.send_multipart([corr, b"", encode(msg, json=self.json)], flags=zmq.NOBLOCK)
            while True:
                if not sock.poll(timeout_ms, zmq.POLLIN):
                    raise self._timeout(f"no reply from {self.url} within {self.timeout_s}s")
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


class AsyncRouteClient(_Base):
    """asyncio client; concurrent calls share one socket, replies matched by correlation frame."""

    def __init__(self, url: str, *, ctx: zmq.asyncio.Context | None = None, **kw: Any) -> None:
        super().__init__(url, **kw)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[bytes, asyncio.Future[Any]] = {}
        self._seq = itertools.count()
        self._tag = os.urandom(4)
        self.late_replies = 0

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            self._configure(sock)
            self._sock = sock
            self._reader = asyncio.get_running_loop().create_task(self._read(sock))
        return self._sock

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) != 3 or frames[1] != b"":
                continue
            fut = self._pending.pop(frames[0], None)
            if fut is None or fut.done():
                self.late_replies += 1  # answer to a request that already timed out
                continue
            try:
                fut.set_result(_decode(frames[2]))
            except RouteError as exc:
                fut.set_exception(exc)

    async def _call(self, msg: msgspec.Struct) -> Any:
        sock = self._socket()
        corr = self._tag + next(self._seq).to_bytes(8, "big")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[corr] = fut
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            await asyncio.wait_for(sock.send_multipart([corr, b"", encode(msg, json=self.json)]), self.timeout_s)
            return await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            self._pending.pop(corr, None)
            error = self._timeout(f"no reply from {self.url} within {self.timeout_s}s")
            if not self._pending:
                # Nothing else in flight: drop the socket so anything still queued for the
                # controller is discarded rather than delivered late.
                await self._reset()
            raise error from None
        except zmq.ZMQError as exc:
            self._pending.pop(corr, None)
            raise RouteError("transport", str(exc)) from exc

    async def _reset(self) -> None:
        reader, self._reader = self._reader, None
        sock, self._sock = self._sock, None
        self._close_watch()
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        if sock is not None:
            sock.close(linger=0)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(RouteError("transport", "client closed"))
        self._pending.clear()

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
