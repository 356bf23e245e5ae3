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
        self._log: list[dict[str, Any]] = []  # every event, so a watch from a resourceVersion replays
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
        if "raw" not in event:
            self._log.append(event)
        for q in self._watchers:
            q.put_nowait(event)

    def send_raw(self, line: bytes) -> None:
        """A line that is no watch event at all (a broken proxy, a truncated write) to every watch."""
        self._send({"raw": line})

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
        since = int(request.query.get("resourceVersion") or 0)
        try:
            # as the API server does: a watch from a resourceVersion first gets what came after it
            for event in [e for e in self._log if _rv(e) > since]:
                if _selected(event["object"]["metadata"]["labels"], selector):
                    await resp.write(json.dumps(event).encode() + b"\n")
                since = _rv(event)
            while (event := await q.get()) is not None:
                if "raw" in event:
                    await resp.write(event["raw"])
                elif _rv(event) > since and _selected(event["object"]["metadata"]["labels"], selector):
                    await resp.write(json.dumps(event).encode() + b"\n")
        except ConnectionError:
            pass  # the client went away (a broken stream is re-listed by it)
        finally:
            self._watchers.remove(q)
        return resp


def _rv(event: dict[str, Any]) -> int:
    return int(event["object"]["metadata"]["resourceVersion"])


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


