"""Engines joining and leaving a running controller and gateway (Kubernetes pods come and go).

The controller and the gateway are built from a fixed instance list; the drop-in router learns its
engines while it runs. :class:`DropinController` and :class:`DropinGateway` add what that needs:
``add_instance`` / ``set_ready`` / ``remove_instance``. A pod seen but not Ready gets an index slot
at once (its LMCache worker registers and full-syncs while vLLM is still starting) and takes
requests only once Ready; a pod that leaves is dropped from routing and its index entries cleared.

The LMCache worker server is the controller's own; it resolves workers through membership, so a
joining pod's worker is known at once: its ``lmcache_instance_id`` is the pod name in the
production-stack chart (``LMCACHE_LMCACHE_INSTANCE_ID`` from ``metadata.name``), which is the
instance id here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from smetric_lmc.config import InstanceConfig
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.gateway import Gateway

log = logging.getLogger(__name__)


class DropinController(ControllerApp):
    """A ControllerApp whose instances may change while it runs (membership: ``Membership.add`` /
    ``set_ready`` / ``remove``; here the parts that follow an instance: KV events and /metrics)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.membership_changes = {"added": 0, "ready": 0, "removed": 0}
        self._closing_subs: set[asyncio.Task[None]] = set()

    def has_instance(self, iid: str) -> bool:
        return iid in self.membership.known

    def add_instance(self, inst: InstanceConfig, *, ready: bool = True) -> bool:
        """Start tracking ``inst`` (idempotent: False when already known). Not ready: indexed, not routed."""
        if not self.membership.add(inst, ready=ready):
            if ready:
                self.set_ready(inst.id)
            return False
        if inst.kv_events:
            self.open_subscriber(inst)
        if ready:  # a starting engine's /metrics is not polled: it would only trip its breaker
            self._watch_metrics(inst)
        self.membership_changes["added"] += 1
        log.info("instance added instance=%s endpoint=%s ready=%s", inst.id, inst.http, ready)
        return True

    def set_ready(self, iid: str) -> None:
        if not self.membership.set_ready(iid):
            return
        self.membership_changes["ready"] += 1
        self._watch_metrics(self.membership.instances[iid])  # with liveness: routable once /metrics answers
        log.info("instance ready instance=%s", iid)

    def remove_instance(self, iid: str) -> bool:
        """Stop routing to ``iid`` and forget what it held (False when unknown)."""
        if not self.membership.remove(iid):
            return False
        sub = self.subscribers.pop(iid, None)
        if sub is not None:  # its run() ends once closed, so its supervisor does not restart it
            task = asyncio.get_running_loop().create_task(sub.close())
            self._closing_subs.add(task)
            task.add_done_callback(self._closing_subs.discard)
        if self.poller is not None:
            self.poller.remove_target(iid)
        self.membership_changes["removed"] += 1
        log.info("instance removed instance=%s", iid)
        return True

    def _watch_metrics(self, inst: InstanceConfig) -> None:
        if self.poller is None:
            self._start_poller({inst.id: inst.http})  # the first instance of a router that started with none
        else:
            self.poller.add_target(inst.id, inst.http)


class DropinGateway(Gateway):
    """The bundled gateway, started with no instance if discovery has found none yet (instances
    join and leave through ``Gateway.add_instance`` / ``remove_instance``; none: 503)."""

    def __init__(self, cfg: Any, *args: Any, **kw: Any) -> None:
        placeholder = not cfg.instances
        if placeholder:  # the gateway insists on one instance; a discovered cluster may start empty
            cfg = msgspec.structs.replace(cfg, instances=[InstanceConfig(id="-", http="http://127.0.0.1:9")])
        super().__init__(cfg, *args, **kw)
        if placeholder:
            self.remove_instance("-")
