"""Stand-ins for what the drop-in meets in a cluster, used by its tests and ``bench/dropin.py``.

There is no Kubernetes cluster, Helm or GPU here, so:

* :func:`chart_router_args` renders the router's argument list exactly as production-stack's chart
  template does (``helm/templates/deployment-router.yaml`` of chart ``vllm-stack`` 0.1.12, read at
  production-stack commit ``a6c01db``): same flags, same order, same conditions;
* :class:`KubeApiStandIn` is a local HTTP server answering the two Kubernetes API calls discovery
  makes (``GET /api/v1/namespaces/{ns}/pods`` as a list and as a ``watch=true`` stream) with pod
  objects in the shape the API server sends, so the official ``kubernetes`` client is what parses
  them;
* :class:`LMCacheWorkerStandIn` plays an LMCache worker's sockets (PUSH to pull, DEALER to reply)
  with the LMCache 0.5.x controller messages (``controller/lmcache_proto.py``, checked byte for
  byte against LMCache's own classes in ``tests/test_lmcache_proto.py``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from smetric_lmc.controller import lmcache_proto as P

CHART_VERSION = "0.1.12"  # helm/Chart.yaml `version` of the template rendered below
CHART_COMMIT = "a6c01db05f65f556235413ba8dbcfb0c01132fff"


#: routerSpec defaults of the chart's values.yaml that the router template reads.
VALUES_DEFAULTS: dict[str, Any] = {
    "containerPort": 8000, "serviceDiscovery": "k8s", "k8sServiceDiscoveryType": "pod-ip", "staticBackends": "",
    "staticModels": "", "routingLogic": "roundrobin", "prefixMinMatchLength": 0, "sessionKey": "", "rootPath": "",
    "extraArgs": [], "engineScrapeInterval": 15, "requestStatsWindow": 60, "lmcacheControllerPort": "",
    "otel": {"endpoint": "", "serviceName": "vllm-router", "secure": False},
}


def chart_router_args(values: Mapping[str, Any], *, namespace: str = "default",
                      engine_labels: Mapping[str, str] | None = None, enable_engine: bool = True) -> list[str]:
    """The ``args:`` list the chart renders for ``routerSpec`` ``values`` (keys as in values.yaml)."""
    v = {**VALUES_DEFAULTS, **values}
    out = ["--host", "0.0.0.0", "--port", str(v["containerPort"]),
           "--service-discovery", v.get("serviceDiscovery") or "k8s"]
    if v["serviceDiscovery"] == "k8s":
        out += ["--k8s-namespace", namespace,
                "--k8s-service-discovery-type", v.get("k8sServiceDiscoveryType") or "pod-ip"]
        if enable_engine:  # labels.toCommaSeparatedList: key=value joined by commas, keys sorted (Go maps)
            labels = engine_labels or {"environment": "test", "release": "test"}
            out += ["--k8s-label-selector", ",".join(f"{k}={labels[k]}" for k in sorted(labels))]
    if v["serviceDiscovery"] == "static":
        out += ["--static-backends", v["staticBackends"], "--static-models", v["staticModels"]]
    out += ["--routing-logic", v["routingLogic"]]
    for key, flag in (("prefixMinMatchLength", "--prefix-min-match-length"), ("sessionKey", "--session-key"),
                      ("rootPath", "--root-path"), ("engineScrapeInterval", "--engine-stats-interval"),
                      ("requestStatsWindow", "--request-stats-window")):
        if v.get(key):
            out += [flag, str(v[key])]
    out += [str(a) for a in v.get("extraArgs") or []]
    for key, flag in (("lmcacheControllerPort", "--lmcache-controller-port"),
                      ("lmcacheControllerReplyPort", "--lmcache-controller-reply-port"),
                      ("lmcacheControllerHeartbeatPort", "--lmcache-controller-heartbeat-port")):
        if v.get(key):
            out += [flag, str(v[key])]
    otel = v.get("otel") or {}
    if otel.get("endpoint"):
        out += ["--otel-endpoint", otel["endpoint"], "--otel-service-name", otel.get("serviceName") or "vllm-router"]
        if otel.get("secure"):
            out += ["--otel-secure"]
    return out


# ---- Kubernetes API stand-in ----------------------------------------------------------------------
def pod_object(name: str, ip: str | None, *, ready: bool, labels: Mapping[str, str], rv: int,
               namespace: str = "default", terminating: bool = False) -> dict[str, Any]:
    """A ``v1.Pod`` as the API server serializes it (the fields discovery reads, and those the
    official client requires to build its model objects)."""
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc).isoformat().replace("+00:00", "Z")
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"uid-{name}", "resourceVersion": str(rv),
                            "creationTimestamp": now, "labels": dict(labels)}
    if terminating:
        meta["deletionTimestamp"] = now
    status: dict[str, Any] = {
        "phase": "Running" if ready else "Pending",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "vllm", "ready": ready, "restartCount": 0, "image": "vllm/vllm-openai",
                               "imageID": "", "started": ready, "state": {"running": {"startedAt": now}}}],
    }
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}, "status": status}


def _selected(labels: Mapping[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, _, want = term.partition("=")
        if labels.get(key.strip()) != want.strip():
            return False
    return True


class KubeApiStandIn:
    """Answers ``list`` and ``watch`` of namespaced pods on 127.0.0.1 (no cluster here).

    ``put`` / ``delete`` change the pod set and stream ``MODIFIED``/``ADDED`` / ``DELETED`` events
    to every open watch, as the API server does."""

    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 100
        self._watchers: list[asyncio.Queue[dict[str, Any] | None]] = []
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.requests: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def close(self) -> None:
        for q in self._watchers:
            q.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    def put(self, name: str, ip: str | None, *, ready: bool, labels: Mapping[str, str],
            terminating: bool = False) -> None:
        self.rv += 1
        kind = "MODIFIED" if name in self.pods else "ADDED"
        self.pods[name] = pod_object(name, ip, ready=ready, labels=labels, rv=self.rv, namespace=self.namespace,
                                     terminating=terminating)
        self._send({"type": kind, "object": self.pods[name]})

    def delete(self, name: str) -> None:
        pod = self.pods.pop(name)
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self._send({"type": "DELETED", "object": pod})

    def _send(self, event: dict[str, Any]) -> None:
        for q in self._watchers:
            q.put_nowait(event)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        selector = request.query.get("labelSelector", "")
        self.requests.append(request.path_qs)
        if request.match_info["ns"] != self.namespace:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        if request.query.get("watch") not in ("true", "True", "1"):
            items = [p for p in self.pods.values() if _selected(p["metadata"]["labels"], selector)]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.rv)}, "items": items})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._watchers.append(q)
        try:
            while (event := await q.get()) is not None:
                if _selected(event["object"]["metadata"]["labels"], selector):
                    await resp.write(json.dumps(event).encode() + b"\n")
        finally:
            self._watchers.remove(q)
        return resp


def kube_api_client(url: str) -> Any:
    """An official-client ``ApiClient`` pointed at ``url`` (what in-cluster config gives in a pod)."""
    from kubernetes import client

    conf = client.Configuration()
    conf.host = url
    return client.ApiClient(conf)


# ---- LMCache worker stand-in ----------------------------------------------------------------------
class LMCacheWorkerStandIn:
    """An LMCache worker's controller sockets: registers, then pushes admit / evict batches."""

    def __init__(self, pull_url: str, reply_url: str, instance_id: str, worker_id: int = 0) -> None:
        self.ctx = zmq.asyncio.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(pull_url)
        self.req = self.ctx.socket(zmq.DEALER)
        self.req.connect(reply_url)
        self.instance_id, self.worker_id = instance_id, worker_id
        self.seq = 0

    async def register(self) -> Any:
        msg = P.RegisterMsg(instance_id=self.instance_id, worker_id=self.worker_id, ip="127.0.0.1", port=8500,
                            peer_init_url=None)
        await self.req.send_multipart([b"", P.encode(msg)])
        frames = await asyncio.wait_for(self.req.recv_multipart(), 5)
        return P.decode(frames[-1])

    async def admit(self, chunk_hashes: Sequence[int], *, evict: bool = False,
                    location: str = "LocalCPUBackend") -> None:
        ops = []
        for h in chunk_hashes:
            ops.append(P.KVOpEvent(op_type="evict" if evict else "admit", key=h, seq_num=self.seq))
            self.seq += 1
        await self.push.send(P.encode(P.BatchedKVOperationMsg(
            instance_id=self.instance_id, worker_id=self.worker_id, location=location, operations=ops)))

    def close(self) -> None:
        for s in (self.push, self.req):
            s.close(linger=0)
        self.ctx.term()


def encode_json(obj: Any) -> bytes:
    return msgspec.json.encode(obj)
