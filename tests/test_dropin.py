"""``smetric router``: production-stack's chart arguments, routes and LMCache ports, on mock engines.

What runs for real: the router (controller, LMCache worker server, gateway) on loopback sockets,
SMetric's mock engines (vLLM's HTTP protocol) as child processes, the official ``kubernetes``
client, ``grpcio``. What cannot run here and is stood in for: Helm (the argument list below is the
chart template's, recorded), a Kubernetes API server (there is no cluster here: a local aiohttp
server answers pod list / watch with API-server-shaped pods), LMCache workers (their controller
messages are sent from PUSH / DEALER sockets, encoded by ``controller/lmcache_proto.py``, which
``test_lmcache_proto.py`` checks against LMCache 0.5.6's own classes).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from smetric_lmc.dropin import harness
from smetric_lmc.dropin.args import ArgsError, build_parser
from smetric_lmc.dropin.router import DropinRouter, build_config
from smetric_lmc.lab.mock_engine.stack import start_mock_engines
from smetric_lmc.workers.launch import free_ports

#: The router's argument list as production-stack's chart (vllm-stack 0.1.12, template
#: helm/templates/deployment-router.yaml at production-stack a6c01db) renders it for these values:
#:   routerSpec: {serviceDiscovery: static, staticBackends: <2 URLs>, staticModels: "tiny,tiny",
#:     routingLogic: kvaware, sessionKey: x-user-id, engineScrapeInterval: 15, requestStatsWindow: 60,
#:     lmcacheControllerPort: 9000, lmcacheControllerReplyPort: 9001, lmcacheControllerHeartbeatPort: 9002,
#:     otel: {endpoint: "otel-collector:4317"}, extraArgs: [--smetric-static-ids, "pod-a,pod-b"]}
CHART_VERSION = "0.1.12"
CHART_STATIC_ARGS = [
    "--host", "0.0.0.0", "--port", "8000", "--service-discovery", "static",
    "--static-backends", "BACKENDS", "--static-models", "tiny,tiny",
    "--routing-logic", "kvaware", "--session-key", "x-user-id",
    "--engine-stats-interval", "15", "--request-stats-window", "60",
    "--smetric-static-ids", "pod-a,pod-b",
    "--lmcache-controller-port", "9000", "--lmcache-controller-reply-port", "9001",
    "--lmcache-controller-heartbeat-port", "9002",
    "--otel-endpoint", "otel-collector:4317", "--otel-service-name", "vllm-router",
]
#: The chart's default k8s discovery list (values.yaml defaults, servingEngineSpec.labels
#: {environment: test, release: test}, release namespace "default").
CHART_K8S_ARGS = [
    "--host", "0.0.0.0", "--port", "8000", "--service-discovery", "k8s", "--k8s-namespace", "default",
    "--k8s-service-discovery-type", "pod-ip", "--k8s-label-selector", "environment=test,release=test",
    "--routing-logic", "roundrobin", "--engine-stats-interval", "15", "--request-stats-window", "60",
]


def test_recorded_lists_are_what_the_template_renders() -> None:
    values = {"serviceDiscovery": "static", "staticBackends": "BACKENDS", "staticModels": "tiny,tiny",
              "routingLogic": "kvaware", "sessionKey": "x-user-id", "lmcacheControllerPort": 9000,
              "lmcacheControllerReplyPort": 9001, "lmcacheControllerHeartbeatPort": 9002,
              "otel": {"endpoint": "otel-collector:4317"}, "extraArgs": ["--smetric-static-ids", "pod-a,pod-b"]}
    assert harness.CHART_VERSION == CHART_VERSION
    assert harness.chart_router_args(values) == CHART_STATIC_ARGS
    assert harness.chart_router_args({}) == CHART_K8S_ARGS


def test_every_chart_routing_logic_maps_and_bad_lists_say_why() -> None:
    p = build_parser()
    for logic, policy in (("roundrobin", "round_robin"), ("session", "smetric"), ("prefixaware", "smetric"),
                          ("kvaware", "smetric"), ("smetric", "smetric"), ("smetric_ect", "smetric_ect")):
        args = p.parse_args([*CHART_K8S_ARGS, "--routing-logic", logic])
        assert build_config(args).policy.name == policy
    with pytest.raises(ArgsError, match="disaggregated prefill"):
        build_config(p.parse_args([*CHART_K8S_ARGS, "--routing-logic", "disaggregated_prefill"]))
    with pytest.raises(ArgsError, match="needs --static-backends"):
        build_config(p.parse_args(["--service-discovery", "static"]))
    with pytest.raises(ArgsError, match="2 --static-backends but 1"):
        build_config(p.parse_args(["--service-discovery", "static", "--static-backends", "http://a:1,http://b:1",
                                   "--static-models", "m"]))
    cfg = build_config(p.parse_args(CHART_K8S_ARGS))
    assert cfg.lmcache.enabled and cfg.lmcache.pull_url.endswith(":9000")
    assert cfg.lmcache.reply_url.endswith(":9001") and cfg.lmcache.heartbeat_url.endswith(":9002")


def _substitute(argv: list[str], subs: dict[str, str]) -> list[str]:
    return [subs.get(a, a) for a in argv]


@contextlib.asynccontextmanager
async def running_router(argv: list[str], **kw: Any) -> AsyncIterator[DropinRouter]:
    router = DropinRouter(build_parser().parse_args(argv), **kw)
    await router.start()
    try:
        yield router
    finally:
        await router.close()


@pytest.fixture
def mock_engines(tmp_path: Path) -> Any:
    started = start_mock_engines(2, tmp_path, extra_args=["--speed", "50"])
    yield [m for m, _ in started]
    for g in {id(g): g for _, g in started}.values():
        g.stop()


@pytest.mark.integration  # mock-engine processes
async def test_chart_argument_list_runs_router_on_mock_engines(mock_engines: list[Any]) -> None:
    pull, reply, hb = free_ports(3)
    subs = {"BACKENDS": ",".join(m.http_url for m in mock_engines), "8000": "0", "9000": str(pull),
            "9001": str(reply), "9002": str(hb)}  # port 0: any free port for the router's HTTP
    argv = [*_substitute(CHART_STATIC_ARGS, subs), "--smetric-route-url", "tcp://127.0.0.1:*",
            "--smetric-metrics-port", "0", "--smetric-indexer-http-port", "-1",
            "--smetric-lmcache-host", "127.0.0.1"]
    if importlib.util.find_spec("grpc_tools") is not None:
        argv += ["--smetric-indexer-grpc-port", "-1"]
    async with running_router(argv) as router, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{router.port}"
        apis = router.controller.peer_apis
        http_api, grpc_api = apis.http_port, apis.grpc.port if apis.grpc is not None else 0
        # production-stack's routes: the chart's probes hit /health
        async with http.get(f"{url}/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "healthy"
        async with http.get(f"{url}/version") as r:
            assert "version" in await r.json()
        async with http.get(f"{url}/engines") as r:
            engines = await r.json()
        assert [e["engine_id"] for e in engines] == ["pod-a", "pod-b"]
        assert engines[0]["serving_models"] == ["tiny"]
        async with http.get(f"{url}/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
        await harness.until(lambda: sorted(router.routable()) == ["pod-a", "pod-b"], what="engines routable")

        # LMCache worker messages on the chart's pull port change the decisions
        got = await harness.lmcache_scenario(router, http, url, mock_engines[0].http_url,
                                             f"tcp://127.0.0.1:{pull}", f"tcp://127.0.0.1:{reply}")
        assert got["registered"] == "RegisterRetMsg"
        assert got["chunks"] * got["chunk_size"] > len(got["prompt"]) * 4 // 7  # past the first route's credit
        assert got["before"]["X-SMetric-Local-Hit"] == "0" and got["before"]["X-SMetric-Reason"] != "sticky"
        assert {h["X-SMetric-Instance"] for h in got["after"]} == {got["holder"]}
        assert {h["X-SMetric-Reason"] for h in got["after"]} == {"sticky"}
        assert got["moved"]
        holder = got["holder"]
        other = "pod-a" if holder == "pod-b" else "pod-b"

        # the Dynamo / Mooncake HTTP query and llm-d GetPodScores (tokenizing with an engine's
        # /tokenize) answer from the same index: the chunks are evicted again by now, so the
        # holder keeps only the pending credit of the routes above, in whole blocks
        async with http.post(f"http://127.0.0.1:{http_api}/query",
                             json={"token_ids": got["tokens"], "model_name": "tiny"}) as r:
            answer = await r.json()
        bs = router.controller.hashing.block_size
        assert answer["instances"][holder]["cpu"] == len(got["tokens"]) // bs * bs
        assert answer["instances"][holder]["gpu"] == 0
        if "--smetric-indexer-grpc-port" in argv:
            scores = await _pod_scores(grpc_api, got["prompt"])
            assert scores[holder] == answer["instances"][holder]["cpu"] / bs
            assert scores[other] == answer["instances"][other]["cpu"] / bs < scores[holder]

        # session headers as the peers spell them: the second request of a session is a follow-up
        for header in ("x-user-id", "x-dynamo-session-id", "X-SMG-Routing-Key"):
            first = await harness.complete(http, url, f"{header} session prompt", {header: f"s-{header}"})
            second = await harness.complete(http, url, f"{header} session prompt, longer", {header: f"s-{header}"})
            assert (first["X-SMetric-Turn"], second["X-SMetric-Turn"]) == ("0", "1"), header

        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        assert 'vllm:healthy_pods_total{server="' in text
        assert "smetric_gateway" in text


async def _pod_scores(port: int, prompt: str, pods: tuple[str, ...] = ()) -> dict[str, float]:
    import grpc

    from smetric_lmc.controller.indexer_grpc import load_proto

    pb2, pb2_grpc = load_proto()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = await pb2_grpc.IndexerServiceStub(ch).GetPodScores(
            pb2.GetPodScoresRequest(prompt=prompt, model_name="tiny", pod_identifiers=list(pods)), timeout=10)
    return {s.pod: s.score for s in reply.scores}


def _need_kubernetes() -> None:
    if importlib.util.find_spec("kubernetes") is None:
        if os.environ.get("CI"):
            pytest.fail("the kubernetes client is not installed (pip install -e '.[k8s]')")
        pytest.skip("LOUD SKIP: the kubernetes client is not installed (pip install -e '.[k8s]')")


@pytest.mark.integration  # mock-engine processes and a Kubernetes API stand-in
async def test_k8s_discovery_adds_and_removes_engines(tmp_path: Path) -> None:
    """No cluster here: a local stand-in serves the Kubernetes API's pod list and watch."""
    _need_kubernetes()
    engine_port = free_ports(1)[0]
    ips = ["127.0.0.2", "127.0.0.3"]
    started = []
    try:
        for k, ip in enumerate(ips):  # pods: one IP each, the same port (--k8s-port)
            started += start_mock_engines(1, tmp_path / f"e{k}", extra_args=[
                "--host", ip, "--port", str(engine_port), "--id-prefix", f"e{k}"])
        api = harness.KubeApiStandIn()
        await api.start()
        labels = {"environment": "test", "release": "test", "model": "tiny"}
        api.put("vllm-0", ips[0], ready=True, labels=labels)
        api.put("vllm-1", ips[1], ready=False, labels=labels)  # still starting
        api.put("other", "127.0.0.9", ready=True, labels={"environment": "prod"})  # not selected
        port, pull = free_ports(2)
        argv = [*_substitute(CHART_K8S_ARGS, {"8000": str(port)}), "--k8s-port", str(engine_port),
                "--routing-logic", "kvaware", "--smetric-route-url", "tcp://127.0.0.1:*",
                "--smetric-metrics-port", "0", "--lmcache-controller-port", str(pull),
                "--lmcache-controller-reply-port", str(free_ports(1)[0]),
                "--lmcache-controller-heartbeat-port", str(free_ports(1)[0]), "--smetric-lmcache-host", "127.0.0.1",
                # the mock engines' KV events (vLLM's protocol): port + 1000, replay port + 1001
                "--smetric-k8s-kv-events-port", str(engine_port + 1000),
                "--smetric-k8s-kv-replay-port", str(engine_port + 1001), "--smetric-block-size", "32"]
        async with running_router(argv, k8s_api_client=harness.kube_api_client(api.url)) as router, \
                aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}"
            # the discovery thread hands pods over one by one: wait for both
            await harness.until(lambda: router.controller.has_instance("vllm-1") and router.routable() == ["vllm-0"],
                                what="ready pod routable, starting pod indexed but not routed")
            assert not router.controller.has_instance("other")
            h = await harness.complete(http, url, "hello " * 40, {})
            assert h["X-SMetric-Instance"] == "vllm-0"
            # the pod's vLLM KV events reach the GPU tier
            await harness.until(lambda: router.controller.index.gpu_blocks_of("vllm-0") > 0, what="GPU tier")
            api.put("vllm-1", ips[1], ready=True, labels=labels)
            await harness.until(lambda: sorted(router.routable()) == ["vllm-0", "vllm-1"], what="second pod ready")
            async with http.get(f"{url}/engines") as r:
                assert sorted(e["engine_id"] for e in await r.json()) == ["vllm-0", "vllm-1"]
            # a broken watch stream: discovery re-lists (after a short backoff) and keeps both pods
            errors = router.discovery.counters["errors"]
            api.send_raw(b'{"type": "ADDED", "object": {"metadata": \n')
            await harness.until(lambda: router.discovery.counters["errors"] > errors and router.discovery.healthy,
                                what="re-listed after a broken watch")
            assert sorted(router.routable()) == ["vllm-0", "vllm-1"]
            api.delete("vllm-0")
            await harness.until(lambda: router.routable() == ["vllm-1"], what="deleted pod out")
            assert not router.controller.has_instance("vllm-0")
            for _ in range(3):
                assert (await harness.complete(http, url, "hello again", {}))["X-SMetric-Instance"] == "vllm-1"
            api.put("vllm-1", ips[1], ready=True, labels=labels, terminating=True)
            await harness.until(lambda: router.routable() == [], what="terminating pod out")
            async with http.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as r:
                assert r.status == 503
            assert any("watch=true" in q.lower() for q in api.requests)
            assert all("labelSelector=environment%3Dtest%2Crelease%3Dtest" in q for q in api.requests)
        await api.close()
    finally:
        for g in {id(g): g for _, g in started}.values():
            g.stop()


