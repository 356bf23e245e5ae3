"""Prometheus metrics and ``/healthz`` of the controller.

Counters that the route path updates live in ``ControllerMetrics`` (its own registry, so tests
and several controllers in one process never collide). Everything that already exists as state
elsewhere (per-instance load, event-subscriber stats, index sizes) is read at scrape time by a
collector instead of being copied on every event.

Names share one scheme with the gateway's (``smetric_lmc/gateway_metrics.py``): ``smetric_``
prefix, counters ``_total``, seconds and tokens as units. The serving instance is the label
``backend``: ``instance`` is the label Prometheus itself attaches to every scraped series.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when the server starts (controller/app.py does it off the loop)
    from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from smetric_lmc.wire import Reason, RouteDecision, TurnSource

# No `<name>_created` series beside every counter and histogram: timestamps nobody graphs.
disable_created_metrics()

log = logging.getLogger(__name__)

#: Route latency buckets: the decision itself is tens of microseconds, so the scale is µs.
LATENCY_BUCKETS_S: tuple[float, ...] = tuple(
    us * 1e-6 for us in (10, 25, 50, 100, 150, 200, 300, 500, 750, 1000, 2500, 5000, 10000, 50000)
)

#: vLLM's KV event types (``smetric_kv_events_total{kind}``).
KV_EVENT_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_BLOCK_OPS = {"blocks_stored": "stored", "blocks_removed": "removed"}
_KNOWN_KEYS = (*sorted(KV_EVENT_TYPES), *_BLOCK_OPS, "unknown", "malformed", "non_gpu", "other_group")

_FALLBACK_KIND = {
    Reason.OVERLOADED: "overloaded",
    Reason.EVICTED: "evicted",
    Reason.NO_INSTANCES: "no_instances",
}


class ControllerMetrics:
    """Counters and the latency histogram fed by the route service."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter(
            "smetric_route_decisions", "Route decisions by policy and reason", ["policy", "reason"], registry=r
        )
        self.hit_tokens = Counter(
            "smetric_route_hit_tokens",
            "Prompt tokens found cached, by tier: local on the chosen instance, global store",
            ["tier"],
            registry=r,
        )
        self.funnel = Counter(
            "smetric_cache_funnel_tokens",
            "Cache-loss funnel: est_hit (what the session should have cached) >= best_local "
            "(best local hit anywhere) >= chosen_local (hit on the chosen instance)",
            ["stage"],
            registry=r,
        )
        self.prompt_tokens = Counter("smetric_route_prompt_tokens", "Prompt tokens of routed requests", registry=r)
        self.fallbacks = Counter(
            "smetric_route_fallbacks",
            "Requests not routed by the cache rule: overloaded / evicted fallbacks, index_not_ready "
            "(no KV data indexed since start: load balance), no_instances",
            ["kind"],
            registry=r,
        )
        self.errors = Counter("smetric_route_errors", "Error replies by code", ["code"], registry=r)
        self.turn_sources = Counter(
            "smetric_route_turn_source",
            "Routes by where their turn came from: request (given), est_hit (none given, history size "
            "given), index_follow_up / index_first_turn (none given, inferred from the index)",
            ["source"],
            registry=r,
        )
        self.done = Counter("smetric_done_reports", "Done reports by whether they released load", ["released", "ok"], registry=r)
        self.latency = Histogram(
            "smetric_route_latency_seconds",
            "Route handling time inside the controller (decode to encoded reply)",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        # Resolving label children costs a lock and a dict lookup; routes reuse a handful of them.
        self._decision_children: dict[tuple[str, str], Any] = {}
        self._local = self.hit_tokens.labels(tier="local_chosen")
        self._global = self.hit_tokens.labels(tier="global")
        self._est = self.funnel.labels(stage="est_hit")
        self._best = self.funnel.labels(stage="best_local")
        self._chosen = self.funnel.labels(stage="chosen_local")
        self._observe_latency = self.latency.observe
        # Fallback series exist (at 0) from the start: "no fallbacks" reads 0, not "no data".
        for kind in (*_FALLBACK_KIND.values(), "index_not_ready"):
            self.fallbacks.labels(kind=kind)
        self._turn_source = {t: self.turn_sources.labels(source=t.value) for t in TurnSource}

    def observe_route(self, routed: RouteDecision, latency_s: float, *, degraded: bool = False) -> None:
        key = (routed.policy, routed.reason.value)
        child = self._decision_children.get(key)
        if child is None:
            child = self._decision_children[key] = self.decisions.labels(policy=key[0], reason=key[1])
        child.inc()
        self._local.inc(routed.local_hit_tokens)
        self._global.inc(routed.global_hit_tokens)
        self._est.inc(routed.est_hit_tokens)
        self._best.inc(routed.best_local_hit_tokens)
        self._chosen.inc(routed.local_hit_tokens)
        self.prompt_tokens.inc(routed.prompt_tokens)
        kind = _FALLBACK_KIND.get(routed.reason)
        if kind is not None:
            self.fallbacks.labels(kind=kind).inc()
        if degraded:
            self.fallbacks.labels(kind="index_not_ready").inc()
        self._turn_source[routed.turn_source].inc()
        self._observe_latency(latency_s)

    def observe_error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def observe_done(self, released: bool, ok: bool = True) -> None:
        self.done.labels(released=str(released).lower(), ok=str(ok).lower()).inc()

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# ---- scrape-time state --------------------------------------------------------------------------


@dataclass(slots=True)
class InstanceState:
    id: str
    routable: bool
    in_flight: int
    unprefilled_tokens: int
    seconds_since_seen: float | None = None
    engine_metrics_ok: bool | None = None  # None: not polled
    engine_poll_failures: int = 0
    healed_done: int = 0
    breaker_open: str | None = None  # why its breaker is open; None while closed
    breaker_trips: int = 0


@dataclass(slots=True)
class SubscriberState:
    instance: str
    events: Mapping[str, int]
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    unfilled_gaps: int = 0
    restarts: int = 0
    decode_errors: int = 0
    bad_frames: int = 0
    oversize_batches: int = 0
    offloaded: int = 0
    large_on_loop: int = 0
    worker_failures: int = 0
    lag_s: float | None = None


@dataclass(slots=True)
class StateView:
    instances: list[InstanceState] = field(default_factory=list)
    subscribers: list[SubscriberState] = field(default_factory=list)
    index_ready: bool = False
    index_sizes: Mapping[str, int] = field(default_factory=dict)
    index_stats: Mapping[str, int] = field(default_factory=dict)
    global_available: bool | None = None  # None: no global tier configured
    components: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # numeric stats per part


class StateCollector(Collector):
    """Turns the controller's ``StateView``, taken at scrape time, into metric families."""

    def __init__(self, view: Callable[[], StateView]) -> None:
        self._view = view

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on state; unchecked registration is fine for a private registry

    def collect(self) -> Iterable[Metric]:
        try:
            view = self._view()
        except Exception:  # a scrape must never take the controller down
            log.exception("metrics: state view failed")
            return
        yield from _instance_families(view.instances)
        yield from _subscriber_families(view.subscribers)
        ready = GaugeMetricFamily("smetric_index_ready", "1 once the index holds local-tier data since start")
        ready.add_metric([], 1.0 if view.index_ready else 0.0)
        yield ready
        sizes = GaugeMetricFamily("smetric_index_entries", "Entries in the index by structure", labels=["kind"])
        for k, v in view.index_sizes.items():
            sizes.add_metric([k], float(v))
        yield sizes
        istats = CounterMetricFamily("smetric_index_updates", "Index updates by kind", labels=["kind"])
        for k, v in view.index_stats.items():
            istats.add_metric([k], float(v))
        yield istats
        if view.global_available is not None:
            g = GaugeMetricFamily("smetric_global_store_available", "1 while the global store is reachable")
            g.add_metric([], 1.0 if view.global_available else 0.0)
            yield g
        comp = GaugeMetricFamily(
            "smetric_component_stat", "Numeric stats of controller parts", labels=["component", "stat"]
        )
        for name, stats in view.components.items():
            for k, v in stats.items():
                if isinstance(v, bool | int | float):
                    comp.add_metric([name, k], float(v))
        yield comp


def _instance_families(rows: list[InstanceState]) -> Iterable[Metric]:
    routable = GaugeMetricFamily("smetric_instance_routable", "1 while the instance takes requests", labels=["backend"])
    in_flight = GaugeMetricFamily("smetric_instance_in_flight", "In-flight requests (ours + external)", labels=["backend"])
    unpre = GaugeMetricFamily("smetric_instance_unprefilled_tokens", "Routed prompt tokens not yet prefilled", labels=["backend"])
    seen = GaugeMetricFamily("smetric_instance_seconds_since_seen", "Seconds since the last sign of life", labels=["backend"])
    ok = GaugeMetricFamily("smetric_instance_engine_metrics_ok", "1 if the last engine /metrics poll succeeded", labels=["backend"])
    fails = CounterMetricFamily("smetric_instance_engine_poll_failures", "Failed engine /metrics polls", labels=["backend"])
    healed = CounterMetricFamily("smetric_instance_healed_done", "In-flight entries released by engine metrics", labels=["backend"])
    for r in rows:
        routable.add_metric([r.id], 1.0 if r.routable else 0.0)
        in_flight.add_metric([r.id], float(r.in_flight))
        unpre.add_metric([r.id], float(r.unprefilled_tokens))
        if r.seconds_since_seen is not None:
            seen.add_metric([r.id], r.seconds_since_seen)
        if r.engine_metrics_ok is not None:
            ok.add_metric([r.id], 1.0 if r.engine_metrics_ok else 0.0)
            fails.add_metric([r.id], float(r.engine_poll_failures))
            healed.add_metric([r.id], float(r.healed_done))
    return [routable, in_flight, unpre, seen, ok, fails, healed]


def _subscriber_families(subs: list[SubscriberState]) -> Iterable[Metric]:
    events = CounterMetricFamily("smetric_kv_events", "vLLM KV events received, by event type", labels=["backend", "kind"])
    blocks = CounterMetricFamily("smetric_kv_event_blocks", "Blocks applied to the index from vLLM KV events",
                                 labels=["backend", "op"])
    skipped = CounterMetricFamily("smetric_kv_events_skipped", "vLLM KV events not applied, by reason",
                                  labels=["backend", "reason"])
    batches = CounterMetricFamily("smetric_kv_event_batches", "vLLM KV event batches applied", labels=["backend"])
    gaps = CounterMetricFamily("smetric_kv_event_gaps", "Sequence gaps seen", labels=["backend"])
    replays = CounterMetricFamily("smetric_kv_event_replays", "Replay requests", labels=["backend", "result"])
    lost = CounterMetricFamily("smetric_kv_event_unfilled_gaps", "Gaps replay could not fill (instance cleared)", labels=["backend"])
    restarts = CounterMetricFamily("smetric_kv_event_restarts", "Engine restarts detected", labels=["backend"])
    bad = CounterMetricFamily("smetric_kv_event_bad_messages", "Undecodable or misframed messages", labels=["backend", "kind"])
    large = CounterMetricFamily(
        "smetric_kv_event_large_batches",
        "Batches over the offload size: decoded in the frame worker, on the event loop (no worker), or lost "
        "when the worker failed (the gap is replayed)", labels=["backend", "handled"])
    lag = GaugeMetricFamily("smetric_kv_event_lag_seconds", "Receive time minus event batch timestamp", labels=["backend"])
    for s in subs:
        # The subscriber tallies event types, block counts and skip reasons in one dict (non-zero
        # keys only); each goes to its own family, every known key from 0, so that no sum over a
        # label mixes events with blocks and a first skip is a change, not a new series.
        for key in {**dict.fromkeys(_KNOWN_KEYS, 0), **s.events}:
            n = float(s.events.get(key, 0))
            if key in _BLOCK_OPS:
                blocks.add_metric([s.instance, _BLOCK_OPS[key]], n)
            elif key in KV_EVENT_TYPES:
                events.add_metric([s.instance, key], n)
            else:
                skipped.add_metric([s.instance, key], n)
        batches.add_metric([s.instance], float(s.batches))
        gaps.add_metric([s.instance], float(s.gaps))
        replays.add_metric([s.instance, "requested"], float(s.replays))
        replays.add_metric([s.instance, "failed"], float(s.replay_failures))
        lost.add_metric([s.instance], float(s.unfilled_gaps))
        restarts.add_metric([s.instance], float(s.restarts))
        bad.add_metric([s.instance, "decode"], float(s.decode_errors))
        bad.add_metric([s.instance, "framing"], float(s.bad_frames))
        bad.add_metric([s.instance, "oversize"], float(s.oversize_batches))
        for handled, n in (("worker", s.offloaded), ("loop", s.large_on_loop), ("worker_failed", s.worker_failures)):
            large.add_metric([s.instance, handled], float(n))
        if s.lag_s is not None:
            lag.add_metric([s.instance], s.lag_s)
    return [events, blocks, skipped, batches, gaps, replays, lost, restarts, bad, large, lag]


# ---- HTTP ----------------------------------------------------------------------------------------


class MetricsServer:
    """``/metrics`` (Prometheus text) and ``/healthz`` (JSON; 200 when healthy, else 503)."""

    def __init__(
        self,
        metrics: ControllerMetrics,
        health: Callable[[], dict[str, Any]],
        host: str = "127.0.0.1",
        port: int = 9600,
    ) -> None:
        self._metrics = metrics
        self._health = health
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/metrics", self._get_metrics)
        app.router.add_get("/healthz", self._get_health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self._runner = runner
        sockets = getattr(site._server, "sockets", None) or []  # noqa: SLF001 - only way to learn port 0's pick
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info("metrics listening host=%s port=%d", self.host, self.port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _get_metrics(self, _req: web.Request) -> web.Response:
        from aiohttp import web

        body = self._metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _get_health(self, _req: web.Request) -> web.Response:
        from aiohttp import web

        try:
            health = self._health()
        except Exception as exc:
            log.exception("healthz failed")
            health = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        status = 200 if health.get("ok") else 503
        return web.Response(text=json.dumps(health), status=status, content_type="application/json")
