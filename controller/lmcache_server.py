"""Worker-facing LMCache 0.5.x controller endpoint.

Unmodified LMCache workers are pointed at this server (``controller_pull_url`` /
``controller_reply_url``). It answers them the way LMCache's own ``LMCacheControllerManager``
does (registration, heartbeats with full-sync commands, full-sync handshake, P2P lookup, error
replies) and turns their admit / evict / full-sync reports into calls on an index sink, keyed by
our instance ids.

Optional upstream: every valid worker message is also forwarded, as the raw bytes received, to a
real LMCache controller (PUSH to its pull port; one DEALER per worker to its reply port, which
handles heartbeats too), so LMCache's management API keeps working. The worker always receives
OUR reply, immediately and whether or not the upstream is up; the upstream's replies are consumed
here and only its heartbeat commands matter: a ``FullSyncCommand`` it asks for (e.g. after the
upstream restarted) is added to that worker's next heartbeat reply, so both controllers rebuild
from the same full sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket as _socket
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from smetric_lmc.controller import lmcache_proto as P
from smetric_lmc.controller import offload
from smetric_lmc.controller.lmcache_kvops import KVOps
from smetric_lmc.controller.lmcache_registry import (
    LMCacheSink,
    Worker,
    WorkerInfo,
    WorkerRegistry,
    identity_resolver,
)
from smetric_lmc.controller.lmcache_sync import MISSING_WINDOW, FullSync
from smetric_lmc.controller.lmcache_upstream import Upstream
from smetric_lmc.controller.tasks import LoopBudget

if TYPE_CHECKING:
    from smetric_lmc.controller.offload import OffloadWorker

__all__ = ["MISSING_WINDOW", "LMCacheSink", "LMCacheWorkerServer", "WorkerInfo", "identity_resolver"]

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024


#: Work each socket loop does between two yields to the other tasks on the loop.
LOOP_BUDGET = LoopBudget()
_FULL = "controller knows too many LMCache workers (limits.lmcache_max_workers)"


class LMCacheWorkerServer:
    """LMCache-protocol endpoint for workers; feeds an index sink. See module docstring.

    The sockets and the message dispatch live here; the parts it dispatches to are the worker
    registry (``lmcache_registry``), the KV reports and P2P lookup (``lmcache_kvops``) and the
    full-sync handshake (``lmcache_sync``), the way LMCache's own controller splits them.
    """

    def __init__(
        self,
        sink: LMCacheSink,
        *,
        pull_url: str = "tcp://127.0.0.1:8300",
        reply_url: str = "tcp://127.0.0.1:8400",
        heartbeat_url: str | None = None,
        upstream_pull_url: str | None = None,
        upstream_reply_url: str | None = None,
        resolve_instance: Callable[[str, int], str | None] = identity_resolver,
        heartbeat_advertise: str | None = None,
        full_sync_on_start: bool = True,
        full_sync_completion_threshold: float = 0.8,
        full_sync_timeout_s: float = 300.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_workers: int = 4096,
        max_sources_per_instance: int = 256,
        worker_timeout_s: float = 300.0,
        max_sync_batches: int = 100_000,
        upstream_timeout_s: float = 2.0,
        worker: OffloadWorker | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._sink = sink
        self._urls = {"pull": pull_url, "reply": reply_url, "heartbeat": heartbeat_url}
        self._heartbeat_advertise = heartbeat_advertise
        self._max_frame = max_frame_bytes
        self._frame_worker = worker
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._upstream = (
            Upstream(self._ctx, upstream_pull_url, upstream_reply_url, upstream_timeout_s)
            if upstream_pull_url is not None or upstream_reply_url is not None
            else None
        )
        self._socks: dict[str, zmq.asyncio.Socket] = {}
        self._endpoints: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "pull_frames", "router_frames", "heartbeat_frames", "decode_errors",
                "wrong_socket", "oversize_frames", "malformed_envelopes", "internal_errors",
                "kv_ops", "kv_ops_unresolved", "kv_ops_during_sync", "seq_gaps",
                "registers", "deregisters", "heartbeats", "unknown_heartbeats",
                "full_sync_started", "full_sync_rejected", "full_sync_completed",
                "full_sync_stray", "p2p_lookups", "legacy_single_ops",
                "send_errors", "workers_refused", "workers_expired", "sources_refused",
                "offloaded", "large_on_loop", "worker_failures",
            ),
            0,
        )
        self.registry = WorkerRegistry(sink, resolve_instance, self._stats, max_workers=max_workers,
                                       max_sources=max_sources_per_instance, worker_timeout_s=worker_timeout_s)
        self.sync = FullSync(self.registry, self._stats, on_start=full_sync_on_start,
                             completion_threshold=full_sync_completion_threshold,
                             timeout_s=full_sync_timeout_s, max_batches=max_sync_batches)
        self.kv = KVOps(sink, self.registry, self._stats, self.sync.syncing)
        self.sync.kv = self.kv
        self.registry.on_forget = self._forgotten
        self._closed = False

    # ---- lifecycle ----

    async def start(self) -> None:
        """Bind the worker-facing sockets (and connect the upstream) and start serving."""
        self._bind("pull", zmq.PULL)
        self._bind("reply", zmq.ROUTER)
        if self._urls["heartbeat"] is not None:
            self._bind("heartbeat", zmq.ROUTER)
        if self._upstream is not None:
            self._upstream.start()
        self._tasks.append(asyncio.create_task(self._pull_loop(), name="lmcache-pull"))
        self._tasks.append(asyncio.create_task(self._router_loop("reply"), name="lmcache-reply"))
        if "heartbeat" in self._socks:
            self._tasks.append(asyncio.create_task(self._router_loop("heartbeat"), name="lmcache-hb"))
        self._tasks.append(asyncio.create_task(self._sweep_loop(), name="lmcache-sweep"))
        log.info("LMCache worker endpoint up: %s", self._endpoints)

    async def close(self) -> None:
        """Stop serving and close every socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._upstream is not None:
            await self._upstream.close()
        for s in self._socks.values():
            s.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def _bind(self, name: str, kind: int) -> None:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        # libzmq drops a peer that sends a larger frame before it reaches us.
        s.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        url = self._urls[name]
        assert url is not None
        s.bind(url)
        self._socks[name] = s
        self._endpoints[name] = s.getsockopt_string(zmq.LAST_ENDPOINT)

    # ---- introspection ----

    @property
    def stats(self) -> dict[str, int]:
        """Counters (frames, errors, drops, ops, upstream traffic); a copy."""
        out = dict(self._stats)
        if self._upstream is not None:
            out.update(self._upstream.stats)
        return out

    @property
    def endpoints(self) -> dict[str, str]:
        """Actually bound endpoints by socket name ("pull", "reply", "heartbeat")."""
        return dict(self._endpoints)

    def workers(self) -> list[WorkerInfo]:
        """Known workers, in first-seen order."""
        return [
            WorkerInfo(
                lmcache_instance_id=w.lmc_id, worker_id=w.worker_id, instance_id=w.instance_id,
                ip=w.ip, port=w.port, peer_init_url=w.peer_init_url, registered=w.registered,
                registered_at=w.registered_at, last_seen=w.last_seen, last_heartbeat=w.last_heartbeat,
                sync_state=self.sync.state(w),
            )
            for w in self.registry.workers.values()
        ]

    def sweep(self) -> int:
        """Forget workers silent for ``worker_timeout_s``; returns how many."""
        return self.registry.sweep()

    # ---- socket loops ----

    async def _receive(self, name: str, label: str) -> AsyncIterator[list[bytes]]:
        """Messages from socket ``name`` until the server closes; receive errors are logged and skipped."""
        sock = self._socks[name]
        # A queued message is returned without a trip through the event loop: a backlog would
        # otherwise hold the loop (and every other socket) until it is drained.
        meter = LOOP_BUDGET.meter()
        nbytes = 0
        while True:
            if meter.spend(nbytes):  # no coroutine per message: this runs for every one
                await asyncio.sleep(0)
                meter.reset()
            nbytes = 0
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError as exc:
                if self._closed:
                    return
                log.warning("%s receive failed: %s", label, exc)
                continue
            nbytes = sum(map(len, frames))
            yield frames

    async def _pull_loop(self) -> None:
        async for frames in self._receive("pull", "PULL"):
            sender: tuple[str, int] | None = None
            for frame in frames:
                self._stats["pull_frames"] += 1
                try:
                    decoded = await self._decode_push(frame)
                    key = None if decoded is None else self._on_push_msg(*decoded)
                    while self.kv.pending:
                        await asyncio.sleep(0)
                        self.kv.apply_next_slice()
                except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                    raise
                except Exception:
                    key = None
                    self.kv.drop_pending()
                    self._stats["internal_errors"] += 1
                    log.exception("error handling a PULL frame")
                sender = sender or key
            if self._upstream is not None:
                self._upstream.forward_push(frames, sender)

    async def _router_loop(self, name: str) -> None:
        sock = self._socks[name]
        heartbeat_only = name == "heartbeat"
        async for frames in self._receive(name, name):
            self._stats[f"{name if heartbeat_only else 'router'}_frames"] += 1
            if len(frames) < 2:
                # A ROUTER always prepends the identity; fewer frames cannot be answered.
                self._stats["malformed_envelopes"] += 1
                continue
            envelope, payload = frames[:-1], frames[-1]
            try:
                reply = self._on_request_frame(payload, heartbeat_only)
            except Exception as exc:
                self._stats["internal_errors"] += 1
                log.exception("error handling a %s request", name)
                reply = P.ErrorMsg(error=f"internal error: {type(exc).__name__}")
            try:
                await sock.send_multipart([*envelope, P.encode(reply)])
            except zmq.ZMQError as exc:
                self._stats["send_errors"] += 1
                log.warning("%s reply failed: %s", name, exc)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.registry.worker_timeout_s / 4, 30.0))
            try:
                self.registry.sweep()
            except Exception:
                self._stats["internal_errors"] += 1
                log.exception("LMCache worker sweep failed")

    # ---- frame dispatch ----

    def _decode(self, frame: bytes) -> P.AnyMsg:
        if len(frame) > self._max_frame:
            self._stats["oversize_frames"] += 1
            raise P.ProtocolError(f"frame of {len(frame)} bytes exceeds {self._max_frame}")
        try:
            return P.decode(frame)
        except P.ProtocolError:
            self._stats["decode_errors"] += 1
            raise

    async def _decode_push(self, frame: bytes) -> tuple[P.AnyMsg, P.Bulk | None] | None:
        """One PULL frame decoded, its bulk list split off; None when it is refused (counted).
        Frames over ``offload.OFFLOAD_BYTES`` are decoded in the frame worker (cost linear in size)."""
        if len(frame) <= offload.OFFLOAD_BYTES or len(frame) > self._max_frame:
            pass
        elif self._frame_worker is not None and self._frame_worker.start():
            try:
                out = await self._frame_worker.submit(P.decode_split, frame)
            except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                raise
            except Exception as exc:  # the worker died with it: that frame is lost, never retried here
                self._stats["worker_failures"] += 1
                log.error("LMCache PULL: frame worker failed (%s); frame dropped", exc)
                return None
            self._stats["offloaded"] += 1
            if isinstance(out, str):
                self._stats["decode_errors"] += 1
                log.debug("dropping undecodable PULL frame: %s", out)
                return None
            return out
        else:
            self._stats["large_on_loop"] += 1  # no worker here (its start failure is logged once)
        return self._decode_here(frame)

    def _decode_here(self, frame: bytes) -> tuple[P.AnyMsg, P.Bulk | None] | None:
        try:
            return P.split_bulk(self._decode(frame))
        except P.ProtocolError as exc:
            log.debug("dropping undecodable PULL frame: %s", exc)
            return None

    def _on_push_frame(self, frame: bytes) -> tuple[str, int] | None:
        """Decode and apply one PULL frame on the loop (the first slice of a bulk list: the rest
        stays pending in ``kv``)."""
        decoded = self._decode_here(frame)
        return None if decoded is None else self._on_push_msg(*decoded)

    def _on_push_msg(self, msg: P.AnyMsg, bulk: P.Bulk | None) -> tuple[str, int] | None:
        """Apply one PULL message; return the (instance, worker) it came from, if valid."""
        if isinstance(msg, P.BatchedKVOperationMsg):
            assert bulk is not None
            # The first slice now; the PULL loop yields before each further one.
            self.kv.queue(msg.instance_id, msg.worker_id, msg.location, bulk, sync=False)
        elif isinstance(msg, P.FullSyncBatchMsg):
            assert bulk is not None
            self.sync.on_batch(msg, bulk)
        elif isinstance(msg, P.FullSyncEndMsg):
            self.sync.on_end(msg)
        elif isinstance(msg, P.DeRegisterMsg):
            self._stats["deregisters"] += 1
            self.registry.forget((msg.instance_id, msg.worker_id))
        elif isinstance(msg, (P.KVAdmitMsg, P.KVEvictMsg)):
            # No longer sent by 0.5.x workers (LMCache's controller ignores them); applying them
            # costs nothing and keeps older workers useful.
            self._stats["legacy_single_ops"] += 1
            self.kv.on_ops(msg.instance_id, msg.worker_id, msg.location,
                           [(isinstance(msg, P.KVAdmitMsg), msg.key, msg.seq_num)])
        else:
            self._stats["wrong_socket"] += 1
            log.debug("dropping %s received on PULL", type(msg).__name__)
            return None
        return msg.instance_id, msg.worker_id

    def _on_request_frame(self, frame: bytes, heartbeat_only: bool) -> P.ReplyMsg:
        try:
            msg = self._decode(frame)
        except P.ProtocolError as exc:
            if heartbeat_only and exc.lmcache_type is not None:
                return P.ErrorMsg(error=_expected_heartbeat(exc.lmcache_type))
            return P.ErrorMsg(error=str(exc))
        if heartbeat_only and not isinstance(msg, P.HeartbeatMsg):
            self._stats["wrong_socket"] += 1
            return P.ErrorMsg(error=_expected_heartbeat(type(msg).__name__))
        if not isinstance(msg, P.WORKER_REQ_TYPES):
            self._stats["wrong_socket"] += 1
            return P.ErrorMsg(error=P.unknown_type_error(msg))
        if self._upstream is not None:
            self._upstream.forward_request((msg.instance_id, msg.worker_id), frame)
        if isinstance(msg, P.HeartbeatMsg):
            return self._on_heartbeat(msg)
        if isinstance(msg, P.RegisterMsg):
            return self._on_register(msg)
        if isinstance(msg, P.FullSyncStartMsg):
            return self.sync.on_start(msg)
        if isinstance(msg, P.FullSyncStatusMsg):
            return self.sync.on_status(msg)
        return self.kv.p2p_lookup(msg)

    # ---- registration and heartbeats ----

    def _forgotten(self, w: Worker) -> None:
        self.kv.clear_sources(w, None)
        if self._upstream is not None:
            self._upstream.drop_worker(w.key)

    def _on_register(self, msg: P.RegisterMsg) -> P.RegisterRetMsg | P.ErrorMsg:
        self._stats["registers"] += 1
        w = self.registry.get(msg.instance_id, msg.worker_id)
        if w is None:
            return P.ErrorMsg(error=_FULL)
        # A RegisterMsg comes from a (re)started worker: whatever it reported before is gone.
        w.set_addr(msg.ip, msg.port, msg.peer_init_url)
        w.sync = None
        w.seq.clear()
        self.kv.clear_sources(w, None)
        extra: dict[str, str] = {}
        hb = self._advertised_heartbeat(msg.ip)
        if hb is not None:
            extra["heartbeat_url"] = hb
        return P.RegisterRetMsg(extra_config=extra)

    def _on_heartbeat(self, msg: P.HeartbeatMsg) -> P.HeartbeatRetMsg | P.ErrorMsg:
        self._stats["heartbeats"] += 1
        w = self.registry.get(msg.instance_id, msg.worker_id)
        if w is None:
            return P.ErrorMsg(error=_FULL)
        w.last_heartbeat = time.time()
        commands: list[P.HeartbeatCommand] = []
        if not w.registered:
            # Unknown to us (e.g. we restarted): register it and ask for everything it holds.
            # What it PUSHed meanwhile stays applied until its full sync replaces it.
            self._stats["unknown_heartbeats"] += 1
            w.set_addr(msg.ip, msg.port, msg.peer_init_url)
            commands.append(P.FullSyncCommand(reason="worker_re_registered"))
        else:
            cmd = self.sync.command_for(w)
            if cmd is not None:
                commands.append(cmd)
        if self._upstream is not None:
            wanted = self._upstream.take_commands((msg.instance_id, msg.worker_id))
            if not any(isinstance(c, P.FullSyncCommand) for c in commands):
                commands.extend(wanted)
        return P.HeartbeatRetMsg(commands=commands)

    def _advertised_heartbeat(self, worker_ip: str) -> str | None:
        if self._heartbeat_advertise is not None:
            return self._heartbeat_advertise
        ep = self._endpoints.get("heartbeat")
        if ep is None:
            return None
        # LMCache workers prepend "tcp://" themselves, so the URL is "host:port".
        hostport = ep.split("://", 1)[-1]
        host, _, port = hostport.rpartition(":")
        if host in ("0.0.0.0", "*", "", "[::]"):
            try:
                own = _socket.gethostbyname(_socket.gethostname())
            except OSError:
                own = "127.0.0.1"
            host = "127.0.0.1" if worker_ip == own else own
        return f"{host}:{port}"


def _expected_heartbeat(name: str) -> str:
    return f"Expected HeartbeatMsg, got <class '{P.LMCACHE_MESSAGE_MODULE}.{name}'>"
