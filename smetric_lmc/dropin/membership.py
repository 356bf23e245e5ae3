"""Engines joining and leaving a running controller and gateway (Kubernetes pods come and go).

The controller and the gateway are built from a fixed instance list; the drop-in router learns its
engines while it runs. :class:`DropinController` and :class:`DropinGateway` add what that needs:
``add_instance`` / ``set_ready`` / ``remove_instance``. A pod seen but not Ready gets an index slot
at once (its LMCache worker registers and full-syncs while vLLM is still starting) and takes
requests only once Ready; a pod that leaves is dropped from routing and its index entries cleared.

The LMCache worker server is the controller's own (``LMCacheWorkerServer``), built through its
constructor with a resolver that follows this membership: a worker's ``lmcache_instance_id`` is
the pod name in the production-stack chart (``LMCACHE_LMCACHE_INSTANCE_ID`` from
``metadata.name``), which is the instance id here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from smetric_lmc.config import InstanceConfig
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.gateway import Gateway, _error

log = logging.getLogger(__name__)


class DropinController(ControllerApp):
    """A ControllerApp whose instances may change while it runs."""

    def __init__(self, *args: Any, lmcache_ids: dict[str, str] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        # lmcache_instance_id -> instance id; an id that names an instance maps to it as well.
        self._lmcache_ids = dict(lmcache_ids or {})
        self.membership_changes = {"added": 0, "ready": 0, "removed": 0}
        self._closing_subs: set[asyncio.Task[None]] = set()

    def resolve_lmcache(self, lmcache_id: str, _worker_id: int) -> str | None:
        iid = self._lmcache_ids.get(lmcache_id, lmcache_id)
        return iid if iid in self._known else None

    async def _start_lmcache(self) -> None:
        # The base class maps workers through the start-time instance list; here the map follows
        # membership. Same server, same limits, built through its constructor.
        lc = self.cfg.lmcache
        if not lc.enabled:
            return
        from smetric_lmc.controller.lmcache_server import LMCacheWorkerServer

        lim = self.cfg.limits
        server = LMCacheWorkerServer(
            self.sink, pull_url=lc.pull_url, reply_url=lc.reply_url, heartbeat_url=lc.heartbeat_url,
            upstream_pull_url=lc.upstream_pull_url, upstream_reply_url=lc.upstream_reply_url,
            resolve_instance=self.resolve_lmcache, max_frame_bytes=lim.lmcache_max_frame_bytes,
            max_workers=lim.lmcache_max_workers, max_sources_per_instance=lim.lmcache_max_sources_per_instance,
            worker_timeout_s=lim.lmcache_worker_timeout_s, max_sync_batches=lim.lmcache_max_sync_batches,
            worker=self.service.worker,
        )
        await server.start()
        self.lmcache_server = server

    # ---- membership -----------------------------------------------------------------------------
    def has_instance(self, iid: str) -> bool:
        return iid in self._known

    def add_instance(self, inst: InstanceConfig, *, ready: bool = True) -> bool:
        """Start tracking ``inst`` (idempotent: False when already known). Not ready: indexed, not routed."""
        if inst.id in self._known:
            if ready:
                self.set_ready(inst.id)
            return False
        self.cfg = msgspec.structs.replace(self.cfg, instances=[*self.cfg.instances, inst])
        self._ids.append(inst.id)
        self._known = frozenset(self._ids)
        self._trips.setdefault(inst.id, 0)
        self.core._instances[inst.id] = inst
        if inst.lmcache_instance_id:
            self._lmcache_ids[inst.lmcache_instance_id] = inst.id
        self._not_ready = getattr(self, "_not_ready", set())
        if not ready:
            self._not_ready.add(inst.id)
        self._register(inst.id, routable=ready and not self._liveness_enforced)
        if inst.kv_events:
            self._subscribe(inst)
        if ready:  # a starting engine's /metrics is not polled: it would only trip its breaker
            self._watch_metrics(inst)
        self.membership_changes["added"] += 1
        log.info("instance added instance=%s endpoint=%s ready=%s", inst.id, inst.http, ready)
        return True

    def set_ready(self, iid: str) -> None:
        not_ready = getattr(self, "_not_ready", set())
        if iid not in not_ready:
            return
        not_ready.discard(iid)
        self.membership_changes["ready"] += 1
        if not self._liveness_enforced:
            self._register(iid)
        self._watch_metrics(self.core._instances[iid])  # with liveness: routable once /metrics answers
        log.info("instance ready instance=%s", iid)

    def _seen(self, iid: str, *, probe: bool = False) -> None:
        if iid in getattr(self, "_not_ready", ()):
            self._last_seen[iid] = time.monotonic()
            return  # alive but not Ready: Kubernetes says when it takes requests
        super()._seen(iid, probe=probe)

    def remove_instance(self, iid: str) -> bool:
        """Stop routing to ``iid`` and forget what it held (False when unknown)."""
        if iid not in self._known:
            return False
        self._ids.remove(iid)
        self._known = frozenset(self._ids)
        self.cfg = msgspec.structs.replace(self.cfg, instances=[i for i in self.cfg.instances if i.id != iid])
        self._routable.discard(iid)
        self._open.pop(iid, None)
        getattr(self, "_not_ready", set()).discard(iid)
        self.load.remove_instance(iid)
        sub = self.subscribers.pop(iid, None)
        if sub is not None:  # its run() ends once closed, so its supervisor does not restart it
            task = asyncio.get_running_loop().create_task(sub.close())
            self._closing_subs.add(task)
            task.add_done_callback(self._closing_subs.discard)
        self.index.drop_instance(iid)
        self.core._instances.pop(iid, None)
        self.core.set_silent(self._known - self._routable)
        self._last_seen.pop(iid, None)
        if self.poller is not None:
            for table in (self.poller.targets, self.poller.state, self.poller._due):
                table.pop(iid, None)
        self.membership_changes["removed"] += 1
        log.info("instance removed instance=%s", iid)
        return True

    def _subscribe(self, inst: InstanceConfig) -> None:
        """vLLM KV events of a joining engine (its GPU tier), opened as the controller opens them at
        start: ``_start_subscribers`` run over this one instance."""
        cfg = self.cfg
        self.cfg = msgspec.structs.replace(cfg, instances=[inst])
        try:
            self._start_subscribers()
        finally:
            self.cfg = cfg

    def _watch_metrics(self, inst: InstanceConfig) -> None:
        if self.cfg.load.metrics_poll_s <= 0:
            return
        if self.poller is None:
            self._start_poller()  # the first instance of a router that started with none
            return
        from smetric_lmc.controller.engine_metrics import PollState

        self.poller.targets[inst.id] = inst.http.rstrip("/") + "/metrics"
        self.poller.state[inst.id] = PollState()
        self.poller._due[inst.id] = 0.0  # polled at the loop's next turn
        self.poller._wake.set()


class DropinGateway(Gateway):
    """The bundled gateway, with instances that may change and a 503 while there are none."""

    def __init__(self, cfg: Any, *args: Any, **kw: Any) -> None:
        placeholder = not cfg.instances
        if placeholder:  # the gateway insists on one instance; a discovered cluster may start empty
            cfg = msgspec.structs.replace(cfg, instances=[InstanceConfig(id="-", http="http://127.0.0.1:9")])
        super().__init__(cfg, *args, **kw)
        if placeholder:
            self.instances.clear()
            self._by_id.clear()

    def add_instance(self, inst: InstanceConfig) -> None:
        if inst.id in self._by_id:
            return
        self.instances.append(inst)
        self._by_id[inst.id] = inst
        if self._reader is not None:
            url = inst.http.rstrip("/")
            self._reader._urls.append(url)
            self._reader._latency[url] = 0.0

    def remove_instance(self, iid: str) -> None:
        inst = self._by_id.pop(iid, None)
        if inst is None:
            return
        self.instances[:] = [i for i in self.instances if i.id != iid]
        if self._reader is not None:
            url = inst.http.rstrip("/")
            if url in self._reader._urls:
                self._reader._urls.remove(url)
            self._reader._latency.pop(url, None)

    async def _proxy(self, request: Any, kind: Any, path: str) -> Any:
        if not self.instances:
            return _error(503, "no serving engine discovered yet", "service_unavailable")
        return await super()._proxy(request, kind, path)

    async def _startup(self, app: Any) -> None:
        await super()._startup(app)
        assert self._reader is not None
        self._reader._urls[:] = [i.http.rstrip("/") for i in self.instances]
        self._reader._latency = dict.fromkeys(self._reader._urls, 0.0)
