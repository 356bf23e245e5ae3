"""``smetric gateway``: an OpenAI-compatible HTTP proxy that routes with the SMetric controller.

Per request (``/v1/chat/completions``, ``/v1/completions``):

1. read the prompt's token ids, turn and est_hit (``gateway_prompt.PromptReader``); the headers
   ``X-SMetric-Turn`` and ``X-SMetric-Est-Hit`` override the turn and est_hit read from the body;
2. ask the controller's ``route`` (only the prompt's block hashes cross the wire);
3. forward the client's body, unchanged, to the chosen instance and stream the answer back as
   it arrives (SSE included, byte for byte);
4. report ``prefilled`` when a streamed answer's first bytes arrive (its prompt no longer queues for
   prefill), and ``done`` (usage, cached tokens, TTFT, end-to-end time) so the controller releases load.

The decision travels back in response headers (``X-SMetric-Instance``, ``-Reason``,
``-Local-Hit``, ``-Turn``, ...). An instance that fails before any byte reached the client
(connect error, 5xx) is reported ``done ok=false`` and the request is retried once on another
instance; if that fails too the client gets a 502 JSON error naming both attempts. When the
controller does not answer, the gateway routes round-robin over the configured instances, says
so in ``X-SMetric-Fallback``, and retries the controller every ``--controller-retry-s``. With several
controller replicas (``--controller a,b``) a replica that does not answer within the route timeout
is skipped for the next; the fallback starts only when none answers.
``X-SMetric-Index-Ready: false`` marks decisions made while the controller's index was still empty
(load balance). ``/metrics`` serves the gateway's Prometheus metrics (``gateway_metrics.py``).

Failures: every error the gateway itself answers is JSON in OpenAI's shape
(``{"error": {"message", "type", "code"}}``), unknown paths and methods and internal errors
included. A connect error is reported as ``done`` with ``error: "connect"``, which takes the instance
out of the controller's routing at once. An SSE stream the engine cuts after bytes went out ends
with an ``event: error`` carrying the same error object (``done ok=false, error: "cut"``); a
non-streamed answer cut that way is aborted (a JSON body cannot carry an error after it started).
A client that hangs up after the stream's ``data: [DONE]`` got the whole answer: ``done ok=true``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from smetric_lmc import eventloop, gateway_status
from smetric_lmc.client import AsyncRouteClient, InProcessRouteClient, RouteError, RouteTimeout
from smetric_lmc.config import Config, ConfigError, InstanceConfig, default_config_path, load_config
from smetric_lmc.gateway_metrics import AttemptRecord, GatewayMetrics
from smetric_lmc.gateway_prompt import (
    BadRequest,
    Kind,
    PromptInfo,
    PromptReader,
    UsageSniffer,
    parse_turn_header,
)
from smetric_lmc.hashing import HashSettings
from smetric_lmc.local_tokenizer import LocalChatTokenizer, TokenizerDirError
from smetric_lmc.session import ChatTokenizer, SessionHints
from smetric_lmc.wire import HashChain, RouteDecision

log = logging.getLogger(__name__)

MODELS_TTL_S = 30.0  # how long the engines' /v1/models list is trusted for the model-name check
SLOW_ROUTING_S = 2.0  # tokenize + route normally take milliseconds; say so when they do not
# Request headers worth passing to the engine; hop-by-hop and length headers are the proxy's own.
_FORWARD_REQUEST = ("content-type", "authorization", "accept", "x-request-id", "openai-organization")
# Non-streamed answers up to this size are read whole and sent in one write.
_BUFFERED_BYTES = 1 << 20
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade",
               "proxy-authenticate", "proxy-authorization"}


@dataclass(slots=True)
class Target:
    """Where one attempt goes: the controller's decision, or the gateway's own fallback pick."""

    instance_id: str
    endpoint: str
    route_id: str | None  # the id the controller counts this attempt under; None: not routed by it
    decision: RouteDecision | None  # None: the gateway picked round-robin
    prompt_tokens: int = 0
    turn: int | None = None
    est_hit_tokens: int | None = None
    fallback: str | None = None  # why the controller's decision was not used
    index_ready: bool | None = None  # the controller's; False: routed by load balance while its index fills

    @property
    def reason(self) -> str:
        return self.decision.reason.value if self.decision is not None else "gateway_round_robin"

    @property
    def local_hit_tokens(self) -> int:
        return self.decision.local_hit_tokens if self.decision is not None else 0


@dataclass(slots=True)
class Attempt:
    target: Target
    ok: bool = False
    engine_error: str | None = None  # the done report's ``error``: "connect" | "cut"
    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None
    error: str | None = None
    status: int | None = None
    sniffer: UsageSniffer | None = None


class UpstreamFailed(Exception):
    """The instance failed before any byte reached the client: the request can be retried."""


class Gateway:
    """The aiohttp application and the routing around each proxied request."""

    def __init__(
        self,
        cfg: Config,
        controller_url: str | None = None,
        *,
        tokenizer_dir: str | None = None,
        route_timeout_s: float = 1.0,
        controller_retry_s: float = 2.0,
        upstream_timeout_s: float = 600.0,
        connect_timeout_s: float = 3.0,
        tokenize_timeout_s: float = 10.0,
    ) -> None:
        if not cfg.instances:
            raise ValueError("the gateway needs at least one instance in the config")
        self.cfg = cfg
        self.controller_url = controller_url or cfg.server.route_url
        self.instances: list[InstanceConfig] = list(cfg.instances)
        self._by_id = {i.id: i for i in self.instances}
        self._rr = itertools.count()
        self.route_timeout_s = route_timeout_s
        self.controller_retry_s = controller_retry_s
        # ``connect`` bounds getting a connection at all (name resolution included), not only the
        # TCP handshake; ``total`` bounds the whole answer (a long non-streamed generation sends
        # nothing before it ends, so there is no tighter bound on the first byte).
        self._timeout = aiohttp.ClientTimeout(total=upstream_timeout_s, connect=connect_timeout_s,
                                              sock_connect=connect_timeout_s)
        self._short_timeout = aiohttp.ClientTimeout(total=tokenize_timeout_s, connect=connect_timeout_s)
        self.tokenize_timeout_s = tokenize_timeout_s
        # The config's hashing until the controller's stats reply says what its index uses.
        self.hashing = HashSettings.from_config(cfg)
        self._hf = _load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        self._tokenizer_check: asyncio.Task[bool | None] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._client: AsyncRouteClient | None = None
        # Set when the controller runs in this process: routes are answered by its RouteCore directly.
        self.in_process: Callable[[bytes], bytes] | None = None
        self._reader: PromptReader | None = None
        self._controller_down_until = 0.0
        self._served: set[str] = set()  # model names the engines serve (/v1/models), see _unknown_model
        self._models_at = -1e9
        self._controller_down = False
        self._background: set[asyncio.Task[Any]] = set()
        self._failure_reports: dict[str, asyncio.Task[Any]] = {}  # route id -> its done report, in flight
        self.counters: dict[str, int] = {
            "requests": 0, "routed": 0, "fallback_routes": 0, "retries": 0, "upstream_failures": 0,
            "bad_gateway": 0, "done_reports": 0, "done_failures": 0, "client_disconnects": 0,
            "hash_mismatch": 0, "prefilled_reports": 0, "prefilled_failures": 0,
        }
        self.metrics = GatewayMetrics(list(self._by_id))
        self.reasons: dict[str, int] = {}  # answered requests by X-SMetric-Reason (the status page)
        self.sessions = SessionHints()  # add_header(): a deployment's own session header

    @property
    def route_client(self) -> AsyncRouteClient | None:
        """The controller client (its ``failovers`` between replicas); None until the app has started."""
        return self._client

    @property
    def prompt_reader(self) -> PromptReader | None:
        """The prompt tokenizer/estimator (``estimator.observations``); None until the app has started."""
        return self._reader

    # ---- instances joining and leaving at run time (the drop-in router's discovery) -------------
    def has_instance(self, iid: str) -> bool:
        return iid in self._by_id

    def add_instance(self, inst: InstanceConfig) -> None:
        if inst.id in self._by_id:
            return
        self.instances.append(inst)
        self._by_id[inst.id] = inst
        if self._reader is not None:
            self._reader.add_url(inst.http)

    def remove_instance(self, iid: str) -> None:
        inst = self._by_id.pop(iid, None)
        if inst is None:
            return
        self.instances[:] = [i for i in self.instances if i.id != iid]
        if self._reader is not None:
            self._reader.remove_url(inst.http)

    # ---- lifecycle ------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[_json_errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/", self._status_page)
        app.router.add_get("/metrics", self.metrics.handle)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app: web.Application) -> None:
        # auto_decompress=False: the client gets the engine's bytes exactly as sent. limit=0: no cap
        # on connections to the engines. aiohttp's default (about 100 in use at once) made further
        # concurrent requests wait, silently, for earlier ones to end (minutes for long generations)
        # before they could reach any engine; the engines queue requests themselves.
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self._timeout,
                                           auto_decompress=False)
        self._client = InProcessRouteClient(self.in_process, timeout_s=self.route_timeout_s) \
            if self.in_process is not None else AsyncRouteClient(self.controller_url, timeout_s=self.route_timeout_s)
        self._reader = PromptReader([i.http for i in self.instances], self._http, self._hf,
                                    timeout_s=self.tokenize_timeout_s, metrics=self.metrics)
        await self._adopt_hashing()
        log.info("gateway: controller=%s instances=%s block_size=%d tokenizer=%s", self.controller_url,
                 ",".join(self._by_id), self.hashing.block_size, "local" if self._hf else "engine /tokenize")
        if self._reader.local:  # falls back to the engines' /tokenize if they disagree
            self._tokenizer_check = self._spawn(self._reader.check_local(self.cfg.model or None))

    async def _cleanup(self, _app: web.Application) -> None:
        if self._tokenizer_check is not None:
            self._tokenizer_check.cancel()  # it may be waiting for engines that never came
        if self._background:
            await asyncio.wait(list(self._background), timeout=5.0)
        if self._client is not None:
            await self._client.close()
        if self._http is not None:
            await self._http.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _adopt_hashing(self) -> bool:
        """Take every hashing field from the controller's ``stats``, so client-side hashes match its
        index; True when adopted. Until then the config's settings are used, and the controller
        refuses any chain whose root differs (``hash_mismatch``), which brings the gateway back here."""
        assert self._client is not None
        try:
            theirs = HashSettings.from_stats((await self._client.stats()).get("hashing"))
        except RouteError as exc:
            log.warning("gateway: controller's hashing unknown (%s); hashing with the config's until it answers", exc)
            return False
        except ValueError as exc:
            log.error("gateway: controller's stats carry no usable hashing (%s); keeping the config's", exc)
            return False
        diff = self.hashing.differences(theirs)
        if diff:
            log.warning("gateway: adopting the controller's hashing, which differs from the config: %s", " ".join(diff))
        self.hashing = theirs
        return True

    # ---- handlers -------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._observed(request, "chat", "/v1/chat/completions")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._observed(request, "completion", "/v1/completions")

    async def _observed(self, request: web.Request, kind: Kind, path: str) -> web.StreamResponse:
        resp = await self._proxy(request, kind, path)
        self.metrics.observe_response(resp)
        reason = resp.headers.get("X-SMetric-Reason")
        if reason:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return resp

    async def _status_page(self, _request: web.Request) -> web.Response:
        """A readable page on the cluster (smetric_lmc.gateway_status), from the controller's stats."""
        assert self._client is not None
        stats = instances = None
        error = None
        try:
            stats = await self._client.stats()
            instances = await self._client.instances()
        except RouteError as exc:
            stats, error = None, _describe(exc)
        page = gateway_status.render(controller_url=self.controller_url, stats=stats, instances=instances,
                                     controller_error=error, reasons=self.reasons, gateway_counters=self.counters)
        return web.Response(text=page, content_type="text/html")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self._http is not None
        errors = []
        for inst in self._order_from(None):
            try:
                async with self._http.get(f"{inst.http.rstrip('/')}/v1/models", headers=_forward_headers(request),
                                          timeout=self._short_timeout) as up:
                    body = await up.read()
                    if up.status < 500:
                        return web.Response(body=body, status=up.status, headers=_response_headers(up))
                    errors.append(f"{inst.id}: HTTP {up.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors.append(f"{inst.id}: {_describe(exc)}")
            log.warning("gateway: /v1/models failed on instance=%s: %s", inst.id, errors[-1])
        return _error(502, "no instance answered /v1/models: " + "; ".join(errors), "upstream_error")

    async def _unknown_model(self, model: Any) -> web.Response | None:
        """An OpenAI ``model_not_found`` answer when the request names a model no engine serves
        (before routing: such a request would count as a first turn and fail on the engine); None
        when it is served. Names other than the config's are checked against the engines'
        /v1/models (LoRA adapters included), remembered for a while."""
        if model is None or model == self.cfg.model or not self.cfg.model:
            return None
        now = time.monotonic()
        if now - self._models_at > MODELS_TTL_S:
            served = await self._served_models()
            if served is None:
                return None  # no engine said: let the engine answer
            self._served, self._models_at = served, now
        if model in self._served:
            return None
        return web.json_response({"error": {
            "message": f"The model `{model}` does not exist. Served here: {', '.join(sorted(self._served))}.",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}, status=404)

    async def _served_models(self) -> set[str] | None:
        assert self._http is not None
        for inst in self._order_from(None):
            try:
                async with self._http.get(f"{inst.http.rstrip('/')}/v1/models", timeout=self._short_timeout) as up:
                    if up.status == 200:
                        data = await up.json(content_type=None)
                        return {str(c.get("id")) for c in data.get("data") or () if isinstance(c, dict)} | {
                            self.cfg.model}
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
                continue
        return None

    async def _healthz(self, _request: web.Request) -> web.Response:
        body = {"ok": True, "controller": self.controller_url, "controller_down": self._controller_down,
                "instances": list(self._by_id), **self.counters}
        return web.json_response(body)

    async def _proxy(self, request: web.Request, kind: Kind, path: str) -> web.StreamResponse:
        assert self._reader is not None
        self.counters["requests"] += 1
        if not self.instances:  # all removed at run time (the drop-in router's discovery)
            return _error(503, "no serving engine discovered yet", "service_unavailable")
        rid = f"gw-{uuid.uuid4().hex}"
        t0 = time.monotonic()
        try:
            with self._stage("read"):
                raw = await request.read()
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise BadRequest("the request body must be a JSON object")
                unknown = await self._unknown_model(body.get("model"))
                if unknown is not None:
                    return unknown
                info = await self._reader.read(kind, body, parse_turn_header(request.headers.get("X-SMetric-Turn")))
            # A client that knows its session's cached history (a trace replay) may say so.
            est = parse_turn_header(request.headers.get("X-SMetric-Est-Hit"), "X-SMetric-Est-Hit")
            if est is not None:
                info = dataclasses.replace(info, est_hit_tokens=est)
            # Peers' session headers (x-dynamo-session-id, X-SMG-Routing-Key, --session-key) as a turn hint.
            turn, est = self.sessions.observe(self.sessions.key(request.headers), info.turn, info.est_hit_tokens,
                                              len(info.token_ids) if info.token_ids is not None else info.approx_tokens)
            info = dataclasses.replace(info, turn=turn, est_hit_tokens=est)
        except (ValueError, BadRequest) as exc:
            return _error(400, str(exc), "invalid_request_error")
        t_read = time.monotonic()
        target = await self._decide(rid, info)
        t_route = time.monotonic()
        self.metrics.observe_routing(t_route - t0)
        log.debug("gateway: request=%s routed to instance=%s reason=%s fallback=%s read_s=%.3f route_s=%.3f",
                  rid, target.instance_id, target.reason, target.fallback, t_read - t0, t_route - t_read)
        if t_route - t0 > SLOW_ROUTING_S:
            log.warning("gateway: slow routing request=%s tokenize_s=%.2f route_s=%.2f", rid, t_read - t0,
                        t_route - t_read)
        try:
            return await self._attempt(request, path, raw, target, rid, info, retried_from=None)
        except UpstreamFailed as first:
            self.counters["retries"] += 1
            failed = target.instance_id
            self.metrics.observe_retry(failed)
            # The controller learns of a dead engine from this report: deliver it before routing the
            # retry (or answering), so neither this request nor the client's next lands there again.
            report = self._failure_reports.pop(rid, None)
            if report is not None:
                await asyncio.wait([report])
            second_target = await self._retry_target(rid, info, failed)
            if second_target is None:
                self.counters["bad_gateway"] += 1
                return _error(502, f"instance {failed} failed ({first}) and no other instance is available",
                              "upstream_error")
            log.warning("gateway: retrying request=%s on instance=%s after instance=%s failed: %s",
                        rid, second_target.instance_id, failed, first)
            try:
                return await self._attempt(request, path, raw, second_target, rid, info, retried_from=failed)
            except UpstreamFailed as second:
                self.counters["bad_gateway"] += 1
                log.error("gateway: request=%s failed on both instance=%s and instance=%s", rid, failed,
                          second_target.instance_id)
                return _error(502, f"instance {failed} failed ({first}); retry on instance "
                              f"{second_target.instance_id} failed ({second})", "upstream_error")

    @contextlib.contextmanager
    def _stage(self, stage: str) -> Iterator[None]:
        """Count the request in ``stage`` (``smetric_gateway_requests_in_stage``) while it is there."""
        self._enter_stage(stage)
        try:
            yield
        finally:
            self._leave_stage(stage)

    def _enter_stage(self, stage: str) -> str:
        self.metrics.series(self.metrics.in_stage, stage).inc()
        return stage

    def _leave_stage(self, stage: str) -> None:
        self.metrics.series(self.metrics.in_stage, stage).dec()

    # ---- routing --------------------------------------------------------------------------------
    def _controller_usable(self) -> bool:
        return asyncio.get_running_loop().time() >= self._controller_down_until

    def _mark_controller(self, up: bool, why: str = "") -> None:
        self.metrics.controller_up.set(1 if up else 0)
        if up:
            if self._controller_down:
                log.info("gateway: controller back at %s: routing with it again", self.controller_url)
            self._controller_down = False
            return
        if not self._controller_down:
            log.warning("gateway: controller at %s unavailable (%s): round-robin over %d configured "
                        "instances until it answers", self.controller_url, why, len(self.instances))
        else:  # a probe after --controller-retry-s (or a call that was already waiting) failed too
            log.info("gateway: controller at %s still unavailable (%s)", self.controller_url, why)
        self._controller_down = True
        self._controller_down_until = asyncio.get_running_loop().time() + self.controller_retry_s

    async def _ask_controller(self, route_id: str, info: PromptInfo) -> RouteDecision | str:
        """The controller's decision, or why there is none."""
        assert self._client is not None
        if not self._controller_usable():
            return "controller_unavailable"
        t0 = time.perf_counter()
        try:
            d = await self._client.route(route_id, model=self.cfg.model, **self._route_args(info))
        except RouteError as exc:
            self.metrics.observe_route_rtt(time.perf_counter() - t0, _rtt_outcome(exc))
            if exc.code != "hash_mismatch":
                return self._route_failed(route_id, exc)
            # The controller's index hashes differently than this gateway (it restarted with another
            # config, or was unreachable when the gateway started): count it, adopt, try once more.
            self.counters["hash_mismatch"] += 1
            log.error("gateway: controller refused request=%s: %s; re-adopting its hashing", route_id, exc.message)
            if not await self._adopt_hashing():
                return "controller_hash_mismatch"
            t0 = time.perf_counter()
            try:
                d = await self._client.route(route_id, model=self.cfg.model, **self._route_args(info))
            except RouteError as again:
                self.metrics.observe_route_rtt(time.perf_counter() - t0, _rtt_outcome(again))
                return self._route_failed(route_id, again)
        self.metrics.observe_route_rtt(time.perf_counter() - t0, "ok")
        self._mark_controller(True)
        if not d.index_ready:
            self.metrics.index_not_ready.inc()
        if d.instance_id is None or not d.endpoint:
            log.warning("gateway: controller has no routable instance (reason=%s)", d.reason.value)
            return "controller_no_instance"
        return d

    def _route_args(self, info: PromptInfo) -> dict[str, Any]:
        kw: dict[str, Any] = {"turn": info.turn, "est_hit_tokens": info.est_hit_tokens}
        if info.token_ids is not None:
            kw.update(token_ids=info.token_ids, hashing=self.hashing)
        else:  # no tokenizer answered: route on load alone
            kw.update(hashes=[HashChain("fast", self.hashing.block_size, [])], prompt_tokens=info.approx_tokens)
        return kw

    def _route_failed(self, route_id: str, exc: RouteError) -> str:
        if isinstance(exc, RouteTimeout):
            self._mark_controller(False, str(exc))
            return "controller_unavailable"
        if exc.code == "transport":
            self._mark_controller(False, str(exc))
            return "controller_unavailable"
        log.error("gateway: controller refused route request=%s: %s", route_id, exc)
        return f"controller_error:{exc.code}"

    async def _decide(self, rid: str, info: PromptInfo, exclude: str | None = None) -> Target:
        with self._stage("route"):
            d = await self._ask_controller(rid, info)
        if isinstance(d, RouteDecision):
            if d.instance_id != exclude:
                self.counters["routed"] += 1
                return Target(d.instance_id or "", d.endpoint or "", rid, d, d.prompt_tokens, d.turn,
                              d.est_hit_tokens,
                              index_ready=d.index_ready)
            # The controller still prefers the instance that just failed: release and go elsewhere.
            self._report_failed_route(rid, d.instance_id)
            d = "controller_chose_failed_instance"
        self.counters["fallback_routes"] += 1
        self.metrics.observe_fallback(d)
        inst = next(iter(self._order_from(exclude)), None) if exclude else self._round_robin()
        assert inst is not None
        n = len(info.token_ids) if info.token_ids is not None else info.approx_tokens
        return Target(inst.id, inst.http, None, None, n, info.turn, info.est_hit_tokens, fallback=d)

    async def _retry_target(self, rid: str, info: PromptInfo, failed: str) -> Target | None:
        if len(self.instances) < 2:
            return None
        return await self._decide(f"{rid}-retry", info, exclude=failed)

    def _round_robin(self) -> InstanceConfig:
        return self.instances[next(self._rr) % len(self.instances)]

    def _order_from(self, exclude: str | None) -> list[InstanceConfig]:
        """Instances starting at the round-robin cursor, without ``exclude``."""
        start = next(self._rr) % len(self.instances)
        ordered = self.instances[start:] + self.instances[:start]
        return [i for i in ordered if i.id != exclude]

    def _report_failed_route(self, route_id: str, instance_id: str | None) -> None:
        self._spawn(self._send_done(route_id, instance_id=instance_id, ok=False))

    # ---- one attempt ----------------------------------------------------------------------------
    async def _attempt(
        self, request: web.Request, path: str, raw: bytes, target: Target, rid: str, info: PromptInfo,
        retried_from: str | None,
    ) -> web.StreamResponse:
        assert self._http is not None
        att = Attempt(target)
        self.metrics.attempt_started(target.instance_id)
        url = target.endpoint.rstrip("/") + path
        resp: web.StreamResponse | None = None
        stage = self._enter_stage("upstream")
        try:
            async with self._http.post(url, data=raw, headers=_forward_headers(request)) as up:
                att.status = up.status
                log.debug("gateway: request=%s instance=%s answered HTTP %d after %.3f s", rid, target.instance_id,
                          up.status, time.monotonic() - att.started)
                if up.status >= 500:
                    detail = (await up.content.read(2000)).decode("utf-8", "replace")
                    att.error = f"HTTP {up.status}: {detail.strip()[:300]}"
                    raise UpstreamFailed(att.error)
                self._leave_stage(stage)
                stage = self._enter_stage("respond")
                headers = _response_headers(up)
                headers.update(_decision_headers(target, rid, retried_from))
                att.sniffer = UsageSniffer(up.headers.get("Content-Type", ""))
                streamed = up.headers.get("Content-Type", "").startswith("text/event-stream")
                if not streamed and up.content_length is not None and up.content_length <= _BUFFERED_BYTES:
                    # A whole small answer: sent in one write rather than streamed (a third of the
                    # gateway's own time on short completions went to the streamed path's writes).
                    body = await up.read()
                    att.first_byte = time.monotonic()
                    att.sniffer.feed(body)
                    att.sniffer.finish()
                    att.ok = up.status < 400
                    return web.Response(status=up.status, headers=headers, body=body)
                resp = web.StreamResponse(status=up.status, headers=headers)
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    if att.first_byte is None:
                        att.first_byte = time.monotonic()
                        if streamed and target.route_id is not None:
                            # The engine streams once the prompt is prefilled: its tokens stop queueing.
                            self._spawn(self._send_prefilled(target.route_id, target.instance_id))
                    await resp.write(chunk)
                    att.sniffer.feed(chunk)
                att.sniffer.finish()
                await resp.write_eof()
                att.ok = up.status < 400
                return resp
        except UpstreamFailed:
            self._upstream_failed(att)
            raise
        except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError included
            if resp is not None and resp.prepared and _client_gone(request):
                if att.sniffer is not None and att.sniffer.complete:
                    # It hung up after [DONE]: the answer reached it whole.
                    att.ok = att.status is not None and att.status < 400
                    return resp
                self.counters["client_disconnects"] += 1
                self.metrics.client_disconnects.inc()
                att.error = "client disconnected"
                log.info("gateway: client went away request=%s instance=%s", rid, target.instance_id)
                return resp
            att.error = _describe(exc)
            return await self._broken(request, resp, att)
        except aiohttp.ClientConnectorError as exc:  # nothing listens: the engine is down
            att.error = _describe(exc)
            att.engine_error = "connect"
            return await self._broken(request, resp, att)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            att.error = _describe(exc)
            return await self._broken(request, resp, att)
        finally:
            self._leave_stage(stage)
            self._finish(att, info)

    def _upstream_failed(self, att: Attempt) -> None:
        self.counters["upstream_failures"] += 1
        self.metrics.observe_upstream_failure(att.target.instance_id, mid_response=False)
        log.warning("gateway: instance=%s failed before responding: %s", att.target.instance_id, att.error)

    async def _broken(self, request: web.Request, resp: web.StreamResponse | None,
                      att: Attempt) -> web.StreamResponse:
        if resp is None or not resp.prepared:
            self._upstream_failed(att)
            raise UpstreamFailed(att.error or "upstream error")
        # Bytes already reached the client: the request cannot be replayed.
        att.engine_error = "cut"
        self.counters["upstream_failures"] += 1
        self.metrics.observe_upstream_failure(att.target.instance_id, mid_response=True)
        if att.sniffer is not None and att.sniffer.sse and not _client_gone(request):
            # An SSE client is told why its stream ends, then the stream ends.
            log.error("gateway: instance=%s failed mid-stream: %s; sending an SSE error event",
                      att.target.instance_id, att.error)
            event = _error_body(f"instance {att.target.instance_id} failed mid-stream: {att.error}",
                                "upstream_error", 502)
            try:
                resp.force_close()
                await resp.write(b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n")
                await resp.write_eof()
                return resp
            except (ConnectionResetError, RuntimeError):
                pass  # the client left meanwhile: nothing more to tell it
        # A JSON body cannot carry an error once it started: abort the connection so the client
        # sees a truncated response instead of a silently short one.
        log.error("gateway: instance=%s failed mid-response: %s; aborting the client connection",
                  att.target.instance_id, att.error)
        if request.transport is not None:
            request.transport.abort()
        return resp

    def _finish(self, att: Attempt, info: PromptInfo) -> None:
        t = att.target
        now = time.monotonic()
        log.debug("gateway: request=%s instance=%s reason=%s status=%s ok=%s e2e_s=%.3f", t.route_id,
                  t.instance_id, t.reason, att.status, att.ok, now - att.started)
        s = att.sniffer
        prompt = (s.prompt_tokens() if s else None) or t.prompt_tokens or (
            len(info.token_ids) if info.token_ids is not None else info.approx_tokens)
        self.metrics.observe_attempt(AttemptRecord(
            t.instance_id, att.ok, bool(s and s.sse), att.started, now, att.first_byte, prompt,
            s.output_tokens() if s else 0, t.est_hit_tokens, t.local_hit_tokens, s.cached_tokens() if s else None))
        if t.route_id is None:  # not counted by the controller: nothing to release
            return
        report = self._spawn(self._send_done(
            t.route_id, instance_id=t.instance_id, prompt_tokens=prompt,
            output_tokens=s.output_tokens() if s else 0, cached_tokens=s.cached_tokens() if s else None,
            ttft_s=(att.first_byte - att.started) if att.first_byte else None, e2e_s=now - att.started, ok=att.ok,
            **({"error": att.engine_error} if att.engine_error else {}),
        ))
        if not att.ok:  # awaited by a retry; gone from here once delivered
            key = t.route_id
            self._failure_reports[key] = report
            report.add_done_callback(lambda _t: self._failure_reports.pop(key, None))

    async def _send_prefilled(self, route_id: str, instance_id: str) -> None:
        assert self._client is not None
        try:
            await self._client.prefilled(route_id, instance_id=instance_id)
            self.counters["prefilled_reports"] += 1
            self.metrics.observe_prefilled(True)
        except RouteError as exc:  # the engine-metrics fallback covers it; not worth failing over
            self.counters["prefilled_failures"] += 1
            self.metrics.observe_prefilled(False)
            log.warning("gateway: prefilled report for %s not delivered: %s", route_id, exc)

    async def _send_done(self, route_id: str, **kw: Any) -> None:
        assert self._client is not None
        try:
            await self._client.done(route_id, **kw)
            self.counters["done_reports"] += 1
            self.metrics.observe_done(True)
        except RouteError as exc:
            self.metrics.observe_done(False)
            # Lost done reports are healed by the controller from engine metrics; log and move on.
            self.counters["done_failures"] += 1
            log.warning("gateway: done report for %s not delivered: %s", route_id, exc)


# ---- helpers ----------------------------------------------------------------------------------------
def _load_tokenizer(tokenizer_dir: str) -> ChatTokenizer | None:
    """The served model's tokenizer from its directory: ``tokenizers`` + ``jinja2`` where the
    directory has a ``tokenizer.json`` and a template they render, else ``transformers``; None
    (tokenize with the engines' /tokenize) when neither can read it."""
    try:
        tok = LocalChatTokenizer(tokenizer_dir)
        log.info("gateway: tokenizing locally from %s (tokenizers + jinja2)", tokenizer_dir)
        return tok
    except (ImportError, TokenizerDirError) as exc:
        log.info("gateway: no light local tokenizer (%s); trying transformers", exc)
    try:
        from smetric_lmc.session import HFChatTokenizer

        return HFChatTokenizer(tokenizer_dir)
    except ImportError as exc:
        log.warning("gateway: --tokenizer given but neither tokenizers + jinja2 nor transformers can read it (%s); "
                    "tokenizing with the engines' /tokenize", exc)
        return None


def _forward_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_REQUEST}


def _response_headers(up: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in up.headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() != "date"
            and k.lower() != "server"}


def _decision_headers(t: Target, rid: str, retried_from: str | None) -> dict[str, str]:
    d = t.decision
    h = {
        "X-SMetric-Request-Id": rid,
        "X-SMetric-Instance": t.instance_id,
        "X-SMetric-Reason": t.reason,
        "X-SMetric-Policy": d.policy if d is not None else "round_robin",
        "X-SMetric-Local-Hit": str(d.local_hit_tokens if d is not None else 0),
        "X-SMetric-Global-Hit": str(d.global_hit_tokens if d is not None else 0),
        "X-SMetric-Est-Hit": str(t.est_hit_tokens or 0),
        "X-SMetric-Turn": "" if t.turn is None else str(t.turn),
        "X-SMetric-Prompt-Tokens": str(t.prompt_tokens),
    }
    if d is not None:
        h["X-SMetric-Turn-Source"] = d.turn_source.value
    if t.fallback:
        h["X-SMetric-Fallback"] = t.fallback
    if t.index_ready is not None:
        h["X-SMetric-Index-Ready"] = "true" if t.index_ready else "false"
    if retried_from:
        h["X-SMetric-Retried-From"] = retried_from
    return h


def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_body(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(_error_body(message, kind, status), status=status)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own answers (404, 405, 413) and any uncaught exception, in OpenAI's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return _error(exc.status, exc.reason if not exc.text or exc.text.startswith(f"{exc.status}:")
                      else exc.text, kind)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("gateway: internal error on %s %s", request.method, request.path)
        return _error(500, f"internal gateway error: {_describe(exc)}", "server_error")


# ---- command line ---------------------------------------------------------------------------------------
def add_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``gateway`` subcommand to the ``smetric`` console script."""
    p = subparsers.add_parser(
        "gateway",
        help="OpenAI-compatible HTTP proxy that routes each request with the controller",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--config", default=None,
                   help="the controller's YAML: instances, block size, route URL (default: the example config "
                        "shipped in the package, smetric_lmc/configs/smetric.yaml)")
    p.add_argument("--controller", default=None,
                   help="route service URL, or comma-separated replicas tried in turn "
                        "(default: server.route_url of --config)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--tokenizer", default=None,
                   help="served model's tokenizer dir, read locally (tokenizers + jinja2: the `tokenizer` extra; "
                        "else transformers); default: the engines' /tokenize, a round trip per request")
    p.add_argument("--with-controller", action="store_true",
                   help="run the controller of --config in this process too: routes are answered without the "
                        "ZMQ round trip (one process, one event loop; its route socket still serves others)")
    p.add_argument("--route-timeout-s", type=float, default=1.0, help="wait this long for a route decision")
    p.add_argument("--controller-retry-s", type=float, default=2.0,
                   help="after the controller failed to answer, route round-robin this long before asking again")
    p.add_argument("--upstream-timeout-s", type=float, default=600.0, help="limit for one proxied request")
    p.add_argument("--connect-timeout-s", type=float, default=3.0,
                   help="limit for opening a connection to an engine (then the request is retried elsewhere)")
    p.add_argument("--tokenize-timeout-s", type=float, default=10.0,
                   help="limit for one engine /tokenize call (then the next engine is asked)")
    p.set_defaults(func=run_gateway)


def listen_socket(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound before anything says it listens (OSError if taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def run_gateway(args: argparse.Namespace) -> int:
    if args.config is None:
        args.config = default_config_path()
        log.info("gateway: no --config, using the packaged example %s", args.config)
    try:
        cfg = load_config(args.config)
        gw = Gateway(cfg, args.controller, tokenizer_dir=args.tokenizer, route_timeout_s=args.route_timeout_s,
                     controller_retry_s=args.controller_retry_s, upstream_timeout_s=args.upstream_timeout_s,
                     connect_timeout_s=args.connect_timeout_s, tokenize_timeout_s=args.tokenize_timeout_s)
    except (ConfigError, ValueError) as exc:
        log.error("gateway: bad config: %s", exc)
        return 2
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as exc:
        log.error("gateway: cannot listen on %s:%d: %s (a stack still running? `smetric status` / "
                  "`smetric down`; or choose another --port)", args.host, args.port, exc.strerror or exc)
        return 1
    log.info("gateway listening on http://%s:%d", args.host, sock.getsockname()[1])
    app = gw.app()
    if args.with_controller:
        _embed_controller(app, gw, cfg, args.config)
    with contextlib.suppress(KeyboardInterrupt):
        web.run_app(app, sock=sock, access_log=None, print=None, handle_signals=True, shutdown_timeout=5.0,
                    loop=eventloop.new_event_loop())
    return 0


def _embed_controller(app: web.Application, gw: Gateway, cfg: Config, config_path: str) -> None:
    """Run the controller of ``cfg`` in this process and loop, answering this gateway's routes
    directly. Its route socket is still served, for other gateways and clients."""
    from smetric_lmc.controller.app import ControllerApp  # the router's own wing, loaded when embedded

    controller = ControllerApp(cfg, config_path=config_path)

    async def start(_app: web.Application) -> None:
        await controller.start()
        gw.in_process = lambda payload: controller.core.handle(payload)  # the core a reload installs

    async def stop(_app: web.Application) -> None:
        await controller.close()

    app.on_startup.insert(0, start)  # before the gateway's own start-up, which asks it for its hashing
    app.on_cleanup.append(stop)


__all__ = ["Gateway", "Target", "add_subcommands", "run_gateway"]


def _rtt_outcome(exc: RouteError) -> str:
    return "timeout" if isinstance(exc, RouteTimeout) else "error"
