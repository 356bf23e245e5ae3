"""Load shared between controller replicas: every replica counts every replica's in-flight requests.

Each replica follows the same engines' KV events, so their indexes agree; their in-flight load
would not (each sees only the requests routed through it, and N replicas would each send a burst
to the instance that looks least loaded). :class:`LoadShare` publishes the route service's load
changes on a PUB socket and applies the other replicas' changes from a SUB socket connected to
each of them:

- ``r``: request routed to an instance, with its prompt and hit tokens (``LoadTracker.on_route``);
- ``d``: done reported (``on_done``), published whether or not this replica knew the request, so
  a done sent to another replica than the one that routed it releases it everywhere;
- ``p``: prefilled reported (``on_prefilled``).

Changes made in one event-loop turn go out as one message (``[replica_id, seq, ops]``, msgpack).
A replica's view of another's load lags by the time the message takes: ``bench/replicas.py`` measures the divergence. A done that overtakes its route
(reported at replica B before A's route reached B) is remembered for a while
(``EARLY_DONE_KEEP``) and cancels the route when it arrives. A message from a replica that
restarted (its sequence went back) or was lost (PUB drops nothing short of its high-water mark,
but a replica that joins late missed earlier routes) is healed like any lost done report: the
engines' /metrics reconciliation and ``lost_done_grace_s`` expiry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from smetric_lmc.load import LoadTracker
from smetric_lmc.wire import RouteDecision

log = logging.getLogger(__name__)

#: Done reports for requests this replica has not seen routed, kept to cancel a late route.
EARLY_DONE_KEEP = 65_536
#: Largest share message accepted from a peer (a turn's worth of routes is far smaller).
MAX_SHARE_BYTES = 16 << 20

_Op = tuple[Any, ...]
_decoder = msgspec.msgpack.Decoder(tuple[str, int, list[list[Any]]])


class LoadShare:
    """Publishes this replica's load changes and applies its peers' (see the module docstring)."""

    def __init__(
        self,
        load: LoadTracker,
        replica_id: str,
        pub_url: str,
        peers: Sequence[str],
        *,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.load = load
        # Unique among the peers: a replica ignores messages carrying its own id.
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.pub_url = pub_url
        self.peers = list(peers)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._out: list[_Op] = []
        self._flush_scheduled = False
        self._seq = 0
        self._early_done: OrderedDict[str, None] = OrderedDict()
        self.endpoint: str | None = None
        self.stats = {"published_ops": 0, "messages_out": 0, "messages_in": 0, "applied_ops": 0,
                      "bad_messages": 0, "late_routes_cancelled": 0, "send_errors": 0}

    # ---- hooks the route core calls --------------------------------------------------------------
    def routed(self, request_id: str, instance_id: str, prompt_tokens: int, decision: RouteDecision) -> None:
        hit = max(decision.local_hit_tokens, decision.global_hit_tokens)
        self._emit(("r", request_id, instance_id, prompt_tokens, hit))

    def done(self, request_id: str) -> None:
        self._emit(("d", request_id))

    def prefilled(self, request_id: str) -> None:
        self._emit(("p", request_id))

    def attach(self, core: Any) -> None:
        """Install the hooks on a ``RouteCore``."""
        core.on_routed = self.routed
        core.on_done_report = self.done
        core.on_prefilled_report = self.prefilled

    def _emit(self, op: _Op) -> None:
        self._out.append(op)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what this turn changed as one message."""
        self._flush_scheduled = False
        if not self._out or self._pub is None:
            self._out.clear()
            return
        ops, self._out = self._out, []
        self._seq += 1
        try:
            self._pub.send(msgspec.msgpack.encode((self.replica_id, self._seq, ops)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # PUB drops at its high-water mark rather than block
            self.stats["send_errors"] += 1
            log.warning("load share: publish failed error=%s ops=%d", exc, len(ops))
            return
        self.stats["messages_out"] += 1
        self.stats["published_ops"] += len(ops)

    # ---- sockets ---------------------------------------------------------------------------------
    def bind(self) -> str:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.pub_url)
        self._pub = pub
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_SHARE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for url in self.peers:
            sub.connect(url)
        self._sub = sub
        log.info("load share: replica=%s publishing on %s, following %d peers", self.replica_id,
                 self.endpoint, len(self.peers))
        return self.endpoint

    def connect(self, url: str) -> None:
        """Follow one more peer (tests and benches bind on ``*`` ports and learn them after)."""
        assert self._sub is not None
        self.peers.append(url)
        self._sub.connect(url)

    async def run(self) -> None:
        if self._sub is None:
            self.bind()
        sub = self._sub
        assert sub is not None
        while True:
            frame = await sub.recv()
            self.apply(frame)

    def apply(self, frame: bytes) -> int:
        """Apply one peer message; returns the ops applied (0 for a bad or own message)."""
        try:
            replica, _seq, ops = _decoder.decode(frame)
        except (msgspec.DecodeError, RecursionError):
            self.stats["bad_messages"] += 1
            return 0
        if replica == self.replica_id:
            return 0
        self.stats["messages_in"] += 1
        n = 0
        for op in ops:
            try:
                n += self._apply_op(op)
            except (TypeError, ValueError, IndexError):
                self.stats["bad_messages"] += 1
        self.stats["applied_ops"] += n
        return n

    def _apply_op(self, op: list[Any]) -> int:
        kind, rid = op[0], op[1]
        if not isinstance(rid, str):
            raise TypeError("request id")
        if kind == "r":
            iid, prompt, hit = op[2], op[3], op[4]
            if not isinstance(iid, str) or not isinstance(prompt, int) or not isinstance(hit, int):
                raise TypeError("route op")
            if self._early_done.pop(rid, False) is None:
                self.stats["late_routes_cancelled"] += 1
                return 1
            self.load.on_route(rid, iid, prompt, hit)
        elif kind == "d":
            if not self.load.on_done(rid):
                self._early_done[rid] = None
                if len(self._early_done) > EARLY_DONE_KEEP:
                    self._early_done.popitem(last=False)
        elif kind == "p":
            self.load.on_prefilled(rid)
        else:
            raise ValueError(kind)
        return 1

    async def close(self) -> None:
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = None
