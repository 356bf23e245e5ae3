"""Prometheus metrics of ``smetric gateway``, served on the gateway's own port at ``/metrics``.

Names share one scheme with the controller's (``controller/metrics.py``): the ``smetric_``
prefix, then the part (``gateway_``), counters ending ``_total``, durations in seconds, sizes in
tokens. Labels stay bounded: ``backend`` is a configured instance id (or ``none`` when the
gateway answered itself; not ``instance``, which Prometheus sets to the scrape target), ``reason``
a route reason, ``status`` an HTTP status code.

The gateway's half of the cache-loss funnel sits beside the controller's: the controller's
predicted local hit for the chosen instance (``predicted_local``) next to what the engine then
reported as ``prompt_tokens_details.cached_tokens`` (``engine_cached``). Both are counted only
over requests whose engine reported cached tokens, so the two stages compare like with like; the
others are counted in ``smetric_gateway_cached_tokens_unreported_total`` (vLLM needs
``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# No `<name>_created` series beside every counter and histogram: timestamps nobody graphs.
disable_created_metrics()

#: Controller round trip over ZMQ: ~0.1-1 ms on loopback, up to the route timeout when it is down.
RTT_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
#: TTFT and end-to-end latency: milliseconds (cache hit, short prompt) to minutes (long agent turn).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0,
)
#: Time per output token after the first.
TPOT_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

NO_INSTANCE = "none"
FUNNEL_STAGES = ("prompt", "est_hit", "predicted_local", "engine_cached")
#: Where a client request is now: reading its body and tokenizing the prompt, asking the
#: controller, waiting for the engine's response headers (connect included), streaming the answer.
REQUEST_STAGES = ("read", "route", "upstream", "respond")
TOKENIZE_OUTCOMES = ("timeout", "error", "status", "rejected")


@dataclass(slots=True, frozen=True)
class AttemptRecord:
    """What one attempt on one instance measured (the gateway fills it when the attempt ends)."""

    instance: str
    ok: bool
    stream: bool
    started: float
    finished: float
    first_byte: float | None
    prompt_tokens: int
    output_tokens: int
    est_hit_tokens: int | None  # None: no turn history was estimated (counted as 0)
    predicted_local_tokens: int
    cached_tokens: int | None  # None: the engine did not report it


class GatewayMetrics:
    """Counters, gauges and histograms the gateway updates on its request path."""

    def __init__(self, instances: Sequence[str] = (), registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        # each labelled series once looked up: prometheus_client's labels() checks and locks on every
        # call, and a request touches ~20 series (no series is ever removed, so none goes stale)
        self._series: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "smetric_gateway_requests",
            "Client requests answered, by the instance that served them, route reason and HTTP status",
            ["backend", "reason", "status"], registry=r,
        )
        self.upstream_failures = Counter(
            "smetric_gateway_upstream_failures",
            "Attempts that failed on an instance: before_response (retried elsewhere) or mid_response "
            "(client connection aborted)",
            ["backend", "stage"], registry=r,
        )
        self.retries = Counter(
            "smetric_gateway_retries", "Requests retried on another instance, by the instance that failed",
            ["backend"], registry=r,
        )
        self.fallback_routes = Counter(
            "smetric_gateway_fallback_routes",
            "Requests routed without the controller's decision (gateway round-robin), by cause",
            ["cause"], registry=r,
        )
        self.index_not_ready = Counter(
            "smetric_gateway_index_not_ready_routes",
            "Requests the controller routed by load balance because its index had no KV data yet",
            registry=r,
        )
        self.route_rtt = Histogram(
            "smetric_gateway_route_rtt_seconds",
            "Controller round trip for a route decision, as the gateway sees it, by outcome",
            ["outcome"], buckets=RTT_BUCKETS_S, registry=r,
        )
        self.routing = Histogram(
            "smetric_gateway_routing_seconds",
            "The gateway's own time before a request reaches its engine: from the handler's start to "
            "the decision (reading and tokenizing the prompt, the controller's answer), the first attempt",
            buckets=RTT_BUCKETS_S, registry=r,
        )
        self.controller_up = Gauge(
            "smetric_gateway_controller_up", "1 while the controller answers route requests", registry=r
        )
        self.controller_up.set(1)
        self.ttft = Histogram(
            "smetric_gateway_ttft_seconds", "Time to first streamed byte (streaming requests), per instance",
            ["backend"], buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.tpot = Histogram(
            "smetric_gateway_tpot_seconds",
            "Time per output token after the first (streaming requests with >= 2 output tokens)",
            ["backend"], buckets=TPOT_BUCKETS_S, registry=r,
        )
        self.duration = Histogram(
            "smetric_gateway_request_duration_seconds", "End-to-end time of successful attempts, per instance",
            ["backend"], buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.funnel = Counter(
            "smetric_gateway_cache_funnel_tokens",
            "Prompt tokens by stage, over requests whose engine reported cached tokens: prompt >= est_hit "
            "(history the gateway expected cached) ; predicted_local (the controller's local hit on the "
            "chosen instance) vs engine_cached (prompt_tokens_details.cached_tokens)",
            ["backend", "stage"], registry=r,
        )
        self.cached_unreported = Counter(
            "smetric_gateway_cached_tokens_unreported",
            "Successful requests whose engine reported no cached_tokens (not in the funnel)",
            ["backend"], registry=r,
        )
        self.output_tokens = Counter(
            "smetric_gateway_output_tokens", "Generated tokens of successful attempts", ["backend"], registry=r
        )
        self.in_flight = Gauge(
            "smetric_gateway_in_flight", "Attempts currently proxied, per instance", ["backend"], registry=r
        )
        self.done_reports = Counter(
            "smetric_gateway_done_reports", "Done reports sent to the controller, by result", ["result"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "smetric_gateway_client_disconnects", "Clients that went away mid-response", registry=r
        )
        self.prefilled_reports = Counter(
            "smetric_gateway_prefilled_reports", "Prefilled reports sent to the controller, by result", ["result"],
            registry=r,
        )
        # A request that stops somewhere shows here as a stage that does not drain.
        self.in_stage = Gauge(
            "smetric_gateway_requests_in_stage",
            "Client requests being handled, by the stage they are in now: read (body and engine "
            "/tokenize), route (controller), upstream (connecting to the engine and waiting for its "
            "response headers), respond (streaming the answer back)",
            ["stage"], registry=r,
        )
        self.tokenize_failures = Counter(
            "smetric_gateway_tokenize_failures",
            "Engine /tokenize calls that returned no token ids, by outcome: timeout, error (transport or "
            "unreadable body), status (5xx: the next engine is tried), rejected (4xx: the request itself)",
            ["outcome"], registry=r,
        )
        self.untokenized = Counter(
            "smetric_gateway_untokenized_prompts",
            "Prompts no engine tokenized (a request's, or its history's for est_hit), estimated instead",
            registry=r,
        )
        self._zero_series(instances)

    def _zero_series(self, instances: Sequence[str]) -> None:
        # Series that exist from the start read 0 instead of "no data" until the first event, so
        # rate() and alerts on failures work before anything failed.
        for inst in instances:
            self.retries.labels(backend=inst)
            self.in_flight.labels(backend=inst)
            self.cached_unreported.labels(backend=inst)
            for stage in ("before_response", "mid_response"):
                self.upstream_failures.labels(backend=inst, stage=stage)
            for stage in FUNNEL_STAGES:
                self.funnel.labels(backend=inst, stage=stage)
        for cause in ("controller_unavailable", "controller_no_instance"):
            self.fallback_routes.labels(cause=cause)
        for result in ("delivered", "failed"):
            self.done_reports.labels(result=result)
            self.prefilled_reports.labels(result=result)
        for stage in REQUEST_STAGES:
            self.in_stage.labels(stage=stage)
        for outcome in TOKENIZE_OUTCOMES:
            self.tokenize_failures.labels(outcome=outcome)
        for outcome in ("ok", "timeout", "error"):
            self.route_rtt.labels(outcome=outcome)

    def series(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once."""
        key = (id(metric), values)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*values)
        return child

    # ---- hooks the gateway calls -------------------------------------------------------------------
    def observe_response(self, resp: web.StreamResponse) -> None:
        """One client request answered; the decision headers say who served it and why."""
        h = resp.headers
        self.series(self.requests, h.get("X-SMetric-Instance", NO_INSTANCE), h.get("X-SMetric-Reason", NO_INSTANCE),
                    str(resp.status)).inc()

    def observe_route_rtt(self, seconds: float, outcome: str) -> None:
        self.series(self.route_rtt, outcome).observe(seconds)

    def observe_routing(self, seconds: float) -> None:
        self.routing.observe(seconds)

    def attempt_started(self, instance: str) -> None:
        self.series(self.in_flight, instance).inc()

    def observe_attempt(self, a: AttemptRecord) -> None:
        inst = a.instance
        self.series(self.in_flight, inst).dec()
        if not a.ok:
            return
        self.series(self.duration, inst).observe(a.finished - a.started)
        self.series(self.output_tokens, inst).inc(a.output_tokens)
        if a.stream and a.first_byte is not None:
            self.series(self.ttft, inst).observe(a.first_byte - a.started)
            if a.output_tokens >= 2:
                self.series(self.tpot, inst).observe((a.finished - a.first_byte) / (a.output_tokens - 1))
        if a.cached_tokens is None:
            self.series(self.cached_unreported, inst).inc()
            return
        for stage, n in zip(FUNNEL_STAGES,
                            (a.prompt_tokens, a.est_hit_tokens or 0, a.predicted_local_tokens, a.cached_tokens)):
            self.series(self.funnel, inst, stage).inc(n)

    def observe_upstream_failure(self, instance: str, *, mid_response: bool) -> None:
        stage = "mid_response" if mid_response else "before_response"
        self.upstream_failures.labels(backend=instance, stage=stage).inc()

    def observe_retry(self, failed_instance: str) -> None:
        self.retries.labels(backend=failed_instance).inc()

    def observe_fallback(self, cause: str) -> None:
        self.fallback_routes.labels(cause=cause).inc()

    def observe_done(self, delivered: bool) -> None:
        self.series(self.done_reports, "delivered" if delivered else "failed").inc()

    def observe_prefilled(self, delivered: bool) -> None:
        self.series(self.prefilled_reports, "delivered" if delivered else "failed").inc()

    def observe_tokenize_failure(self, outcome: str) -> None:
        self.tokenize_failures.labels(outcome=outcome).inc()

    # ---- HTTP --------------------------------------------------------------------------------------
    async def handle(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


__all__ = ["FUNNEL_STAGES", "REQUEST_STAGES", "TOKENIZE_OUTCOMES", "AttemptRecord", "GatewayMetrics"]
