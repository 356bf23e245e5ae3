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
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import zmq
import zmq.asyncio

from smetric_lmc.controller import lmcache_proto as P
from smetric_lmc.controller.lmcache_holdings import Holdings, SlotsExhausted
from smetric_lmc.controller.lmcache_upstream import Upstream

if TYPE_CHECKING:
    from smetric_lmc.controller.offload import OffloadWorker

__all__ = ["LMCacheSink", "LMCacheWorkerServer", "WorkerInfo", "identity_resolver"]

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024


class LMCacheSink(Protocol):
    """Index-side receiver of LMCache local-tier reports, keyed by our instance id."""

    def lmcache_admit(self, instance_id: str, chunk_hashes: Iterable[int]) -> None: ...

    def lmcache_evict(self, instance_id: str, chunk_hashes: Iterable[int]) -> None: ...

    def lmcache_cleared(self, instance_id: str) -> None: ...

    def lmcache_worker_seen(self, instance_id: str) -> None: ...


def identity_resolver(lmcache_instance_id: str, worker_id: int) -> str | None:
    """Default mapping: LMCache's ``lmcache_instance_id`` is our instance id, for every rank."""
    return lmcache_instance_id


@dataclass(frozen=True)
class WorkerInfo:
    """Snapshot of one LMCache worker as this server knows it."""

    lmcache_instance_id: str
    worker_id: int
    instance_id: str | None
    ip: str
    port: int
    peer_init_url: str | None
    registered: bool
    registered_at: float
    last_seen: float
    last_heartbeat: float | None
    sync_state: str | None


_SYNCING, _COMPLETED, _FAILED = "syncing", "completed", "failed"
#: Messages handled per socket before yielding to the other tasks on the loop.
#: Operations of one KV-op batch applied between two yields to the loop (~6 ms here).
OPS_SLICE = 4096
YIELD_EVERY = 64
#: ... or after this many bytes or seconds of messages since the last yield.
YIELD_BYTES = 1 << 20
YIELD_S = 0.002
#: PULL frames larger than this are decoded in the frame worker (``worker``), not on the loop.
OFFLOAD_BYTES = 256 << 10
#: Missing full-sync batches reported per status reply (the worker resends them and asks again).
MISSING_WINDOW = 4096
_FULL = "controller knows too many LMCache workers (limits.lmcache_max_workers)"


class _Rest(NamedTuple):
    """A PULL message's bulk list, applied ``OPS_SLICE`` entries at a time from ``start``."""

    lmc_id: str
    worker_id: int
    location: str
    bulk: P.Bulk
    start: int
    sync: bool  # full-sync keys (all admits), else KV operations


