"""The controller: builds every part from a ``Config``, runs them, and keeps instances' liveness.

Parts: the two-tier index, load tracker and router (shared with the simulator); one vLLM KV
event subscriber per instance; the LMCache worker server; the global-tier adapter (Redis or
Mooncake); the engine-metrics poller; the route service; the Prometheus/healthz endpoint.

Liveness: an instance is routable while it shows signs of life (KV events, LMCache worker
messages, successful engine-metrics polls). One silent for ``load.instance_timeout_s`` leaves
routing (it is no longer a candidate for any request) and its in-flight load is forgotten, but its
index entries are kept and marked stale (``TierIndex.mark_stale``): a silent engine usually still
holds its KV cache, and dropping the entries would make every session on it look evicted when it
returns. Its next sign of life makes it routable again; its stale entries still count as hits
(reported stale in each lookup) until the engine's events store them again, remove them, clear the
instance (``AllBlocksCleared``, an engine restart) or the index ages them out. The rule is only
enforced when a source that speaks even while the engine is idle exists (engine-metrics polling or
LMCache heartbeats), since an idle engine emits no KV events and would otherwise leave routing for
being idle.

Circuit breaker: where a source that speaks while idle exists (the same condition), an instance
enters routing only after its first sign of life, not at start. A failed engine-metrics poll, or a
``done`` whose ``error`` is ``connect`` (the gateway could not connect to the engine), takes it out
at once ("open"), index kept and marked stale as above; the poller then re-probes it on a short
doubling backoff ("half-open"), and the first successful probe makes it routable again. While open,
KV events and LMCache messages still update its index but do not re-admit it: only the probe, which
is the engine's HTTP server answering, does. Without a poller, an instance the gateway reported
unreachable is re-admitted after ``load.breaker_probe_s`` (doubling per repeated trip).

Restart: with ``snapshot.path`` set the index is written there every ``snapshot.interval_s`` (and
at a clean stop) with each instance's last applied KV-event batch (``smetric_lmc.index.snapshot``),
by a forked child (``fork_write``: the loop pays only the fork, the child sees that instant). At start it is reloaded in slices (the route socket answers meanwhile), then each subscriber starts
and replays its engine's events from the batch after the snapshot's; until every replay has
finished the controller routes by load (``index_ready`` false). A snapshot that does not load
(corrupt, other hashing) is logged and ignored.

Event gaps: the vLLM event subscriber replays a sequence gap; a gap replay cannot fill, or a batch
the index failed on, marks the instance's entries stale in the same way, never clears them.

Hot reload: the ``policy`` section is re-read when the config file changes (mtime polled) or on
SIGHUP; a bad file is logged and ignored; other sections need a restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from smetric_lmc.config import Config, ConfigError, load_config
from smetric_lmc.hashing import HashSettings
from smetric_lmc.index import TierIndex
from smetric_lmc.index import snapshot as index_snapshot
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router

from .engine_metrics import EngineMetricsPoller
from .memory import Trimmer, tune_malloc
from .metrics import (
    ControllerMetrics,
    InstanceState,
    MetricsServer,
    Snapshot,
    StateCollector,
    SubscriberState,
)
from .prices import PriceCollector
from .prices import make_feed as make_price_feed
from .replicas import LoadShare
from .service import RouteCore, RouteService

log = logging.getLogger(__name__)


class LiveSink:
    """The index as event sources see it: every per-instance update is also a sign of life.

    An update for an instance that was dropped for silence registers it again first, so the
    update lands instead of being counted as an unknown instance.
    """

    def __init__(self, index: TierIndex, seen: Callable[[str], None]) -> None:
        self._index = index
        self._seen = seen

    def gpu_stored(self, instance_id: str, *args: Any, **kw: Any) -> int:
        self._seen(instance_id)
        return self._index.gpu_stored(instance_id, *args, **kw)

    def gpu_removed(self, instance_id: str, block_hashes: Sequence[int]) -> int:
        self._seen(instance_id)
        return self._index.gpu_removed(instance_id, block_hashes)

    def gpu_cleared(self, instance_id: str) -> None:
        self._seen(instance_id)
        self._index.gpu_cleared(instance_id)

    def mark_stale(self, instance_id: str) -> None:
        self._seen(instance_id)
        self._index.mark_stale(instance_id)

    def lmcache_admit(self, instance_id: str, chunk_hashes: Iterable[int]) -> None:
        self._seen(instance_id)
        self._index.lmcache_admit(instance_id, chunk_hashes)

    def lmcache_evict(self, instance_id: str, chunk_hashes: Iterable[int]) -> None:
        self._seen(instance_id)
        self._index.lmcache_evict(instance_id, chunk_hashes)

    def lmcache_cleared(self, instance_id: str) -> None:
        self._seen(instance_id)
        self._index.lmcache_cleared(instance_id)

    def lmcache_worker_seen(self, instance_id: str) -> None:
        self._seen(instance_id)

    def __getattr__(self, name: str) -> Any:  # global_* and anything else go straight to the index
        return getattr(self._index, name)


class ControllerApp:
    def __init__(
        self,
        cfg: Config,
        *,
        config_path: str | Path | None = None,
        reload_poll_s: float = 1.0,
        enable_metrics_http: bool = True,
    ) -> None:
        self.cfg = cfg
        self.config_path = Path(config_path) if config_path is not None else None
        self.reload_poll_s = reload_poll_s
        self.enable_metrics_http = enable_metrics_http
        self.ctx = zmq.asyncio.Context()
        self.hashing = HashSettings.from_config(cfg)
        hs = self.hashing
        self.index = TierIndex(hs.block_size, hs.chunk_size, fast_root=hs.fast_root)
        self.load = LoadTracker(expire_s=cfg.load.lost_done_grace_s or None)
        self.trimmer = Trimmer()  # periodic, gated malloc_trim (controller/memory.py)
        self.disaggregated = cfg.pd_mode == "disaggregated"
        self.router = Router(self.index, self.load, cfg.policy, disaggregated=self.disaggregated)
        self.router.prices = make_price_feed(cfg.policy)  # learns each instance's prices from done reports
        self.metrics = ControllerMetrics()
        self.metrics.add_collector(StateCollector(self.snapshot))
        self.metrics.add_collector(PriceCollector(self.router.prices))
        self.core = RouteCore(
            self.index,
            self.load,
            self.router,
            cfg.instances,
            self.hashing,
            disaggregated=self.disaggregated,
            metrics=self.metrics,
            stats_fn=self._extra_stats,
            global_store_fn=self.global_store_state,
            limits=cfg.limits,
            on_engine_error=self.engine_unreachable,
        )
        srv = cfg.server
        self.service = RouteService(
            self.core,
            srv.route_url,
            curve_secret_key=srv.curve_secret_key,
            curve_public_key=srv.curve_public_key,
            curve_client_keys=srv.curve_client_keys or None,
            ctx=self.ctx,
        )
        self.share: LoadShare | None = None
        if cfg.replicas.pub_url:
            self.share = LoadShare(self.load, cfg.replicas.id, cfg.replicas.pub_url,
                                   cfg.replicas.peers, ctx=self.ctx)
            self.share.attach(self.core)
        self.sink = LiveSink(self.index, self._seen)
        self.subscribers: dict[str, Any] = {}
        self.lmcache_server: Any = None
        self.global_tier: Any = None
        self.poller: EngineMetricsPoller | None = None
        self.metrics_server: MetricsServer | None = None
        self._ids = [i.id for i in cfg.instances]
        self._known = frozenset(self._ids)
        self._last_seen: dict[str, float] = {}
        self._routable: set[str] = set()
        self._liveness_enforced = cfg.load.instance_timeout_s > 0 and (
            cfg.load.metrics_poll_s > 0 or cfg.lmcache.enabled
        )
        self._open: dict[str, str] = {}  # breaker open: instance -> why it was taken out
        self._trips: dict[str, int] = dict.fromkeys(self._ids, 0)
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._started = 0.0
        self._config_stamp: tuple[int, int] | None = None
        self.snapshot_stats: dict[str, Any] = {"written": 0, "failed": 0, "bytes": 0, "restored_blocks": 0,
                                               "restore_s": None, "last_write_s": None, "catch_up_s": None,
                                               "fork_ms": None}
        self.reloads = {"applied": 0, "rejected": 0, "unchanged": 0}
        self._snapshot_lock = asyncio.Lock()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._started = time.monotonic()
        for iid in self._ids:
            self._register(iid, routable=not self._liveness_enforced)
        snap = self._read_snapshot()
        if snap is not None:
            self.core.catching_up = True  # route by load until restored and replayed
        self.service.bind()
        self._spawn("route-service", self.service.run)
        tune_malloc()  # freed MB-sized buffers go back to the OS (see controller/memory.py)
        self._spawn("memory-trim", self.trimmer.run)
        if self.share is not None:
            self.share.bind()
            self._spawn("load-share", self.share.run)
        # With a snapshot, subscribers start once it is restored (their sockets queue meanwhile).
        self._start_subscribers(run=snap is None)
        if snap is not None:
            self._spawn("snapshot-restore", lambda: self._restore_then_resume(snap))
        await self._start_lmcache()
        self._start_global_tier()
        if self.cfg.load.metrics_poll_s > 0 or self.enable_metrics_http:
            # The HTTP parts' imports (aiohttp: 0.25-0.7 s) run on a thread while the route
            # socket, the snapshot restore and the KV-event subscribers already run on the loop:
            # a restarted controller answers its first route before they are in.
            await asyncio.to_thread(_import_http)
        self._start_poller()
        if self.enable_metrics_http:
            self.metrics_server = MetricsServer(
                self.metrics, self.health_dict, self.cfg.server.metrics_host, self.cfg.server.metrics_port
            )
            await self.metrics_server.start()
        if self._liveness_enforced:
            self._spawn("liveness", self._liveness_loop)
        self._spawn("index-maintain", self._maintain_loop)
        if self.cfg.snapshot.path:
            self._spawn("snapshot", self._snapshot_loop)
        if self.config_path is not None:
            self._config_stamp = _stamp(self.config_path)
            if self.reload_poll_s > 0:
                self._spawn("config-watch", self._watch_config)
        # What start-up built lives as long as the controller: out of the cyclic GC's reach, so
        # full collections (which stop the loop) walk only what came after (see bench/soak.py).
        gc.freeze()
        log.info(
            "controller started route=%s instances=%d policy=%s pd_mode=%s global_store=%s lmcache=%s",
            self.service.endpoint, len(self._ids), self.cfg.policy.name, self.cfg.pd_mode,
            self.cfg.global_store.kind, self.cfg.lmcache.enabled,
        )

    async def serve(self, *, install_signals: bool = True) -> None:
        """Start, run until SIGINT/SIGTERM (or ``request_stop``), then shut down cleanly."""
        loop = asyncio.get_running_loop()
        installed: list[int] = []
        if install_signals:
            for sig, handler in (
                (signal.SIGINT, self.request_stop),
                (signal.SIGTERM, self.request_stop),
                (signal.SIGHUP, self.reload_config),
            ):
                loop.add_signal_handler(sig, handler)
                installed.append(sig)
        try:
            await self.start()
            await self._stop.wait()
            log.info("controller stopping")
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            await self.close()

    def request_stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        if self.cfg.snapshot.path and self._started and not self.core.catching_up:
            await self.write_snapshot()
        closers: list[Callable[[], Awaitable[Any]]] = [self.service.close]
        if self.share is not None:
            closers.append(self.share.close)
        if self.poller is not None:
            closers.append(self.poller.close)
        closers += [s.close for s in self.subscribers.values()]
        if self.lmcache_server is not None:
            closers.append(self.lmcache_server.close)
        if self.global_tier is not None:
            closers.append(self.global_tier.close)
        if self.metrics_server is not None:
            closers.append(self.metrics_server.close)
        for close in closers:
            try:
                await asyncio.wait_for(close(), timeout=5.0)
            except Exception:
                log.exception("controller: shutdown step failed")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self.ctx.destroy(linger=0)
        gc.unfreeze()  # a process that starts controllers again (tests) must not keep every old one
        log.info("controller stopped")

    def _spawn(self, name: str, run: Callable[[], Awaitable[Any]]) -> None:
        self._tasks.append(asyncio.create_task(self._supervise(name, run), name=name))

    #: A part that ran this long before crashing had recovered: its restart backoff starts over.
    RECOVERED_AFTER_S = 30.0

    async def _supervise(self, name: str, run: Callable[[], Awaitable[Any]]) -> None:
        # A part that crashes is restarted: the controller must outlive any one peer's damage.
        backoff = 0.5
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                if time.monotonic() - started > self.RECOVERED_AFTER_S:  # it had recovered: start over
                    backoff = 0.5
                log.exception("controller: part crashed part=%s restart_in_s=%.1f", name, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    # ---- parts ------------------------------------------------------------------------------------
    def _start_subscribers(self, *, run: bool = True) -> None:
        try:
            from .vllm_events import VllmEventSubscriber
        except ImportError as exc:
            if any(i.kv_events for i in self.cfg.instances):
                log.error("vLLM KV events unavailable (%s): routing without the GPU tier", exc)
            return
        lim = self.cfg.limits
        for inst in self.cfg.instances:
            if not inst.kv_events:
                continue
            try:
                sub = VllmEventSubscriber(
                    inst.kv_events,
                    inst.id,
                    self.sink,
                    topic=inst.kv_events_topic,
                    replay_endpoint=inst.replay,
                    bind=inst.kv_events_bind,
                    replay_timeout_s=lim.replay_frame_timeout_s,
                    replay_deadline_s=lim.replay_deadline_s,
                    max_message_bytes=lim.kv_max_frame_bytes,
                    max_events_per_batch=lim.kv_max_events_per_batch,
                    max_blocks_per_event=lim.kv_max_blocks_per_event,
                    worker=self.service.worker,
                    ctx=self.ctx,
                )
            except zmq.ZMQError as exc:
                log.error("vLLM events: cannot open instance=%s endpoint=%s error=%s", inst.id, inst.kv_events, exc)
                continue
            self.subscribers[inst.id] = sub
            if run:
                self._spawn(f"kv-events-{inst.id}", sub.run)
            log.info("vLLM events instance=%s endpoint=%s bind=%s", inst.id, sub.endpoint, sub.binds)

    async def _start_lmcache(self) -> None:
        lc = self.cfg.lmcache
        if not lc.enabled:
            return
        try:
            from .lmcache_server import LMCacheWorkerServer
        except ImportError as exc:
            log.error("LMCache worker server unavailable (%s): routing without the LMCache tier", exc)
            return
        ids = {(i.lmcache_instance_id or i.id): i.id for i in self.cfg.instances}
        lim = self.cfg.limits
        server = LMCacheWorkerServer(
            self.sink,
            pull_url=lc.pull_url,
            reply_url=lc.reply_url,
            heartbeat_url=lc.heartbeat_url,
            upstream_pull_url=lc.upstream_pull_url,
            upstream_reply_url=lc.upstream_reply_url,
            resolve_instance=lambda lmcache_id, _worker_id: ids.get(lmcache_id),
            max_frame_bytes=lim.lmcache_max_frame_bytes,
            max_workers=lim.lmcache_max_workers,
            max_sources_per_instance=lim.lmcache_max_sources_per_instance,
            worker_timeout_s=lim.lmcache_worker_timeout_s,
            max_sync_batches=lim.lmcache_max_sync_batches,
            worker=self.service.worker,
        )
        await server.start()
        self.lmcache_server = server

    def _start_global_tier(self) -> None:
        gs = self.cfg.global_store
        model = gs.model or self.cfg.model
        try:
            if gs.kind == "redis":
                if not gs.url:
                    log.error("global_store.kind=redis needs global_store.url: routing local-only")
                    return
                from .global_redis import RedisGlobalTier

                self.global_tier = RedisGlobalTier(
                    gs.url, self.index, model=model, world_size=gs.world_size,
                    reconcile_interval_s=gs.reconcile_interval_s,
                )
            elif gs.kind == "mooncake":
                from .global_mooncake import MooncakeGlobalTier, open_store_probe

                probe = None
                if gs.master_addr and gs.metadata_server:
                    master_addr, metadata_server = gs.master_addr, gs.metadata_server
                    probe = functools.partial(open_store_probe, master_addr, metadata_server)
                self.global_tier = MooncakeGlobalTier(
                    self.index, model=model, world_size=gs.world_size, events_endpoint=gs.events_endpoint,
                    master_http_url=gs.master_http, reconcile_interval_s=gs.reconcile_interval_s,
                    open_store=probe,
                )
            else:
                return
        except ImportError as exc:
            log.error("global store %s unavailable (%s): routing local-only", gs.kind, exc)
            return
        self._spawn(f"global-{gs.kind}", self.global_tier.run)

    def _start_poller(self) -> None:
        if self.cfg.load.metrics_poll_s <= 0 or not self._ids:
            return
        self.poller = EngineMetricsPoller(
            {i.id: i.http for i in self.cfg.instances},
            self.load,
            interval_s=self.cfg.load.metrics_poll_s,
            grace_s=self.cfg.load.lost_done_grace_s,
            timeout_s=self.cfg.load.metrics_timeout_s,
            on_result=self._poll_result,
            probe_s=self.cfg.load.breaker_probe_s,
        )
        self._spawn("engine-metrics", self.poller.run)

    # ---- liveness ---------------------------------------------------------------------------------
    def _register(self, iid: str, *, routable: bool = True) -> None:
        self.index.register_instance(iid)
        self.load.add_instance(iid)
        if routable:
            self._routable.add(iid)
        self._last_seen[iid] = time.monotonic()
        self.core.set_silent(self._known - self._routable)

    def _seen(self, iid: str, *, probe: bool = False) -> None:
        if iid not in self._known:
            return
        self._last_seen[iid] = time.monotonic()
        if iid in self._routable:
            return
        if iid in self._open:
            if not probe and self.poller is not None:
                return  # an open breaker closes on the engine's HTTP probe only
            log.info("instance back: breaker closed, routable again instance=%s was=%s", iid, self._open.pop(iid))
        else:
            log.info("instance alive: routable instance=%s", iid)
        self._register(iid)

    def _poll_result(self, iid: str, ok: bool) -> None:
        if ok:
            self._seen(iid, probe=True)
        else:
            self._trip(iid, "metrics_poll_failed")

    def engine_unreachable(self, iid: str, kind: str) -> None:
        """A gateway could not reach ``iid`` (``done`` with an ``error``): out of routing at once."""
        if kind != "connect" or iid not in self._known:
            return
        self._trip(iid, "gateway_connect_failed")
        if self.poller is not None:
            self.poller.probe_now(iid)

    def _trip(self, iid: str, why: str) -> None:
        """Open the breaker: no new requests, in-flight load forgotten, index kept and marked stale."""
        if iid in self._open:
            return
        self._open[iid] = why
        self._trips[iid] = self._trips.get(iid, 0) + 1
        self.index.mark_stale(iid)
        if iid in self._routable:
            self._routable.discard(iid)
            self.load.remove_instance(iid)
            self.core.set_silent(self._known - self._routable)
        log.warning("instance unreachable: breaker open, out of routing, index kept as stale instance=%s why=%s",
                    iid, why)
        if self.poller is None:  # nothing probes it: half-open after a doubling cool-down
            delay = self.cfg.load.breaker_probe_s * 2 ** min(self._trips[iid] - 1, 6)
            asyncio.get_running_loop().call_later(delay, self._half_open, iid)

    def _half_open(self, iid: str) -> None:
        if self._open.pop(iid, None) is not None and not self._stop.is_set():
            log.info("instance half-open: routable again until it fails instance=%s", iid)
            self._register(iid)

    def check_liveness(self, now: float | None = None) -> list[str]:
        """Take instances silent for longer than the timeout out of routing; returns their ids.

        Their index entries stay, marked stale (see the module docstring)."""
        now = time.monotonic() if now is None else now
        timeout = self.cfg.load.instance_timeout_s
        dropped = []
        for iid in list(self._routable):
            silent = now - self._last_seen.get(iid, now)
            if silent > timeout:
                self._routable.discard(iid)
                self.index.mark_stale(iid)
                self.load.remove_instance(iid)
                dropped.append(iid)
                log.warning("instance silent: leaves routing, index kept as stale instance=%s silent_s=%.1f "
                            "timeout_s=%.1f", iid, silent, timeout)
        if dropped:
            self.core.set_silent(self._known - self._routable)
        return dropped

    async def _liveness_loop(self) -> None:
        period = max(0.05, min(1.0, self.cfg.load.instance_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            self.check_liveness()

    async def _maintain_loop(self) -> None:
        # Bulk changes leave work behind, done here a bounded slice (a few ms) at a time: rows a
        # clear emptied (AllBlocksCleared, a stale TTL; ingest also frees a slice per store) and
        # in-flight entries of instances taken out of routing, and of requests never reported
        # done (past load.lost_done_grace_s: routes expire them too, but an idle one must as well).
        # Each slice is its own loop turn: run back to back, the in-flight expiry and the index's
        # pending-prompt expiry made one 30-60 ms callback once a burst of lost requests came due
        # (bench/soak.py --slow-callbacks).
        while True:
            busy = False
            if self.load.expire_due():
                self.load.expire()
                busy = True
                await asyncio.sleep(0)
            if self.index.needs_maintenance:
                self.index.maintain()
                busy = True
                await asyncio.sleep(0)
            if self.load.drain():
                busy = True
            await asyncio.sleep(0 if busy else 0.2)

    # ---- snapshots ------------------------------------------------------------------------------
    def _read_snapshot(self) -> index_snapshot.IndexSnapshot | None:
        path = self.cfg.snapshot.path
        if not path:
            return None
        try:
            snap = index_snapshot.read(path)
            if snap is not None:
                index_snapshot.check_compatible(self.index, snap)
        except (index_snapshot.SnapshotError, OSError) as exc:
            log.error("index snapshot: %s not loaded (%s); starting empty", path, exc)
            return None
        if snap is None:
            log.info("index snapshot: none at %s; starting empty", path)
        return snap

    async def _restore_then_resume(self, snap: index_snapshot.IndexSnapshot) -> None:
        """Restore in slices (routes are answered, by load, meanwhile), then start every
        subscriber, resumed from the snapshot's batch, and route by policy once they caught up."""
        t0 = time.monotonic()
        restored: dict[str, int] = {}
        try:
            for _ in index_snapshot.restore_slices(self.index, snap, self._known, restored):
                await asyncio.sleep(0)
        except Exception:
            log.exception("index snapshot: restore failed after %d blocks; what was restored is marked stale",
                          sum(restored.values()))
            for iid in restored:
                self.index.mark_stale(iid)
        gc.freeze()  # the restored index lives on: out of the reach of full collections, like start-up's
        self.snapshot_stats["restored_blocks"] = sum(restored.values())
        self.snapshot_stats["restore_s"] = round(time.monotonic() - t0, 3)
        log.info("index snapshot: restored %d blocks of %d instances (age %.1fs) in %.2fs",
                 sum(restored.values()), len(restored), time.time() - snap.created, time.monotonic() - t0)
        waiting = []
        for iid, sub in self.subscribers.items():
            inst = snap.instances.get(iid)
            if inst is not None and inst.seq is not None:
                sub.resume(inst.seq, inst.ts)
                waiting.append(sub)
            self._spawn(f"kv-events-{iid}", sub.run)
        await asyncio.gather(*(s.caught_up.wait() for s in waiting))
        self.core.catching_up = False
        self.snapshot_stats["catch_up_s"] = round(time.monotonic() - t0, 3)
        log.info("index snapshot: restored and %d engines replayed in %.2fs: routing by policy",
                 len(waiting), time.monotonic() - t0)

    async def write_snapshot(self) -> bool:
        """Snapshot the index now; True when written. A forked child takes and writes it (index
        and event positions as they were at the fork, ~20 ms at 10 M blocks on the loop); where
        there is no fork, the export runs on the loop and the file is written on a thread."""
        path = self.cfg.snapshot.path
        if not path:
            return False
        async with self._snapshot_lock:
            t0 = time.monotonic()
            positions = {iid: s.position() for iid, s in self.subscribers.items()}
            try:
                if hasattr(os, "fork"):
                    job = index_snapshot.fork_write(path, self.index, positions)
                    self.snapshot_stats["fork_ms"] = round((time.monotonic() - t0) * 1000, 2)
                    size = await asyncio.to_thread(job.wait)
                else:
                    snap = index_snapshot.take(self.index, positions)
                    size = await asyncio.to_thread(index_snapshot.write, path, snap)
            except OSError as exc:
                self.snapshot_stats["failed"] += 1
                log.error("index snapshot: cannot write %s: %s", path, exc)
                return False
        self.snapshot_stats["written"] += 1
        self.snapshot_stats["bytes"] = size
        self.snapshot_stats["last_write_s"] = round(time.monotonic() - t0, 3)
        log.debug("index snapshot: %d bytes to %s in %.2fs", size, path, time.monotonic() - t0)
        return True

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.snapshot.interval_s)
            if not self.core.catching_up:  # the restored one stays until replays are in
                await self.write_snapshot()

    # ---- hot reload -------------------------------------------------------------------------------
    async def _watch_config(self) -> None:
        assert self.config_path is not None
        while True:
            await asyncio.sleep(self.reload_poll_s)
            stamp = _stamp(self.config_path)
            if stamp is not None and stamp != self._config_stamp:
                self._config_stamp = stamp
                self.reload_config()

    def reload_config(self) -> bool:
        """Re-read the policy section; returns True when a new policy took effect."""
        if self.config_path is None:
            log.warning("config reload: no config file to reload")
            return False
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            self.reloads["rejected"] += 1
            log.error("config reload ignored: %s", exc)
            return False
        old_sections = {k: v for k, v in msgspec.structs.asdict(self.cfg).items() if k != "policy"}
        new_sections = {k: v for k, v in msgspec.structs.asdict(new).items() if k != "policy"}
        restart_needed = sorted(k for k in old_sections if old_sections[k] != new_sections[k])
        if restart_needed:
            log.warning("config reload: only the policy section hot-reloads; restart to apply sections=%s",
                        ",".join(restart_needed))
        old = self.router.policy_cfg
        if new.policy == old:
            self.reloads["unchanged"] += 1
            log.info("config reload: policy unchanged")
            return False
        a, b = msgspec.structs.asdict(old), msgspec.structs.asdict(new.policy)
        changes = " ".join(f"{k}={a[k]!r}->{b[k]!r}" for k in a if a[k] != b[k])
        self.router.set_policy(new.policy)
        self.cfg = msgspec.structs.replace(self.cfg, policy=new.policy)
        self.reloads["applied"] += 1
        log.info("config reload: policy changed %s", changes)
        return True

    # ---- views ------------------------------------------------------------------------------------
    def global_store_state(self) -> str:
        kind = self.cfg.global_store.kind
        if kind == "none":
            return "none"
        if self.global_tier is None:
            return f"{kind}:unavailable"
        return f"{kind}:up" if getattr(self.global_tier, "available", False) else f"{kind}:down"

    def routable(self) -> list[str]:
        return self.core.routable_ids()

    def health_dict(self) -> dict[str, Any]:
        h = self.core.health()
        now = time.monotonic()
        return {
            "ok": h.ok,
            "routable_instances": h.routable_instances,
            "index_ready": h.index_ready,
            "degraded": not h.index_ready,
            "global_store": h.global_store,
            "policy": self.router.policy_cfg.name,
            "instances": {
                iid: {
                    "routable": iid in self._routable,
                    "seconds_since_seen": round(now - self._last_seen.get(iid, now), 3),
                    "engine_metrics_ok": self.poller.healthy(iid) if self.poller is not None else None,
                }
                for iid in self._ids
            },
        }

    def _extra_stats(self) -> dict[str, Any]:
        now = time.monotonic()
        out: dict[str, Any] = {
            "uptime_s": round(now - self._started, 3) if self._started else 0.0,
            "pd_mode": self.cfg.pd_mode,
            "global_store": self.global_store_state(),
            "route_socket": {**self.service.counters, **self.service.curve_counts},
            "reloads": dict(self.reloads),
            "snapshot": dict(self.snapshot_stats),
            "liveness": {
                iid: {"routable": iid in self._routable, "seconds_since_seen": round(now - self._last_seen.get(iid, now), 3),
                      "breaker_open": self._open.get(iid), "breaker_trips": self._trips.get(iid, 0)}
                for iid in self._ids
            },
            "kv_events": {iid: dataclasses.asdict(s.stats) for iid, s in self.subscribers.items()},
        }
        if self.poller is not None:
            out["engine_metrics"] = {
                iid: {k: v for k, v in dataclasses.asdict(st).items() if k != "last_ok"}
                for iid, st in self.poller.state.items()
            }
        if self.lmcache_server is not None:
            out["lmcache"] = _builtins(getattr(self.lmcache_server, "stats", {}))
        if self.global_tier is not None:
            out["global_tier"] = _builtins(getattr(self.global_tier, "stats", {}))
        return _builtins(out)

    def snapshot(self) -> Snapshot:
        now = time.monotonic()
        rows = []
        for iid in self._ids:
            st = self.poller.state.get(iid) if self.poller is not None else None
            rows.append(
                InstanceState(
                    id=iid,
                    routable=iid in self._routable,
                    in_flight=self.load.in_flight(iid),
                    unprefilled_tokens=self.load.unprefilled(iid),
                    seconds_since_seen=now - self._last_seen.get(iid, now),
                    engine_metrics_ok=st.ok if st is not None else None,
                    engine_poll_failures=st.failures if st is not None else 0,
                    healed_done=st.healed if st is not None else 0,
                )
            )
        subs = []
        for iid, sub in self.subscribers.items():
            s = sub.stats
            subs.append(
                SubscriberState(
                    instance=iid, events=dict(s.events), batches=s.batches, gaps=s.gaps, replays=s.replays,
                    replay_failures=s.replay_failures, unfilled_gaps=s.unfilled_gaps, restarts=s.restarts,
                    decode_errors=s.decode_errors, bad_frames=s.bad_frames, oversize_batches=s.oversize_batches,
                    offloaded=s.offloaded, large_on_loop=s.large_on_loop, worker_failures=s.worker_failures,
                    lag_s=s.lag_s,
                )
            )
        components: dict[str, dict[str, Any]] = {"route_socket": dict(self.service.counters), "service": dict(self.core.counters)}
        if self.lmcache_server is not None:
            components["lmcache"] = _flat_numbers(_builtins(getattr(self.lmcache_server, "stats", {})))
        if self.global_tier is not None:
            components["global_tier"] = _flat_numbers(_builtins(getattr(self.global_tier, "stats", {})))
        return Snapshot(
            instances=rows,
            subscribers=subs,
            index_ready=self.core.index_ready,
            index_sizes=self.index.sizes(),
            index_stats=dict(self.index.stats),
            global_available=None if self.cfg.global_store.kind == "none" else self.global_store_state().endswith(":up"),
            components=components,
        )


def _import_http() -> None:
    import aiohttp  # noqa: F401
    import aiohttp.web  # noqa: F401
    import prometheus_client.parser  # noqa: F401


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _builtins(obj: Any) -> Any:
    """Plain msgpack/JSON-able data out of whatever a part reports (dataclasses, structs, sets)."""
    if callable(obj):
        try:
            obj = obj()
        except Exception:
            return {}
    return msgspec.to_builtins(obj, str_keys=True, enc_hook=repr)


def _flat_numbers(d: Any) -> dict[str, float]:
    if not isinstance(d, dict):
        return {}
    return {k: v for k, v in d.items() if isinstance(v, bool | int | float)}
