"""The controller's wiring: builds every part from a ``Config``, starts them, stops them.

Parts: the two-tier index, load tracker and router (shared with the simulator); membership
(``membership.py``: who may be routed to, liveness, circuit breaker); one vLLM KV event subscriber
per instance; the LMCache worker server; the global-tier adapter (Redis or Mooncake); the
engine-metrics poller; the route service; index snapshots (``persistence.py``); policy hot reload
(``reload.py``); the one state view that ``/healthz``, stats and ``/metrics`` render
(``state.py``). Each concern lives in its module; this one only connects them.

Event gaps: the vLLM event subscriber replays a sequence gap; a gap replay cannot fill, or a batch
the index failed on, marks the instance's entries stale, never clears them.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from smetric_lmc.config import Config, InstanceConfig
from smetric_lmc.controller.engine_metrics import EngineMetricsPoller
from smetric_lmc.controller.membership import IngestSink, Membership
from smetric_lmc.controller.memory import Trimmer, tune_malloc
from smetric_lmc.controller.metrics import ControllerMetrics, MetricsServer, StateCollector
from smetric_lmc.controller.peer_apis import PeerApis, start_peer_apis
from smetric_lmc.controller.persistence import IndexSnapshots
from smetric_lmc.controller.prices import PriceCollector
from smetric_lmc.controller.prices import make_feed as make_price_feed
from smetric_lmc.controller.reload import PolicyReload
from smetric_lmc.controller.replicas import LoadShare
from smetric_lmc.controller.service import RouteCore, RouteService
from smetric_lmc.controller.state import ControllerState
from smetric_lmc.controller.tasks import Supervisor
from smetric_lmc.hashing import HashSettings
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router

log = logging.getLogger(__name__)


class ControllerApp:
    def __init__(
        self,
        cfg: Config,
        *,
        config_path: str | Path | None = None,
        reload_poll_s: float = 1.0,
        enable_metrics_http: bool = True,
    ) -> None:
        self.config_path = Path(config_path) if config_path is not None else None
        self.enable_metrics_http = enable_metrics_http
        self.ctx = zmq.asyncio.Context()
        self.hashing = hs = HashSettings.from_config(cfg)
        self.index = TierIndex(hs.block_size, hs.chunk_size, fast_root=hs.fast_root)
        self.load = LoadTracker(expire_s=cfg.load.lost_done_grace_s or None)
        self.trimmer = Trimmer()  # periodic, gated malloc_trim (controller/memory.py)
        self.disaggregated = cfg.pd_mode == "disaggregated"
        self.router = Router(self.index, self.load, cfg.policy, disaggregated=self.disaggregated)
        self.router.prices = make_price_feed(cfg.policy)  # learns each instance's prices from done reports
        self.reloader = PolicyReload(cfg, self.config_path, self.router, reload_poll_s)
        self.membership = Membership(
            cfg.instances, self.index, self.load,
            disaggregated=self.disaggregated,
            liveness_enforced=cfg.load.instance_timeout_s > 0 and (cfg.load.metrics_poll_s > 0 or cfg.lmcache.enabled),
            timeout_s=cfg.load.instance_timeout_s,
            breaker_probe_s=cfg.load.breaker_probe_s,
        )
        self.sink = IngestSink(self.index, self.membership)
        self.metrics = ControllerMetrics()
        self.metrics.add_collector(PriceCollector(self.router.prices))
        self.core = RouteCore(
            self.index, self.load, self.router, cfg.instances, self.hashing,
            disaggregated=self.disaggregated,
            metrics=self.metrics,
            stats_fn=lambda: self.state.stats_extra(),
            global_store_fn=lambda: self.state.global_store_state(),
            limits=cfg.limits,
            on_engine_error=self.membership.engine_unreachable,
            membership=self.membership,
        )
        srv = cfg.server
        self.service = RouteService(
            self.core, srv.route_url,
            curve_secret_key=srv.curve_secret_key,
            curve_public_key=srv.curve_public_key,
            curve_client_keys=srv.curve_client_keys or None,
            ctx=self.ctx,
        )
        self.share: LoadShare | None = None
        if cfg.replicas.pub_url:
            self.share = LoadShare(self.load, cfg.replicas.id, cfg.replicas.pub_url, cfg.replicas.peers, ctx=self.ctx)
            self.share.attach(self.core)
        self.subscribers: dict[str, Any] = {}
        self.lmcache_server: Any = None
        self.global_tier: Any = None
        self.poller: EngineMetricsPoller | None = None
        self.metrics_server: MetricsServer | None = None
        self.peer_apis: PeerApis | None = None  # read-only index APIs for other stacks (peer_apis.py)
        self.snapshots = IndexSnapshots(cfg.snapshot.path, cfg.snapshot.interval_s, self.index, self.core,
                                        self.subscribers)
        self.state = ControllerState(
            self.membership, self.index, self.load, self.core, self.service, self,
            pd_mode=cfg.pd_mode, global_kind=cfg.global_store.kind,
            policy_name=lambda: self.router.policy_cfg.name,
            counters=lambda: {"reloads": self.reloader.counts, "snapshot": self.snapshots.stats},
        )
        self.metrics.add_collector(StateCollector(self.state.view))
        self._stop = asyncio.Event()
        self.supervisor = Supervisor(self._stop)

    @property
    def cfg(self) -> Config:
        """The config in effect (the policy section follows hot reloads)."""
        return self.reloader.cfg

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.state.started = time.monotonic()
        spawn = self.supervisor.spawn
        self.membership.start()
        snap = self.snapshots.read()
        if snap is not None:
            self.core.catching_up = True  # route by load until restored and replayed
        self.service.bind()
        spawn("route-service", self.service.run)
        tune_malloc()  # freed MB-sized buffers go back to the OS (see controller/memory.py)
        spawn("memory-trim", self.trimmer.run)
        if self.share is not None:
            self.share.bind()
            spawn("load-share", self.share.run)
        # With a snapshot, subscribers start once it is restored (their sockets queue meanwhile).
        self._start_subscribers(run=snap is None)
        if snap is not None:
            spawn("snapshot-restore", lambda: self.snapshots.restore_then_resume(snap, self.membership.known, spawn))
        await self._start_lmcache()
        self._start_global_tier()
        if self.cfg.load.metrics_poll_s > 0 or self.enable_metrics_http:
            # The HTTP parts' imports run on a thread while the route socket, the snapshot restore
            # and the KV-event subscribers already run: a restarted controller answers sooner.
            await asyncio.to_thread(_import_http)
        self._start_poller()
        if self.enable_metrics_http:
            self.metrics_server = MetricsServer(
                self.metrics, self.state.health, self.cfg.server.metrics_host, self.cfg.server.metrics_port
            )
            await self.metrics_server.start()
        self.peer_apis = await start_peer_apis(self.core, self.cfg.peer_apis)  # off by default
        if self.membership.liveness_enforced:
            spawn("liveness", self.membership.run_liveness)
        spawn("index-maintain", self._maintain_loop)
        if self.cfg.snapshot.path:
            spawn("snapshot", self.snapshots.run)
        if self.config_path is not None:
            self.reloader.arm()
            if self.reloader.poll_s > 0:
                spawn("config-watch", self.reloader.watch)
        # What start-up built lives as long as the controller: out of the cyclic GC's reach, so
        # full collections (which stop the loop) walk only what came after.
        gc.freeze()
        log.info(
            "controller started route=%s instances=%d policy=%s pd_mode=%s global_store=%s lmcache=%s",
            self.service.endpoint, len(self.membership.ids), self.cfg.policy.name, self.cfg.pd_mode,
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
                (signal.SIGHUP, self.reloader.reload),
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
        self.membership.closed = True
        if self.cfg.snapshot.path and self.state.started and not self.core.catching_up:
            await self.snapshots.write()
        closers: list[Callable[[], Awaitable[Any]]] = [self.service.close]
        if self.share is not None:
            closers.append(self.share.close)
        if self.poller is not None:
            closers.append(self.poller.close)
        closers += [s.close for s in self.subscribers.values()]
        for part in (self.lmcache_server, self.global_tier, self.metrics_server, self.peer_apis):
            if part is not None:
                closers.append(part.close)
        for close in closers:
            try:
                await asyncio.wait_for(close(), timeout=5.0)
            except Exception:
                log.exception("controller: shutdown step failed")
        await self.supervisor.cancel_all()
        self.ctx.destroy(linger=0)
        gc.unfreeze()  # a process that starts controllers again (tests) must not keep every old one
        log.info("controller stopped")

    # ---- parts ------------------------------------------------------------------------------------
    def _start_subscribers(self, *, run: bool = True) -> None:
        for inst in self.cfg.instances:
            if inst.kv_events and not self.open_subscriber(inst, run=run):
                return

    def open_subscriber(self, inst: InstanceConfig, *, run: bool = True) -> bool:
        """Subscribe to ``inst``'s vLLM KV events, at start or when it joins a running controller.

        False when the subscriber module cannot load (no GPU tier at all); an endpoint that cannot
        open is logged and skipped."""
        try:
            from smetric_lmc.controller.vllm_events import VllmEventSubscriber
        except ImportError as exc:
            log.error("vLLM KV events unavailable (%s): routing without the GPU tier", exc)
            return False
        lim = self.cfg.limits
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
            return True
        self.subscribers[inst.id] = sub
        if run:
            self.supervisor.spawn(f"kv-events-{inst.id}", sub.run)
        log.info("vLLM events instance=%s endpoint=%s bind=%s", inst.id, sub.endpoint, sub.binds)
        return True

    async def _start_lmcache(self) -> None:
        lc = self.cfg.lmcache
        if not lc.enabled:
            return
        try:
            from smetric_lmc.controller.lmcache_server import LMCacheWorkerServer
        except ImportError as exc:
            log.error("LMCache worker server unavailable (%s): routing without the LMCache tier", exc)
            return
        lim = self.cfg.limits
        server = LMCacheWorkerServer(
            self.sink,
            pull_url=lc.pull_url,
            reply_url=lc.reply_url,
            heartbeat_url=lc.heartbeat_url,
            upstream_pull_url=lc.upstream_pull_url,
            upstream_reply_url=lc.upstream_reply_url,
            # through membership: instances may join after start (the drop-in router's discovery)
            resolve_instance=lambda lmcache_id, _worker_id: self.membership.lmcache_owner(lmcache_id),
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
                from smetric_lmc.controller.global_redis import RedisGlobalTier

                self.global_tier = RedisGlobalTier(
                    gs.url, self.index, model=model, world_size=gs.world_size,
                    reconcile_interval_s=gs.reconcile_interval_s,
                )
            elif gs.kind == "mooncake":
                from smetric_lmc.controller.global_mooncake import MooncakeGlobalTier, open_store_probe

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
        self.supervisor.spawn(f"global-{gs.kind}", self.global_tier.run)

    def _start_poller(self, targets: dict[str, str] | None = None) -> None:
        """Poll ``targets`` (instance id -> engine URL; default: the configured instances)."""
        if targets is None:
            targets = {i.id: i.http for i in self.cfg.instances}
        if self.cfg.load.metrics_poll_s <= 0 or not targets:
            return
        self.poller = EngineMetricsPoller(
            targets,
            self.load,
            interval_s=self.cfg.load.metrics_poll_s,
            grace_s=self.cfg.load.lost_done_grace_s,
            timeout_s=self.cfg.load.metrics_timeout_s,
            on_result=self.membership.poll_result,
            probe_s=self.cfg.load.breaker_probe_s,
            # the engines' inter-token latency teaches the decode slowdown per running request
            on_tpot=self._observe_tpot,
            # and LMCache's retrieve histogram the retrieve price (where the engine exports it)
            on_retrieve=self._observe_retrieve,
        )
        self.membership.prober = self.poller
        self.supervisor.spawn("engine-metrics", self.poller.run)

    def _observe_tpot(self, instance_id: str, tpot_s: float, running: float) -> None:
        feed = self.router.prices  # read at each poll: a policy reload may have replaced it
        if feed is not None:
            feed.book.observe_tpot(instance_id, tpot_s, running)

    def _observe_retrieve(self, instance_id: str, count: float, mean_s: float, mean_tokens: float) -> None:
        feed = self.router.prices
        if feed is not None:
            feed.on_retrieve(instance_id, count, mean_s, mean_tokens)

    async def _maintain_loop(self) -> None:
        # Bulk changes leave work behind, done here a bounded slice at a time: rows a clear
        # emptied (AllBlocksCleared, a stale TTL; ingest also frees a slice per store), in-flight
        # entries of instances taken out of routing, and of requests never reported done. Each
        # slice is its own loop turn: run back to back, a burst of lost requests coming due made
        # one long callback (bench/soak.py --slow-callbacks).
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


def _import_http() -> None:
    import aiohttp  # noqa: F401
    import aiohttp.web  # noqa: F401
    import prometheus_client.parser  # noqa: F401
