"""ZMQ CURVE for the route socket: key checks, a ZAP client allow-list, handshake diagnosis.

CURVE alone only encrypts: without a ZAP handler libzmq accepts any client keypair. The server
therefore runs a ZAP handler (pyzmq's ``zmq.auth``) that admits only the listed client public
keys, on a ZMQ context of its own so that no other socket of the process goes through it.
A refused client's libzmq receives an ERROR command; :func:`handshake_failure` reads it from a
socket monitor so the client can say "refused" instead of timing out without a reason.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable

import zmq
import zmq.auth
import zmq.auth.thread
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

#: The allow-list entry that accepts any client key (encryption without authentication).
ANY_CLIENT = "*"


def check_key(key: str, what: str) -> bytes:
    """A Z85 CURVE key (40 characters, 32 bytes) as bytes; ValueError naming ``what`` otherwise."""
    if not isinstance(key, str) or len(key) != 40:
        raise ValueError(f"{what}: a CURVE key is 40 Z85 characters, got {len(key) if isinstance(key, str) else key!r}")
    try:
        z85.decode(key.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError) as exc:
        raise ValueError(f"{what}: not a Z85 key ({exc})") from None
    return key.encode("ascii")


def check_keypair(secret_key: str | None, public_key: str | None) -> None:
    """Both keys present, valid, and the public key the secret key's own."""
    if not secret_key or not public_key:
        raise ValueError("CURVE needs both server.curve_secret_key and server.curve_public_key")
    secret = check_key(secret_key, "curve_secret_key")
    check_key(public_key, "curve_public_key")
    if zmq.curve_public(secret).decode() != public_key:
        raise ValueError("curve_public_key is not the public key of curve_secret_key")


def check_client_keys(keys: Iterable[str]) -> list[str]:
    out = []
    for i, key in enumerate(keys):
        if key != ANY_CLIENT:
            check_key(key, f"curve_client_keys[{i}]")
        out.append(key)
    return out


class _AllowList:
    """pyzmq credentials provider: the client's Z85 public key must be listed."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = frozenset(k.encode("ascii") for k in keys)
        self.refused = 0
        self.allowed = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            self.allowed += 1
            return True
        self.refused += 1
        log.warning("route service: CURVE client refused (key not in server.curve_client_keys) key=%s",
                    key.decode("ascii", "replace"))
        return False


class ZapAllowList:
    """A ZAP handler thread admitting only ``client_keys`` on every CURVE server socket of ``ctx``."""

    def __init__(self, ctx: zmq.Context, client_keys: Iterable[str]) -> None:
        keys = check_client_keys(client_keys)
        self._auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
        self._provider: _AllowList | None = None
        self._auth.start()
        if ANY_CLIENT in keys:
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            self._provider = _AllowList(keys)
            self._auth.configure_curve_callback(domain="*", credentials_provider=self._provider)

    @property
    def counts(self) -> dict[str, int]:
        p = self._provider
        return {"curve_refused": p.refused if p else 0, "curve_allowed": p.allowed if p else 0}

    def stop(self) -> None:
        self._auth.stop()


_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the server refused this client's CURVE key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed (is CURVE on at both ends, with the server's public key?)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "security handshake failed (CURVE on one end only, or a wrong server key)",
}
MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def handshake_failure(monitor: zmq.Socket) -> str | None:
    """Why the monitored socket's handshakes failed, if they did (reads queued monitor events)."""
    reason = None
    while monitor.poll(0):
        try:
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
        except zmq.ZMQError:
            break
        reason = _FAILED.get(event["event"], reason)
    return reason


_watch_ids = itertools.count()


class HandshakeWatch:
    """Watches a client socket's security handshakes so a timeout can name a refusal.

    The monitor socket is a blocking one on the same underlying context, so it works for
    asyncio sockets too and is only read when a request has already timed out.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        # A fresh name each time: a closed monitor's inproc name may still be bound for a moment,
        # and id(self) comes back as soon as the previous watch is freed.
        addr = f"inproc://smetric-handshake-{next(_watch_ids)}"
        sock.monitor(addr, MONITOR_EVENTS)
        self._sock = sock
        self._monitor = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self._monitor.linger = 0
        self._monitor.connect(addr)

    def failure(self) -> str | None:
        return handshake_failure(self._monitor)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
