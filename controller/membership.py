"""Who may be routed to: the one owner of instance membership.

Which configured instances exist, which are alive (signs of life: KV events, LMCache worker
messages, successful engine-metrics polls), which have their circuit breaker open or half-open,
and which are silent and therefore stale. Ingest reports signs of life here (through
``IngestSink``), the route service reads ``candidates`` from here, and health, stats and metrics
render ``rows()``.

Liveness: an instance silent for ``load.instance_timeout_s`` leaves routing and its in-flight load
is forgotten, but its index entries are kept and marked stale (``TierIndex.mark_stale``): a silent
engine usually still holds its KV cache, and dropping the entries would make every session on it
look evicted when it returns. Its next sign of life makes it routable again. The rule is enforced
only when a source that speaks while the engine is idle exists (engine-metrics polling or LMCache
heartbeats): an idle engine emits no KV events.

Circuit breaker: under the same condition an instance enters routing only after its first sign of
life. A failed engine-metrics poll, or a ``done`` whose ``error`` is ``connect``, takes it out at
once ("open"), index kept and marked stale. With a poller, only the poller's successful probe
closes it again (the engine's HTTP server answering); without one, it is re-admitted
("half-open") after ``load.breaker_probe_s``, doubling per repeated trip.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from smetric_lmc.backoff import doubled
from smetric_lmc.config import InstanceConfig
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker

log = logging.getLogger(__name__)


class Prober(Protocol):
    """What re-probes an instance whose breaker is open (the engine-metrics poller)."""

    def probe_now(self, instance_id: str) -> None: ...


@dataclass(slots=True, frozen=True)
class Member:
    """One configured instance as membership sees it at one instant."""

    id: str
    routable: bool
    seconds_since_seen: float
    breaker_open: str | None  # why it was taken out; None while closed
    breaker_trips: int


class Membership:
    def __init__(
        self,
        instances: Sequence[InstanceConfig],
        index: TierIndex,
        load: LoadTracker,
        *,
        disaggregated: bool = False,
        liveness_enforced: bool = False,
        timeout_s: float = 0.0,
        breaker_probe_s: float = 1.0,
    ) -> None:
        self.index = index
        self.load = load
        self.ids = [i.id for i in instances]
        self.known = frozenset(self.ids)
        # In PD disaggregation only prefill-capable instances take new requests.
        self._roles_ok: frozenset[str] | None = (
            frozenset(i.id for i in instances if i.role in ("prefill", "both")) if disaggregated else None
        )
        self.liveness_enforced = liveness_enforced
        self.timeout_s = timeout_s
        self.breaker_probe_s = breaker_probe_s
        self.prober: Prober | None = None  # set once the engine-metrics poller runs
        self.closed = False
        self._last_seen: dict[str, float] = {}
        self._routable: set[str] = set(self.ids)
        self._open: dict[str, str] = {}  # breaker open: instance -> why it was taken out
        self._trips: dict[str, int] = dict.fromkeys(self.ids, 0)
        #: What the router may pick from: None is every instance registered in the index (the
        #: fast path); a list narrows it. Recomputed on every membership change, read per route.
        self.candidates: list[str] | None = None
        self._update_candidates()

    # ---- reads ------------------------------------------------------------------------------------
    def is_routable(self, iid: str) -> bool:
        return iid in self._routable

    def routable_ids(self) -> list[str]:
        """Registered instances the router may pick, in the index's order."""
        ids = self.index.instances
        if self.candidates is not None:
            allowed = set(self.candidates)
            ids = [i for i in ids if i in allowed]
        return ids

    def breaker(self, iid: str) -> str | None:
        """Why ``iid``'s breaker is open; None while it is closed."""
        return self._open.get(iid)

    def rows(self, now: float | None = None) -> list[Member]:
        """Every configured instance, in configuration order: the one state view of membership."""
        now = time.monotonic() if now is None else now
        return [
            Member(
                id=iid,
                routable=iid in self._routable,
                seconds_since_seen=round(now - self._last_seen.get(iid, now), 3),
                breaker_open=self._open.get(iid),
                breaker_trips=self._trips.get(iid, 0),
            )
            for iid in self.ids
        ]

    # ---- changes ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Register every configured instance; routable at once unless liveness is enforced."""
        if self.liveness_enforced:
            self._routable.clear()
        for iid in self.ids:
            self._register(iid, routable=not self.liveness_enforced)

    def seen(self, iid: str, *, probe: bool = False) -> None:
        """A sign of life from ``iid`` (``probe``: the poller's engine probe succeeded)."""
        if iid not in self.known:
            return
        self._last_seen[iid] = time.monotonic()
        if iid in self._routable:
            return
        if iid in self._open:
            if not probe and self.prober is not None:
                return  # an open breaker closes on the engine's HTTP probe only
            log.info("instance back: breaker closed, routable again instance=%s was=%s", iid, self._open.pop(iid))
        else:
            log.info("instance alive: routable instance=%s", iid)
        self._register(iid)

    def poll_result(self, iid: str, ok: bool) -> None:
        """The engine-metrics poller's verdict on one poll of ``iid``."""
        if ok:
            self.seen(iid, probe=True)
        else:
            self.trip(iid, "metrics_poll_failed")

    def engine_unreachable(self, iid: str, kind: str) -> None:
        """A gateway could not reach ``iid`` (``done`` with an ``error``): out of routing at once."""
        if kind != "connect" or iid not in self.known:
            return
        self.trip(iid, "gateway_connect_failed")
        if self.prober is not None:
            self.prober.probe_now(iid)

    def trip(self, iid: str, why: str) -> None:
        """Open the breaker: no new requests, in-flight load forgotten, index kept and marked stale."""
        if iid in self._open:
            return
        self._open[iid] = why
        self._trips[iid] = self._trips.get(iid, 0) + 1
        self.index.mark_stale(iid)
        if iid in self._routable:
            self._leave(iid)
        log.warning("instance unreachable: breaker open, out of routing, index kept as stale instance=%s why=%s",
                    iid, why)
        if self.prober is None:  # nothing probes it: half-open after a doubling cool-down
            delay = doubled(self.breaker_probe_s, self._trips[iid] - 1, max_doublings=6)
            asyncio.get_running_loop().call_later(delay, self._half_open, iid)

    def _half_open(self, iid: str) -> None:
        if self._open.pop(iid, None) is not None and not self.closed:
            log.info("instance half-open: routable again until it fails instance=%s", iid)
            self._register(iid)

    def check_liveness(self, now: float | None = None) -> list[str]:
        """Take instances silent for longer than the timeout out of routing; returns their ids.

        Their index entries stay, marked stale (see the module docstring)."""
        now = time.monotonic() if now is None else now
        dropped = []
        for iid in list(self._routable):
            silent = now - self._last_seen.get(iid, now)
            if silent > self.timeout_s:
                self.index.mark_stale(iid)
                self._leave(iid)
                dropped.append(iid)
                log.warning("instance silent: leaves routing, index kept as stale instance=%s silent_s=%.1f "
                            "timeout_s=%.1f", iid, silent, self.timeout_s)
        return dropped

    async def run_liveness(self) -> None:
        period = max(0.05, min(1.0, self.timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            self.check_liveness()

    def _register(self, iid: str, *, routable: bool = True) -> None:
        self.index.register_instance(iid)
        self.load.add_instance(iid)
        if routable:
            self._routable.add(iid)
        self._last_seen[iid] = time.monotonic()
        self._update_candidates()

    def _leave(self, iid: str) -> None:
        self._routable.discard(iid)
        self.load.remove_instance(iid)
        self._update_candidates()

    def _update_candidates(self) -> None:
        silent = self.known - self._routable
        if self._roles_ok is None and not silent:
            self.candidates = None
            return
        self.candidates = [i for i in self.ids
                           if i not in silent and (self._roles_ok is None or i in self._roles_ok)]


class IngestSink:
    """The index as event sources see it: every per-instance update is also a sign of life.

    An update for an instance that was dropped for silence registers it again first (through
    ``Membership.seen``), so the update lands instead of being counted as an unknown instance.
    """

    def __init__(self, index: TierIndex, membership: Membership) -> None:
        self._index = index
        self._seen = membership.seen

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