async def test_root_path_serves_the_same_routes() -> None:
    pull, reply, hb = free_ports(3)
    argv = ["--port", "0", "--service-discovery", "static", "--static-backends", "http://127.0.0.1:9",
            "--static-models", "m", "--root-path", "/vllm", "--lmcache-controller-port", str(pull),
            "--lmcache-controller-reply-port", str(reply), "--lmcache-controller-heartbeat-port", str(hb),
            "--smetric-lmcache-host", "127.0.0.1", "--smetric-metrics-port", "0",
            "--smetric-route-url", "tcp://127.0.0.1:*"]
    async with running_router(argv) as router, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{router.port}"
        for path in ("/vllm/health", "/health", "/vllm/version?x=1"):
            async with http.get(base + path) as r:
                assert r.status == 200, path
        async with http.get(base + "/vllm/engines") as r:
            assert [e["engine_id"] for e in await r.json()] == ["127.0.0.1:9"]


def test_cli_takes_the_chart_list() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "smetric_lmc.cli", "router", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--lmcache-controller-heartbeat-port" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "smetric_lmc.cli", "router", *CHART_K8S_ARGS, "--routing-logic",
                          "disaggregated_prefill"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "disaggregated prefill routing is not supported" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_smetric_config_fills_what_the_chart_does_not_say(tmp_path: Path) -> None:
    cfg_file = tmp_path / "smetric.yaml"
    cfg_file.write_text("policy: {hit_ratio: 0.25, overload: .inf}\nhashing: {block_size: 32, fast_namespace: tiny}\n"
                        "global_store: {kind: redis, url: redis://127.0.0.1:6379/0}\n")
    args = build_parser().parse_args([*CHART_K8S_ARGS, "--routing-logic", "smetric_ect",
                                      "--smetric-config", str(cfg_file)])
    cfg = build_config(args)
    assert (cfg.policy.name, cfg.policy.hit_ratio, cfg.policy.overload) == ("smetric_ect", 0.25, float("inf"))
    assert (cfg.hashing.block_size, cfg.global_store.kind) == (32, "redis")
    assert cfg.lmcache.enabled and cfg.instances == []
    with pytest.raises(ArgsError, match="unknown field"):
        cfg_file.write_text("policy: {nope: 1}\n")
        build_config(args)
