"""``smetric router``: SMetric as a drop-in replacement of vLLM production-stack's router.

The production-stack Helm chart runs its router image with an argument list
(``helm/templates/deployment-router.yaml``); an image whose entry point is ``smetric router`` takes
that list unchanged (``args.py``) and runs, in one process and one event loop:

* the SMetric controller (index, load, policy; the route socket on ``--smetric-route-url``), with
  the LMCache worker protocol on the chart's LMCache controller ports (pull ``9000``, reply
  ``9001``, heartbeat ``9002``): the engines' LMCache workers feed the index there;
* the bundled OpenAI-compatible gateway on ``--host:--port``, plus production-stack's own routes:
  ``GET /health`` (the chart's startup, liveness and readiness probes), ``/version``, ``/engines``,
  and ``/metrics`` (the gateway's metrics plus production-stack's ``vllm:healthy_pods_total`` and
  ``vllm:num_requests_running`` gauges per ``server``);
* the engines: ``--static-backends`` (fixed), or Kubernetes pods (``k8s.py``) joining and leaving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from smetric_lmc.config import Config, InstanceConfig, LMCacheConfig, load_config, parse_config
from smetric_lmc.dropin.args import (
    ArgsError,
    add_production_stack_arguments,
    add_smetric_arguments,
    csv,
    ignored,
    policy_for,
)
from smetric_lmc.dropin.membership import DropinController, DropinGateway
from smetric_lmc.policy import POLICY_NAMES

log = logging.getLogger(__name__)


def smetric_version() -> str:
    try:
        return version("smetric-lmc")
    except PackageNotFoundError:
        return "dev"


def _instance_id(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc or url


def build_config(args: argparse.Namespace) -> Config:
    """The controller config the argument list describes (ArgsError when it cannot start)."""
    try:
        base = load_config(args.smetric_config) if args.smetric_config else parse_config({})
    except ValueError as exc:  # ConfigError: the file's key path and the reason
        raise ArgsError(f"--smetric-config: {exc}") from None
    policy = policy_for(args.routing_logic, tuple(POLICY_NAMES))
    instances: list[InstanceConfig] = []
    models: list[str] = []
    if args.service_discovery == "static":
        backends, models = csv(args.static_backends), csv(args.static_models)
        if not backends:
            raise ArgsError("--service-discovery static needs --static-backends")
        if models and len(models) != len(backends):
            raise ArgsError(f"{len(backends)} --static-backends but {len(models)} --static-models")
        ids = csv(args.smetric_static_ids) or [_instance_id(b) for b in backends]
        events = csv(args.smetric_static_kv_events)
        if len(ids) != len(backends) or (events and len(events) != len(backends)):
            raise ArgsError("--smetric-static-ids / --smetric-static-kv-events need one entry per backend")
        for k, (iid, url) in enumerate(zip(ids, backends)):
            instances.append(InstanceConfig(id=iid, http=url, kv_events=events[k] if events else None))
    elif args.service_discovery == "k8s":
        if args.k8s_service_discovery_type != "pod-ip":
            raise ArgsError("--k8s-service-discovery-type service-name is not supported; use pod-ip (the chart default)")
    else:
        raise ArgsError(f"--service-discovery {args.service_discovery} is not supported (static or k8s)")
    host = args.smetric_lmcache_host
    reply = args.lmcache_controller_reply_port or args.lmcache_controller_port + 1
    heartbeat = args.lmcache_controller_heartbeat_port or args.lmcache_controller_port + 2
    lmcache = msgspec.structs.replace(
        base.lmcache if base.lmcache.enabled else LMCacheConfig(), enabled=True,
        pull_url=f"tcp://{host}:{args.lmcache_controller_port}", reply_url=f"tcp://{host}:{reply}",
        heartbeat_url=f"tcp://{host}:{heartbeat}")
    hashing = base.hashing
    if args.smetric_block_size:
        hashing = msgspec.structs.replace(hashing, block_size=args.smetric_block_size)
    server = msgspec.structs.replace(base.server, route_url=args.smetric_route_url,
                                     metrics_host="0.0.0.0", metrics_port=args.smetric_metrics_port)
    peer = msgspec.structs.replace(base.peer_apis, host="0.0.0.0", http_port=args.smetric_indexer_http_port,
                                   grpc_port=args.smetric_indexer_grpc_port)
    advanced = msgspec.structs.replace(base.advanced, limits=msgspec.structs.replace(
        base.limits, lmcache_worker_timeout_s=float(args.lmcache_worker_timeout)))
    try:
        cfg = msgspec.structs.replace(
            base, model=base.model or (models[0] if models else ""), instances=instances or base.instances,
            policy=msgspec.structs.replace(base.policy, name=policy), lmcache=lmcache, hashing=hashing,
            server=server, peer_apis=peer, advanced=advanced)
        cfg = parse_config(msgspec.to_builtins(cfg))  # every field checked as a config file's are
    except ValueError as exc:
        raise ArgsError(str(exc)) from None
    return cfg


class DropinRouter:
    """The controller, the gateway and discovery of one ``smetric router`` process."""

    def __init__(self, args: argparse.Namespace, *, k8s_api_client: Any = None) -> None:
        self.args = args
        self.cfg = build_config(args)
        self.controller = DropinController(self.cfg, enable_metrics_http=args.smetric_metrics_port > 0,
                                           reload_poll_s=0)
        self.gateway = DropinGateway(self.cfg, self.cfg.server.route_url)
        if args.session_key:
            self.gateway.sessions.add_header(args.session_key)
        self.models: dict[str, str] = {i.id: self.cfg.model for i in self.cfg.instances}
        self.created: dict[str, float] = dict.fromkeys(self.models, time.time())
        self.discovery: Any = None
        self._k8s_api_client = k8s_api_client
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        for name, value in ignored(self.args).items():
            log.info("router: --%s=%r accepted; it has no effect in SMetric", name.replace("_", "-"), value)
        await self.controller.start()
        self.gateway.controller_url = self.controller.service.endpoint or self.cfg.server.route_url
        # one process: the gateway's routes are answered by the controller's core, not over its socket
        self.gateway.in_process = lambda payload: self.controller.core.handle(payload)
        app = self.gateway.app()
        for path, handler in (("/health", self._health), ("/version", self._version), ("/engines", self._engines)):
            app.router.add_get(path, handler)
        self.gateway.metrics.registry.register(_ProdStackGauges(self))
        root = self.args.root_path.rstrip("/")
        if root:
            app.middlewares.append(_strip_root(root))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.args.host, self.args.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if self.args.service_discovery == "k8s":
            from smetric_lmc.dropin.k8s import K8sDiscovery

            self.discovery = K8sDiscovery(self.args.k8s_namespace, self.args.k8s_label_selector, self.on_pod,
                                          self.on_gone, api_client=self._k8s_api_client,
                                          watch_timeout_s=self.args.k8s_watcher_timeout_seconds)
            self.discovery.start(asyncio.get_running_loop())
        log.info("router: serving on %s:%d policy=%s discovery=%s lmcache=%s", self.args.host, self.port,
                 self.cfg.policy.name, self.args.service_discovery, self.cfg.lmcache.pull_url)

    async def close(self) -> None:
        if self.discovery is not None:
            self.discovery.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.controller.close()

    async def serve(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.close()

    # ---- discovery ------------------------------------------------------------------------------
    def on_pod(self, pod: Any) -> None:
        url = pod.url(self.args.k8s_port)
        if url is None:
            return  # no IP yet: nothing to index or route
        ev, rp = self.args.smetric_k8s_kv_events_port, self.args.smetric_k8s_kv_replay_port
        inst = InstanceConfig(id=pod.name, http=url, lmcache_instance_id=pod.name,
                              kv_events=f"tcp://{pod.ip}:{ev}" if ev else None,
                              replay=f"tcp://{pod.ip}:{rp}" if ev and rp else None)
        if self.controller.has_instance(pod.name) and not pod.ready and self.gateway.has_instance(pod.name):
            self.on_gone(pod.name)  # was Ready, is not any more: out of routing (its index goes too)
        self.models[pod.name] = pod.model or self.cfg.model
        self.created.setdefault(pod.name, pod.created)
        self.controller.add_instance(inst, ready=pod.ready)
        if pod.ready:
            self.gateway.add_instance(inst)

    def on_gone(self, name: str) -> None:
        self.gateway.remove_instance(name)
        self.controller.remove_instance(name)
        self.models.pop(name, None)
        self.created.pop(name, None)

    def routable(self) -> list[str]:
        return [i for i in self.controller.membership.routable_ids() if self.gateway.has_instance(i)]

    # ---- production-stack routes ----------------------------------------------------------------
    async def _health(self, _request: web.Request) -> web.Response:
        if self.discovery is not None and not self.discovery.healthy:
            return web.json_response({"status": "Service discovery module is down."}, status=503)
        return web.json_response({"status": "healthy"})

    async def _version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": smetric_version()})

    async def _engines(self, _request: web.Request) -> web.Response:
        return web.json_response([
            {"engine_id": i.id, "serving_models": [self.models.get(i.id, self.cfg.model)],
             "created": int(self.created.get(i.id, 0)), "url": i.http}
            for i in self.gateway.instances
        ])


class _ProdStackGauges:
    """production-stack router gauges its Grafana dashboard reads, from our own state."""

    def __init__(self, router: DropinRouter) -> None:
        self.router = router

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        r = self.router
        healthy = GaugeMetricFamily("vllm:healthy_pods_total", "Number of healthy vLLM pods", labels=["server"])
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in flight", labels=["server"])
        routable = set(r.routable())
        for inst in r.gateway.instances:
            healthy.add_metric([inst.http], 1.0 if inst.id in routable else 0.0)
            running.add_metric([inst.http], float(r.controller.load.in_flight(inst.id)))
        yield healthy
        yield running


def _strip_root(root: str) -> Any:
    @web.middleware
    async def strip(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith(root + "/"):
            request = request.clone(rel_url=request.rel_url.path[len(root):] + (
                "?" + request.rel_url.query_string if request.rel_url.query_string else ""))
            match = await request.app.router.resolve(request)
            return await match.handler(request)
        return await handler(request)

    return strip


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``smetric router``: takes production-stack's router arguments."""
    p = subparsers.add_parser(
        "router", help="drop-in for vLLM production-stack's router (same arguments)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_production_stack_arguments(p)
    add_smetric_arguments(p)
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(args.log_level.upper() if args.log_level != "trace" else "DEBUG")
    try:
        router = DropinRouter(args)
    except ArgsError as exc:
        log.error("router: %s", exc)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(router.serve())
        except OSError as exc:
            log.error("router: cannot start: %s", exc)
            return 1
    return 0