def _plain(values: Any) -> list[Any]:
    """A column slice as a list of Python scalars (numpy's would end up in the index's tables)."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


@dataclass
class _Sync:
    sync_id: str
    location: str
    expected_batches: int
    state: str = _SYNCING
    batches: set[int] = field(default_factory=set)
    first_missing: int = 0  # every batch below it arrived
    keys_received: int = 0
    last_activity: float = field(default_factory=time.monotonic)


@dataclass
class _Worker:
    lmc_id: str
    worker_id: int
    ip: str = ""
    port: int = 0
    peer_init_url: str | None = None
    instance_id: str | None = None
    # False while the worker is known only from PUSHed reports (e.g. after our restart, before
    # its next heartbeat re-registers it).
    registered: bool = False
    registered_at: float = 0.0
    last_seen: float = 0.0
    last_heartbeat: float | None = None
    sync: _Sync | None = None
    seq: dict[str, int] = field(default_factory=dict)


class LMCacheWorkerServer:
    """LMCache-protocol endpoint for workers; feeds an index sink. See module docstring."""

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
        self._resolve = resolve_instance
        self._heartbeat_advertise = heartbeat_advertise
        # Like LMCache's controller: right after start nothing is known about workers' caches,
        # so registered workers are asked for a full sync until enough of them completed one.
        self._need_full_sync_all = full_sync_on_start
        self._threshold = full_sync_completion_threshold
        self._sync_timeout = full_sync_timeout_s
        self._max_frame = max_frame_bytes
        self._max_workers = max_workers
        self._max_sources = max_sources_per_instance
        self._worker_timeout = worker_timeout_s
        self._max_sync_batches = max_sync_batches
        self._frame_worker = worker
        self._last_sweep = 0.0
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
        self._workers: dict[tuple[str, int], _Worker] = {}
        self._counts: dict[str | None, int] = {}  # workers per instance id (None: unmapped)
        self._holdings: dict[str, Holdings] = {}
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
        self._closed = False
        self._rest: _Rest | None = None  # a batch applied a slice at a time

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
                lmcache_instance_id=w.lmc_id,
                worker_id=w.worker_id,
                instance_id=w.instance_id,
                ip=w.ip,
                port=w.port,
                peer_init_url=w.peer_init_url,
                registered=w.registered,
                registered_at=w.registered_at,
                last_seen=w.last_seen,
                last_heartbeat=w.last_heartbeat,
                sync_state=self._sync_state(w),
            )
            for w in self._workers.values()
        ]

    # ---- socket loops ----

    async def _receive(self, name: str, label: str) -> AsyncIterator[list[bytes]]:
        """Messages from socket ``name`` until the server closes; receive errors are logged and skipped."""
        sock = self._socks[name]
        n, nbytes, since = 0, 0, time.perf_counter()
        while True:
            n += 1
            if n % YIELD_EVERY == 0 or nbytes >= YIELD_BYTES or time.perf_counter() - since >= YIELD_S:
                # A queued message is returned without a trip through the event loop: a backlog
                # would otherwise hold the loop (and every other socket) until it is drained. A
                # count alone let 64 MB-sized messages through in one go.
                await asyncio.sleep(0)
                n, nbytes, since = 0, 0, time.perf_counter()
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError as exc:
                if self._closed:
                    return
                log.warning("%s receive failed: %s", label, exc)
                continue
            nbytes += sum(map(len, frames))
            yield frames

    async def _pull_loop(self) -> None:
        async for frames in self._receive("pull", "PULL"):
            sender: tuple[str, int] | None = None
            for frame in frames:
                self._stats["pull_frames"] += 1
                try:
                    decoded = await self._decode_push(frame)
                    key = None if decoded is None else self._on_push_msg(*decoded)
                    while self._rest is not None:
                        await asyncio.sleep(0)
                        self._apply_rest()
                except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                    raise
                except Exception:
                    key = None
                    self._rest = None
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
        Frames over ``OFFLOAD_BYTES`` are decoded in the frame worker: a 16 MiB one costs ~60 ms."""
        if len(frame) <= OFFLOAD_BYTES or len(frame) > self._max_frame:
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
        stays in ``_rest``)."""
        decoded = self._decode_here(frame)
        return None if decoded is None else self._on_push_msg(*decoded)

    def _on_push_msg(self, msg: P.AnyMsg, bulk: P.Bulk | None) -> tuple[str, int] | None:
        """Apply one PULL message; return the (instance, worker) it came from, if valid."""
        if isinstance(msg, P.BatchedKVOperationMsg):
            assert bulk is not None
            self._rest = _Rest(msg.instance_id, msg.worker_id, msg.location, bulk, 0, sync=False)
            self._apply_rest()  # the first slice now; the PULL loop yields before each further one
        elif isinstance(msg, P.FullSyncBatchMsg):
            assert bulk is not None
            self._on_sync_batch(msg, bulk)
        elif isinstance(msg, P.FullSyncEndMsg):
            self._on_sync_end(msg)
        elif isinstance(msg, P.DeRegisterMsg):
            self._on_deregister(msg)
        elif isinstance(msg, (P.KVAdmitMsg, P.KVEvictMsg)):
            # No longer sent by 0.5.x workers (LMCache's controller ignores them); applying them
            # costs nothing and keeps older workers useful.
            self._stats["legacy_single_ops"] += 1
            self._on_kv_ops(msg.instance_id, msg.worker_id, msg.location,
                            [(isinstance(msg, P.KVAdmitMsg), msg.key, msg.seq_num)])
        else:
            self._stats["wrong_socket"] += 1
            log.debug("dropping %s received on PULL", type(msg).__name__)
            return None
        return msg.instance_id, msg.worker_id

    def _apply_rest(self) -> bool:
        """Apply the next ``OPS_SLICE`` operations (or full-sync keys) in ``_rest``; True while
        more are left (a 90 k-op batch costs ~150 ms at once). Each slice of operations goes
        through ``_on_kv_ops`` again, so a full sync that started meanwhile takes over, as it would
        between batches; a full-sync batch stops when its worker is gone."""
        assert self._rest is not None
        r = self._rest
        end = min(r.start + OPS_SLICE, len(r.bulk.keys))
        self._rest = r._replace(start=end) if end < len(r.bulk.keys) else None
        keys = _plain(r.bulk.keys[r.start:end])
        if not r.sync:
            admits, seqs = _plain(r.bulk.admits[r.start:end]), _plain(r.bulk.seqs[r.start:end])
            self._on_kv_ops(r.lmc_id, r.worker_id, r.location, list(zip(admits, keys, seqs, strict=True)))
        else:
            w = self._workers.get((r.lmc_id, r.worker_id))
            if w is None or w.instance_id is None:
                self._rest = None
                return False
            self._apply(w, r.location, [(True, k) for k in keys])
        return self._rest is not None

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
            return self._on_sync_start(msg)
        if isinstance(msg, P.FullSyncStatusMsg):
            return self._on_sync_status(msg)
        return self._on_p2p_lookup(msg)

    # ---- worker registry ----

    def _worker(self, lmc_id: str, worker_id: int, *, create: bool = True) -> _Worker | None:
        """The known worker (created if ``create``); None when unknown or its share is full.

        Workers of a configured instance are capped per instance, unmapped ones (ids nothing
        resolves) all together, so ghosts cannot lock out the real workers.
        """
        key = (lmc_id, worker_id)
        w = self._workers.get(key)
        if w is None and create:
            iid = self._resolve_id(lmc_id, worker_id)
            cap = self._max_workers if iid is None else self._max_sources
            if self._counts.get(iid, 0) >= cap and time.monotonic() - self._last_sweep >= 1.0:
                self.sweep()  # full: forget the silent ones (at most once a second, O(workers))
            if self._counts.get(iid, 0) >= cap:
                self._stats["workers_refused"] += 1
                log.debug("LMCache worker %s/%s refused: %d known for instance %s", lmc_id, worker_id,
                          self._counts.get(iid, 0), iid)
                return None
            w = self._workers[key] = _Worker(lmc_id=lmc_id, worker_id=worker_id, instance_id=iid)
            self._counts[iid] = self._counts.get(iid, 0) + 1
        if w is not None:
            w.last_seen = time.time()
            if w.instance_id is not None:
                self._sink.lmcache_worker_seen(w.instance_id)
        return w

    def _resolve_id(self, lmc_id: str, worker_id: int) -> str | None:
        try:
            return self._resolve(lmc_id, worker_id)
        except Exception:
            self._stats["internal_errors"] += 1
            log.exception("resolve_instance(%r, %r) failed", lmc_id, worker_id)
            return None

    def _forget(self, key: tuple[str, int]) -> _Worker | None:
        w = self._workers.pop(key, None)
        if w is not None:
            self._counts[w.instance_id] -= 1
            self._clear_sources(w, None)
            if self._upstream is not None:
                self._upstream.drop_worker(key)
        return w

    def _set_addr(self, w: _Worker, msg: P.RegisterMsg | P.HeartbeatMsg) -> None:
        w.ip, w.port, w.peer_init_url = msg.ip, msg.port, msg.peer_init_url
        w.registered = True
        w.registered_at = time.time()

    def _on_register(self, msg: P.RegisterMsg) -> P.RegisterRetMsg | P.ErrorMsg:
        self._stats["registers"] += 1
        w = self._worker(msg.instance_id, msg.worker_id)
        if w is None:
            return P.ErrorMsg(error=_FULL)
        # A RegisterMsg comes from a (re)started worker: whatever it reported before is gone.
        self._set_addr(w, msg)
        w.sync = None
        w.seq.clear()
        self._clear_sources(w, None)
        extra: dict[str, str] = {}
        hb = self._advertised_heartbeat(msg.ip)
        if hb is not None:
            extra["heartbeat_url"] = hb
        return P.RegisterRetMsg(extra_config=extra)

    def _on_deregister(self, msg: P.DeRegisterMsg) -> None:
        self._stats["deregisters"] += 1
        self._forget((msg.instance_id, msg.worker_id))

    def _on_heartbeat(self, msg: P.HeartbeatMsg) -> P.HeartbeatRetMsg | P.ErrorMsg:
        self._stats["heartbeats"] += 1
        w = self._worker(msg.instance_id, msg.worker_id)
        if w is None:
            return P.ErrorMsg(error=_FULL)
        w.last_heartbeat = time.time()
        commands: list[P.HeartbeatCommand] = []
        if not w.registered:
            # Unknown to us (e.g. we restarted): register it and ask for everything it holds.
            # What it PUSHed meanwhile stays applied until its full sync replaces it.
            self._stats["unknown_heartbeats"] += 1
            self._set_addr(w, msg)
            commands.append(P.FullSyncCommand(reason="worker_re_registered"))
        else:
            state = self._sync_state(w)
            if self._need_full_sync_all and state not in (_SYNCING, _COMPLETED):
                commands.append(P.FullSyncCommand(reason="controller_restart"))
            elif state == _FAILED:
                commands.append(P.FullSyncCommand(reason="sync_failed_retry"))
        if self._upstream is not None:
            wanted = self._upstream.take_commands((msg.instance_id, msg.worker_id))
            if not any(isinstance(c, P.FullSyncCommand) for c in commands):
                commands.extend(wanted)
        return P.HeartbeatRetMsg(commands=commands)

    def _expired(self, w: _Worker, cutoff: float) -> bool:
        # Workers mapped to an instance stay while heartbeats are off (LMCache's default):
        # silence then says nothing, and their sources are bounded per instance anyway.
        if w.last_seen >= cutoff:
            return False
        return w.instance_id is None or w.last_heartbeat is not None

    def sweep(self) -> int:
        """Forget workers silent for ``worker_timeout_s`` (see ``_expired``); returns how many."""
        self._last_sweep = time.monotonic()
        cutoff = time.time() - self._worker_timeout
        gone = [w for w in self._workers.values() if self._expired(w, cutoff)]
        for w in gone:
            self._forget((w.lmc_id, w.worker_id))
            log.info("LMCache worker %s/%d silent for %.0fs: forgotten", w.lmc_id, w.worker_id,
                     self._worker_timeout)
        self._stats["workers_expired"] += len(gone)
        return len(gone)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self._worker_timeout / 4, 30.0))
            try:
                self.sweep()
            except Exception:
                self._stats["internal_errors"] += 1
                log.exception("LMCache worker sweep failed")

    # ---- KV reports ----

    def _on_kv_ops(self, lmc_id: str, worker_id: int, location: str,
                   ops: list[tuple[bool, int, int]]) -> None:
        self._stats["kv_ops"] += len(ops)
        if not ops:
            return
        w = self._worker(lmc_id, worker_id)
        if w is None:
            return
        if self._sync_state(w) == _SYNCING:
            # The running full sync is the truth for this worker; LMCache discards these too.
            self._stats["kv_ops_during_sync"] += len(ops)
            return
        last = w.seq.get(location)
        for _, _, seq in ops:
            if last is not None and seq != last + 1:
                self._stats["seq_gaps"] += 1
            last = seq
        w.seq[location] = last  # type: ignore[assignment]
        if w.instance_id is None:
            self._stats["kv_ops_unresolved"] += len(ops)
            return
        self._apply(w, location, [(a, k) for a, k, _ in ops])

    def _holdings_of(self, instance_id: str) -> Holdings:
        h = self._holdings.get(instance_id)
        if h is None:
            h = self._holdings[instance_id] = Holdings(self._max_sources)
        return h

    def _apply(self, w: _Worker, location: str, ops: list[tuple[bool, int]]) -> None:
        assert w.instance_id is not None
        h = self._holdings_of(w.instance_id)
        try:
            admitted, evicted = h.apply((w.lmc_id, w.worker_id, location), ops)
        except SlotsExhausted as exc:
            self._stats["sources_refused"] += 1
            log.debug("LMCache ops of %s/%s at %s refused: %s", w.lmc_id, w.worker_id, location, exc)
            return
        if evicted:
            self._sink.lmcache_evict(w.instance_id, evicted)
        if admitted:
            self._sink.lmcache_admit(w.instance_id, admitted)

    def _clear_sources(self, w: _Worker, location: str | None) -> None:
        """Forget what ``w`` reported (one location or all) and tell the sink what left."""
        if w.instance_id is None:
            return
        h = self._holdings_of(w.instance_id)
        gone = h.drop(lambda s: s[0] == w.lmc_id and s[1] == w.worker_id
                      and (location is None or s[2] == location))
        if not h.chunks:
            self._sink.lmcache_cleared(w.instance_id)
        elif gone:
            self._sink.lmcache_evict(w.instance_id, gone)

    # ---- full sync ----

    def _sync_state(self, w: _Worker) -> str | None:
        s = w.sync
        if s is None:
            return None
        if s.state == _SYNCING and time.monotonic() - s.last_activity > self._sync_timeout:
            s.state = _FAILED
            log.warning("full sync %s of %s/%d timed out", s.sync_id, w.lmc_id, w.worker_id)
        return s.state

    def _on_sync_start(self, msg: P.FullSyncStartMsg) -> P.FullSyncStartRetMsg:
        w = self._worker(msg.instance_id, msg.worker_id, create=False)
        ok = w is not None and w.registered
        if ok and w is not None and self._sync_state(w) == _SYNCING and w.sync is not None:
            ok = w.sync.sync_id == msg.sync_id
        if not ok or w is None:
            self._stats["full_sync_rejected"] += 1
            return P.FullSyncStartRetMsg(
                sync_id=msg.sync_id,
                accepted=False,
                error_msg="Failed to start sync: worker already syncing with "
                "different sync_id or worker not found",
            )
        if not 0 <= msg.batch_count <= self._max_sync_batches:
            self._stats["full_sync_rejected"] += 1
            return P.FullSyncStartRetMsg(
                sync_id=msg.sync_id,
                accepted=False,
                error_msg=f"batch_count {msg.batch_count} outside [0, {self._max_sync_batches}] "
                "(limits.lmcache_max_sync_batches)",
            )
        self._stats["full_sync_started"] += 1
        w.sync = _Sync(sync_id=msg.sync_id, location=msg.location, expected_batches=msg.batch_count)
        w.seq.pop(msg.location, None)
        self._clear_sources(w, msg.location)
        return P.FullSyncStartRetMsg(sync_id=msg.sync_id, accepted=True)

    def _current_sync(self, lmc_id: str, worker_id: int, sync_id: str) -> tuple[_Worker, _Sync] | None:
        w = self._worker(lmc_id, worker_id, create=False)
        if w is None or w.sync is None or w.sync.sync_id != sync_id or self._sync_state(w) != _SYNCING:
            self._stats["full_sync_stray"] += 1
            return None
        return w, w.sync

    def _on_sync_batch(self, msg: P.FullSyncBatchMsg, bulk: P.Bulk) -> None:
        found = self._current_sync(msg.instance_id, msg.worker_id, msg.sync_id)
        if found is None:
            return
        w, s = found
        if not 0 <= msg.batch_id < s.expected_batches:
            self._stats["full_sync_stray"] += 1
            return
        s.batches.add(msg.batch_id)
        while s.first_missing in s.batches:  # monotonic: O(1) per batch overall
            s.first_missing += 1
        n = len(bulk.keys)
        s.keys_received += n
        s.last_activity = time.monotonic()
        self._stats["kv_ops"] += n
        if w.instance_id is None:
            self._stats["kv_ops_unresolved"] += n
            return
        self._rest = _Rest(w.lmc_id, w.worker_id, msg.location, bulk, 0, sync=True)
        self._apply_rest()  # as a batch of operations: the PULL loop yields before each further slice

    def _on_sync_end(self, msg: P.FullSyncEndMsg) -> None:
        found = self._current_sync(msg.instance_id, msg.worker_id, msg.sync_id)
        if found is None:
            return
        _, s = found
        if s.keys_received != msg.actual_total_keys:
            log.warning("full sync %s: received %d keys, worker reports %d",
                        s.sync_id, s.keys_received, msg.actual_total_keys)
        s.state = _COMPLETED
        s.last_activity = time.monotonic()
        self._stats["full_sync_completed"] += 1

    def _on_sync_status(self, msg: P.FullSyncStatusMsg) -> P.FullSyncStatusRetMsg:
        w = self._worker(msg.instance_id, msg.worker_id, create=False)
        s = w.sync if w is not None else None
        state = self._sync_state(w) if w is not None else None
        same = s is not None and s.sync_id == msg.sync_id
        missing: list[int] = []
        if same and s is not None and state == _SYNCING:
            # A bounded window from the first gap: the worker resends these and asks again.
            top = min(s.expected_batches, s.first_missing + MISSING_WINDOW)
            missing = [b for b in range(s.first_missing, top) if b not in s.batches]
        registered = [x for x in self._workers.values() if x.registered]
        ready = sum(1 for x in registered if self._sync_state(x) in (None, _COMPLETED))
        progress = ready / len(registered) if registered else 0.0
        can_exit = progress >= self._threshold
        if can_exit:
            self._need_full_sync_all = False
        return P.FullSyncStatusRetMsg(
            sync_id=msg.sync_id,
            is_complete=same and state == _COMPLETED,
            global_progress=float(progress),
            can_exit_freeze=can_exit,
            missing_batches=missing,
        )

    # ---- P2P lookup ----

    def _on_p2p_lookup(self, msg: P.BatchedP2PLookupMsg) -> P.BatchedP2PLookupRetMsg:
        self._stats["p2p_lookups"] += 1
        self._worker(msg.instance_id, msg.worker_id, create=False)
        none = P.BatchedP2PLookupRetMsg(layout_info=[("", "", 0, "")])
        if not msg.hashes:
            return none
        # LMCache answers with the first registered holder of the first chunk; the longest prefix
        # among peers is never worse for the requester, and equals it when one peer holds it.
        best: tuple[int, str, str, str] | None = None
        # One pass over the sources (bounded per instance), not workers x sources.
        for h in self._holdings.values():
            for slot in h.bits:
                w = self._workers.get((slot[0], slot[1]))
                if w is None or w.lmc_id == msg.instance_id or w.peer_init_url is None:
                    continue
                n = h.prefix_len(slot, msg.hashes)
                if n and (best is None or n > best[0]):
                    best = (n, w.lmc_id, slot[2], w.peer_init_url)
        if best is None:
            return none
        n, lmc_id, location, url = best
        return P.BatchedP2PLookupRetMsg(layout_info=[(lmc_id, location, n, url)])

    # ---- heartbeat URL advertised to workers ----

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