# ---- index APIs: agreement with route, and hostile input ------------------------------------------
def seed_index(app: Any, rng: Any, *, sessions: int = 24, turns: int = 4) -> list[list[int]]:
    """Fill ``app``'s index with agent sessions spread over its instances, on every tier (GPU blocks,
    LMCache chunks, global chunks), and return prompts to ask about: each session's history, its
    next turn, and unseen prompts. Tokens are random ids (the hash space does not care)."""
    from smetric_lmc.hashing import fast_chain, lmcache_chunk_chain

    hs, index = app.hashing, app.index
    ids = index.instances
    shared = [rng.randrange(1, 50_000) for _ in range(600)]  # a system prompt every session shares
    prompts: list[list[int]] = []
    for s in range(sessions):
        toks = list(shared)
        for _turn in range(turns):
            toks += [rng.randrange(1, 50_000) for _ in range(rng.randrange(100, 700))]
        iid = ids[s % len(ids)]
        tier = s % 3  # GPU tier, LMCache local tier, both (and the global tier for some)
        if tier in (0, 2):
            cut = len(toks) * rng.choice((1, 2, 3)) // 3
            index.gpu_stored_hashes(iid, fast_chain(toks[:cut], hs.block_size, root=hs.fast_root))
        chunks = lmcache_chunk_chain(toks, hs.chunk_size, root=hs.lmcache_root, algo=hs.lmcache_algo)
        if tier in (1, 2):
            index.lmcache_admit(iid, chunks[: rng.randrange(1, len(chunks) + 1)])
        if s % 4 == 0:
            index.global_stored(chunks[: len(chunks) // 2])
        prompts += [toks, toks + [rng.randrange(1, 50_000) for _ in range(300)],
                    [rng.randrange(1, 50_000) for _ in range(rng.randrange(50, 2000))]]
    return prompts


async def indexer_agreement(route_url: str, http_url: str, grpc_port: int | None, model: str,
                            prompts: list[list[int]], block_size: int, tokenize_key: Any = None) -> dict[str, Any]:
    """Ask each API about each prompt, then route it on the same index; count agreements.

    HTTP (Dynamo shape): the decision's ``best_local_hit_tokens`` is the largest ``cpu`` over
    instances, its ``local_hit_tokens`` the chosen instance's ``cpu``, its ``global_hit_tokens`` the
    ``global``; the RFC shape says the same; GetPodScores' score of each pod is its ``cpu`` in
    blocks. ``tokenize_key`` maps a prompt to the text GetPodScores is given (its tokenizer must map
    it back to the same ids)."""
    import aiohttp

    from smetric_lmc.client import AsyncRouteClient

    client = AsyncRouteClient(route_url, timeout_s=10.0)
    stub = pb2 = channel = None
    if grpc_port:
        import grpc

        from smetric_lmc.controller.indexer_grpc import load_proto

        pb2, pb2_grpc = load_proto()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb2_grpc.IndexerServiceStub(channel)
    agree = {"http": 0, "rfc": 0, "grpc": 0, "n": 0, "holders_max": 0}
    try:
        async with aiohttp.ClientSession() as http:
            for k, toks in enumerate(prompts):
                async with http.post(f"{http_url}/query", json={"token_ids": toks, "model_name": model}) as r:
                    dyn = (await r.json())["instances"]
                async with http.post(f"{http_url}/query", json={"token_ids": toks, "model": model}) as r:
                    rfc = (await r.json())["default"]
                scores = None
                if stub is not None:
                    reply = await stub.GetPodScores(pb2.GetPodScoresRequest(  # type: ignore[union-attr]
                        prompt=tokenize_key(toks), model_name=model), timeout=10)
                    scores = {s.pod: s.score for s in reply.scores}
                d = await client.route(f"agree-{k}", model=model, token_ids=toks, turn=1)
                cpu = {i: v["cpu"] for i, v in dyn.items()}
                agree["holders_max"] = max(agree["holders_max"], sum(1 for v in cpu.values() if v))
                ok = (d.instance_id in cpu and d.local_hit_tokens == cpu[d.instance_id]
                      and d.best_local_hit_tokens == max(cpu.values())
                      and all(v["global"] == d.global_hit_tokens for v in dyn.values()))
                agree["http"] += ok
                agree["rfc"] += ok and {i: v["CPU"] for i, v in rfc.items()} == cpu
                if scores is not None:
                    agree["grpc"] += scores.keys() == cpu.keys() and all(
                        scores[i] * block_size == cpu[i] for i in cpu)
                agree["n"] += 1
                await client.done(f"agree-{k}", instance_id=d.instance_id, prompt_tokens=len(toks))
    finally:
        await client.close()
        if channel is not None:
            await channel.close()
    return agree


def hostile_http_bodies(max_query_tokens: int) -> list[tuple[str, str, bytes, int]]:
    """(name, path, body, expected status) for the HTTP index API."""
    big = max_query_tokens + 1
    return [
        ("empty body", "/query", b"", 400),
        ("not json", "/query", b"{token_ids: [1,2", 400),
        ("json array", "/query", b"[1, 2, 3]", 400),
        ("json string", "/query", b'"query"', 400),
        ("no token_ids", "/query", b'{"model_name": "m"}', 400),
        ("token_ids string", "/query", b'{"model_name": "m", "token_ids": "1 2 3"}', 400),
        ("token_ids floats", "/query", b'{"model_name": "m", "token_ids": [1.5, 2]}', 400),
        ("token_ids negative", "/query", b'{"model_name": "m", "token_ids": [-1]}', 400),
        ("token_ids over u32", "/query", b'{"model_name": "m", "token_ids": [4294967296]}', 400),
        ("token_ids nested", "/query", b'{"model_name": "m", "token_ids": [[1], {"a": 2}]}', 400),
        ("token_ids bools", "/query", b'{"model_name": "m", "token_ids": [true, false]}', 400),
        ("model int", "/query", b'{"model_name": 7, "token_ids": [1]}', 400),
        ("model missing", "/query", b'{"token_ids": [1]}', 400),
        ("lora wrong type", "/query", b'{"model_name": "m", "lora_name": [1], "token_ids": [1]}', 400),
        ("cache_salt", "/query", b'{"model_name": "m", "cache_salt": "s", "token_ids": [1]}', 400),
        ("instance_id object", "/query", b'{"model_name": "m", "instance_id": {}, "token_ids": [1]}', 400),
        ("too many tokens", "/query", b'{"model_name": "m", "token_ids": [' + b",".join([b"1"] * big) + b"]}", 413),
        ("body over 8 MiB", "/query", b'{"model_name": "m", "token_ids": [' + b"1," * (5 << 20) + b"1]}", 413),
        ("8 MiB of numbers", "/query", b'{"model_name": "m", "token_ids": [' + b"1," * ((8 << 20) // 2 - 40) + b"1]}", 413),
        ("deep nesting", "/query", b"[" * 20_000 + b"]" * 20_000, 400),
        ("hashes missing", "/query_by_hash", b'{"model_name": "m"}', 400),
        ("hashes string", "/query_by_hash", b'{"model_name": "m", "block_hashes": "abc"}', 400),
        ("hashes over u64", "/query_by_hash", b'{"model_name": "m", "block_hashes": [18446744073709551616]}', 400),
        ("too many hashes", "/query_by_hash",
         b'{"model_name": "m", "block_hashes": [' + b",".join([b"1"] * big) + b"]}", 413),
    ]


async def hostile_http(http_url: str, max_query_tokens: int) -> list[tuple[str, int, int]]:
    """Send :func:`hostile_http_bodies`; (name, expected, got) for each."""
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as http:
        for name, path, body, expected in hostile_http_bodies(max_query_tokens):
            try:
                async with http.post(f"{http_url}{path}", data=body,
                                     headers={"Content-Type": "application/json"}) as r:
                    got = r.status
                    if got < 500:
                        payload = await r.json(content_type=None)
                        assert isinstance(payload, dict) and payload.get("error"), payload
            except aiohttp.ClientError:
                got = -1  # the server dropped the connection
            out.append((name, expected, got))
    return out


async def hostile_grpc(port: int, max_query_tokens: int) -> list[tuple[str, str, str]]:
    """Call GetPodScores with bad input as a grpcio client would; (name, expected code, got code)."""
    import grpc

    from smetric_lmc.controller.indexer_grpc import MAX_CHARS_PER_TOKEN, MAX_MESSAGE_BYTES, load_proto

    pb2, pb2_grpc = load_proto()
    out = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES)]) as ch:
        stub = pb2_grpc.IndexerServiceStub(ch)
        over = "x" * (max_query_tokens * MAX_CHARS_PER_TOKEN + 1)
        cases = [
            ("empty prompt", pb2.GetPodScoresRequest(prompt="", model_name="m"), "INVALID_ARGUMENT"),
            ("empty model", pb2.GetPodScoresRequest(prompt="hello", model_name=""), "INVALID_ARGUMENT"),
            ("prompt over the limit", pb2.GetPodScoresRequest(prompt=over, model_name="m"), "INVALID_ARGUMENT"),
            ("message over 8 MiB", pb2.GetPodScoresRequest(prompt="y" * (MAX_MESSAGE_BYTES + 1), model_name="m"),
             "RESOURCE_EXHAUSTED"),
            ("unknown pods", pb2.GetPodScoresRequest(prompt="1 2 3", model_name="m", pod_identifiers=["nope"] * 1000),
             "OK"),
        ]
        for name, req, expected in cases:
            try:
                await stub.GetPodScores(req, timeout=10)
                got = "OK"
            except grpc.aio.AioRpcError as exc:
                got = exc.code().name
            out.append((name, expected, got))
        # bytes that are no GetPodScoresRequest at all, on the method's path
        raw = ch.unary_unary("/indexer.v1.IndexerService/GetPodScores",
                             request_serializer=None, response_deserializer=None)
        # garbage does not parse; a field of the wrong wire type is skipped as unknown by protobuf,
        # leaving an empty prompt: both INVALID_ARGUMENT
        for name, payload, expected in (("garbage bytes", b"\xff\xfe\x00garbage", "INVALID_ARGUMENT"),
                                        ("wrong wire types", b"\x0d\x01\x02\x03\x04", "INVALID_ARGUMENT")):
            try:
                await raw(payload, timeout=10)
                got = "OK"
            except grpc.aio.AioRpcError as exc:
                got = exc.code().name
            out.append((name, expected, got))
    return out


# ---- scenarios on a running router ----------------------------------------------------------------
async def until(cond: Any, timeout: float = 15.0, what: str = "condition") -> float:
    """Wait for ``cond()``; seconds waited (AssertionError past ``timeout``)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not cond():
        if loop.time() - t0 > timeout:
            raise AssertionError(f"{what}: not reached in {timeout} s")
        await asyncio.sleep(0.005)
    return loop.time() - t0


async def complete(http: Any, url: str, prompt: str, headers: Mapping[str, str], model: str = "tiny") -> dict[str, str]:
    """One ``/v1/completions`` through the router; its response headers (AssertionError unless 200)."""
    async with http.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2},
                         headers=dict(headers)) as r:
        body = await r.json()
        assert r.status == 200 and body.get("choices"), body
        return dict(r.headers)


async def lmcache_scenario(router: Any, http: Any, url: str, engine_url: str, pull_url: str,
                           reply_url: str) -> dict[str, Any]:
    """LMCache worker messages on the router's pull / reply ports moving a follow-up's decision.

    A follow-up first lands anywhere (nothing indexed); one instance's LMCache worker then admits
    the chunks of a longer prompt extending it, and the same follow-up asked again goes there.
    (The first route leaves a pending credit for its own prompt on the instance it chose, so the
    admitted prompt extends past that credit.) Returns what happened, for the caller to judge."""
    from smetric_lmc.hashing import lmcache_chunk_chain

    base = "".join(f"line {k} of a long shared agent context\n" for k in range(40))
    prompt = base + "".join(f"turn {k}: tool output and the agent's reply\n" for k in range(30))
    async with http.post(f"{engine_url}/tokenize", json={"model": "tiny", "prompt": prompt}) as r:
        tokens = (await r.json())["tokens"]
    hs = router.controller.hashing
    chunks = lmcache_chunk_chain(tokens, hs.chunk_size, root=hs.lmcache_root, algo=hs.lmcache_algo)
    follow = {"X-SMetric-Turn": "1"}
    before = await complete(http, url, base, follow)
    ids = sorted(i.id for i in router.gateway.instances)
    holder = next(i for i in ids if i != before["X-SMetric-Instance"])
    worker = LMCacheWorkerStandIn(pull_url, reply_url, holder)
    index = router.controller.index
    try:
        registered = type(await worker.register()).__name__
        admitted = index.stats["lmcache_admitted"]
        await worker.admit(chunks)
        await until(lambda: index.stats["lmcache_admitted"] >= admitted + len(chunks), what="admits indexed")
        after = [await complete(http, url, prompt, follow) for _ in range(3)]
        await worker.admit(chunks, evict=True)
        await until(lambda: not any(index.lookup([], chunks).lmcache_chunks), what="evicts indexed")
    finally:
        worker.close()
    return {"before": before, "after": after, "holder": holder, "tokens": tokens, "prompt": prompt,
            "chunks": len(chunks), "chunk_size": hs.chunk_size, "registered": registered,
            "moved": before["X-SMetric-Local-Hit"] == "0" and before["X-SMetric-Reason"] != "sticky"
            and {h["X-SMetric-Instance"] for h in after} == {holder}
            and {h["X-SMetric-Reason"] for h in after} == {"sticky"}
            and all(int(h["X-SMetric-Local-Hit"]) == len(chunks) * hs.chunk_size for h in after)}
