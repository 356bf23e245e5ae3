"""The drop-in, shown end to end: production-stack's chart -> ``smetric router``, and the index APIs.

    python bench/dropin.py            # 3 k8s pods, 24 seeded sessions
    python bench/dropin.py --quick    # 2 pods, 8 sessions

What runs for real: ``smetric router`` (controller, LMCache worker server, gateway) on loopback,
SMetric's mock engines (vLLM's HTTP protocol) as child processes, the official ``kubernetes``
client, grpcio. Stood in for (nothing of them runs here): Helm (the router's argument list is
rendered as chart vllm-stack 0.1.12's template renders it: ``smetric_lmc/dropin/harness.py``), the
Kubernetes API server (a local server answers pod list / watch; there is no cluster), LMCache
workers (their 0.5.x controller messages from PUSH / DEALER sockets).

1. chart_args_accepted: the chart's static and k8s argument lists parse, the static one starts the
   router on two mock engines, and /health, /version, /engines, /v1/models and a completion answer.
2. lmcache_worker_msgs_routed: a follow-up lands on the instance whose LMCache worker admitted its
   chunks on the chart's pull port (9000's stand-in), with its LMCache hit, where it did not before.
3. k8s_pods_discovered: Ready pods the router routes to, found by list + watch; one Ready and one
   starting pod plus a pod of another label are served; k8s_pod_removed_out_s: from the API's DELETED
   event to the pod being out of routing (wall clock, on this shared machine: steal shown).
4. indexer_http_agree / getpodscores_agree: on a controller with a seeded index (GPU, LMCache and
   global tiers), the share of prompts whose Dynamo /query (and the RFC /query) and llm-d
   GetPodScores answers match the controller's own route decision on the same index.
5. hostile_inputs / crashes: malformed HTTP bodies and gRPC requests sent; a crash is a 5xx, a
   dropped connection, an unexpected status, or the controller no longer answering a route.

Ends with ONE JSON line: ``{"chart_args_accepted", "lmcache_worker_msgs_routed",
"k8s_pods_discovered", "k8s_pod_removed_out_s", "indexer_http_agree", "getpodscores_agree",
"hostile_inputs", "crashes"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from kit.soak_load import steal_reader

from smetric_lmc.config import PeerApisConfig, parse_config
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.dropin import harness
from smetric_lmc.dropin.args import build_parser
from smetric_lmc.dropin.router import DropinRouter, build_config
from smetric_lmc.lab.mock_engine.stack import start_mock_engines
from smetric_lmc.workers.launch import free_ports

STATIC_VALUES = {"serviceDiscovery": "static", "staticBackends": "BACKENDS", "staticModels": "tiny,tiny",
                 "routingLogic": "kvaware", "sessionKey": "x-user-id", "lmcacheControllerPort": 9000,
                 "lmcacheControllerReplyPort": 9001, "lmcacheControllerHeartbeatPort": 9002,
                 "otel": {"endpoint": "otel-collector:4317"},
                 "extraArgs": ["--smetric-static-ids", "pod-a,pod-b"]}


def step(n: int, total: int, what: str) -> None:
    print(f"[{n}/{total}] {what}", flush=True)


async def chart_and_lmcache(engines: list[Any]) -> tuple[bool, bool]:
    k8s_list = harness.chart_router_args({})
    build_config(build_parser().parse_args(k8s_list))  # the chart's default k8s list is accepted
    pull, reply, hb = free_ports(3)
    subs = {"BACKENDS": ",".join(e.http_url for e in engines), "8000": "0", "9000": str(pull),
            "9001": str(reply), "9002": str(hb)}
    argv = [subs.get(a, a) for a in harness.chart_router_args(STATIC_VALUES)]
    print("  chart args:", " ".join(harness.chart_router_args(STATIC_VALUES)))
    argv += ["--smetric-route-url", "tcp://127.0.0.1:*", "--smetric-metrics-port", "0",
             "--smetric-lmcache-host", "127.0.0.1"]
    router = DropinRouter(build_parser().parse_args(argv))
    await router.start()
    try:
        url = f"http://127.0.0.1:{router.port}"
        async with aiohttp.ClientSession() as http:
            ok = True
            for path in ("/health", "/version", "/engines", "/v1/models"):
                async with http.get(url + path) as r:
                    ok &= r.status == 200
            await harness.until(lambda: len(router.routable()) == 2, what="engines routable")
            await harness.complete(http, url, "hello", {})
            got = await harness.lmcache_scenario(router, http, url, engines[0].http_url,
                                                 f"tcp://127.0.0.1:{pull}", f"tcp://127.0.0.1:{reply}")
        print(f"  routes answered: {ok}; follow-up before admits -> {got['before']['X-SMetric-Instance']} "
              f"({got['before']['X-SMetric-Reason']}, hit {got['before']['X-SMetric-Local-Hit']}); after "
              f"{got['chunks']} chunks admitted on {got['holder']} -> "
              f"{sorted({h['X-SMetric-Instance'] for h in got['after']})} "
              f"({got['after'][0]['X-SMetric-Reason']}, hit {got['after'][0]['X-SMetric-Local-Hit']})")
        return ok, bool(got["moved"])
    finally:
        await router.close()


async def k8s(n_pods: int, workdir: Path) -> tuple[int, float]:
    engine_port = free_ports(1)[0]
    ips = [f"127.0.0.{k + 2}" for k in range(n_pods)]
    started = []
    api = harness.KubeApiStandIn()
    try:
        for k, ip in enumerate(ips):
            started += start_mock_engines(1, workdir / f"pod{k}", extra_args=[
                "--host", ip, "--port", str(engine_port), "--id-prefix", f"p{k}"])
        await api.start()
        labels = {"environment": "test", "release": "test", "model": "tiny"}
        for k, ip in enumerate(ips):
            api.put(f"vllm-{k}", ip, ready=True, labels=labels)
        api.put("vllm-starting", "127.0.0.250", ready=False, labels=labels)
        api.put("other-release", "127.0.0.251", ready=True, labels={"environment": "prod"})
        pull, reply, hb = free_ports(3)
        argv = [*[{"8000": "0"}.get(a, a) for a in harness.chart_router_args({"routingLogic": "kvaware"})],
                "--k8s-port", str(engine_port), "--smetric-route-url", "tcp://127.0.0.1:*",
                "--smetric-metrics-port", "0", "--lmcache-controller-port", str(pull),
                "--lmcache-controller-reply-port", str(reply), "--lmcache-controller-heartbeat-port", str(hb),
                "--smetric-lmcache-host", "127.0.0.1"]
        router = DropinRouter(build_parser().parse_args(argv), k8s_api_client=harness.kube_api_client(api.url))
        await router.start()
        try:
            wanted = [f"vllm-{k}" for k in range(n_pods)]
            await harness.until(lambda: sorted(router.routable()) == wanted, timeout=30, what="pods routable")
            discovered = len(router.routable())
            async with aiohttp.ClientSession() as http:
                served = {(await harness.complete(http, f"http://127.0.0.1:{router.port}", f"p{k}", {}))[
                    "X-SMetric-Instance"] for k in range(4 * n_pods)}
            print(f"  {discovered} Ready pods routable (served: {sorted(served)}); starting pod indexed, "
                  f"not routed: {router.controller.has_instance('vllm-starting')}")
            t0 = time.monotonic()
            api.delete("vllm-0")
            await harness.until(lambda: "vllm-0" not in router.routable(), what="deleted pod out")
            out_s = time.monotonic() - t0
            print(f"  pod vllm-0 deleted -> out of routing in {1000 * out_s:.1f} ms")
            return discovered, out_s
        finally:
            await router.close()
    finally:
        await api.close()
        for g in {id(g): g for _, g in started}.values():
            g.stop()


async def index_apis(sessions: int) -> dict[str, Any]:
    max_tokens = PeerApisConfig().max_query_tokens  # the shipped bound
    cfg = parse_config({
        "model": "tiny", "hashing": {"block_size": 16},
        "instances": [{"id": f"i{k}", "http": "http://127.0.0.1:9"} for k in range(8)],
        "server": {"route_url": "tcp://127.0.0.1:*", "metrics_port": 0},
        "load": {"metrics_poll_s": 0, "instance_timeout_s": 0},
        "lmcache": {"enabled": True, "pull_url": "tcp://127.0.0.1:*", "reply_url": "tcp://127.0.0.1:*"},
        "peer_apis": {"http_port": -1, "grpc_port": -1, "max_query_tokens": max_tokens},
    })
    app = ControllerApp(cfg, enable_metrics_http=False)
    await app.start()
    try:
        assert app.peer_apis is not None and app.peer_apis.grpc is not None
        http_port, grpc_port = app.peer_apis.http_port, app.peer_apis.grpc.port

        async def text_tokens(_model: str, prompt: str) -> list[int]:  # stands in for the model's tokenizer
            return [int(t) for t in prompt.split()]

        app.peer_apis.grpc.tokenize = text_tokens
        prompts = [p[:max_tokens] for p in harness.seed_index(app, random.Random(25), sessions=sessions)]
        url = f"http://127.0.0.1:{http_port}"
        agree = await harness.indexer_agreement(app.service.endpoint, url, grpc_port, "tiny", prompts,
                                                app.hashing.block_size, lambda t: " ".join(map(str, t)))
        print(f"  {agree['n']} prompts: Dynamo /query agrees {agree['http']}, RFC /query {agree['rfc']}, "
              f"GetPodScores {agree['grpc']}; most holders listed for one prompt: {agree['holders_max']}")
        gaps: list[float] = []

        async def ticker() -> None:  # the loop's longest pause while hostile input is answered
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        biggest = [k % 50_000 + 1 for k in range(max_tokens)]
        t = time.perf_counter()
        await app.peer_apis.query.by_tokens(biggest, "tiny")
        big_s, big_pause = time.perf_counter() - t, max(gaps, default=0)
        print(f"  the largest query allowed ({max_tokens} tokens) took {1000 * big_s:.1f} ms; longest loop pause "
              f"meanwhile {1000 * big_pause:.1f} ms (checked and hashed on a thread)")
        gaps.clear()
        # the hostile clients run on their own thread and loop, so the pause measured is the server's
        # (their Python still shares the GIL with it)
        http_res = await asyncio.to_thread(asyncio.run, harness.hostile_http(url, max_tokens))
        grpc_res = await asyncio.to_thread(asyncio.run, harness.hostile_grpc(grpc_port, max_tokens))
        tick.cancel()
        crashes = sum(1 for _n, e, g in http_res if g != e or g >= 500 or g < 0)
        crashes += sum(1 for _n, e, g in grpc_res if g != e or g in ("UNKNOWN", "INTERNAL"))
        from smetric_lmc.client import AsyncRouteClient

        client = AsyncRouteClient(app.service.endpoint, timeout_s=5.0)
        try:
            alive = (await client.route("after-hostile", model="tiny", token_ids=[1] * 64)).instance_id is not None
        except Exception:
            alive = False
        finally:
            await client.close()
        crashes += 0 if alive else 1
        for n, e, g in [*http_res, *grpc_res]:
            if str(e) != str(g):
                print(f"  UNEXPECTED {n}: expected {e}, got {g}")
        print(f"  hostile: {len(http_res)} HTTP bodies, {len(grpc_res)} gRPC requests; longest loop pause "
              f"{1000 * max(gaps, default=0):.1f} ms (clients on another thread, sharing the GIL); "
              f"route socket alive after: {alive}")
        n = agree["n"] or 1
        return {"http": agree["http"] / n, "grpc": agree["grpc"] / n, "hostile": len(http_res) + len(grpc_res),
                "crashes": crashes}
    finally:
        await app.close()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    steal = steal_reader()
    s0, t0 = steal(), time.monotonic()
    total = 3
    with tempfile.TemporaryDirectory(prefix="smetric-dropin-") as tmp:
        workdir = Path(tmp)
        step(1, total, "chart argument list -> smetric router on 2 mock engines; LMCache worker messages")
        started = start_mock_engines(2, workdir / "static", extra_args=["--speed", "50"])
        try:
            accepted, routed = await chart_and_lmcache([m for m, _ in started])
        finally:
            for g in {id(g): g for _, g in started}.values():
                g.stop()
        step(2, total, f"Kubernetes discovery: {args.pods} pods via list + watch (local API stand-in)")
        discovered, out_s = await k8s(args.pods, workdir)
    step(3, total, "index APIs: agreement with route, hostile input")
    apis = await index_apis(args.sessions)
    wall = time.monotonic() - t0
    print(f"wall {wall:.1f} s; machine CPU steal {100 * (steal() - s0) / wall:.0f}% of one CPU; "
          f"date {time.strftime('%Y-%m-%d', time.gmtime())}")
    return {"chart_args_accepted": accepted, "lmcache_worker_msgs_routed": routed,
            "k8s_pods_discovered": discovered, "k8s_pod_removed_out_s": round(out_s, 4),
            "indexer_http_agree": round(apis["http"], 4), "getpodscores_agree": round(apis["grpc"], 4),
            "hostile_inputs": apis["hostile"], "crashes": apis["crashes"]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 pods, 8 sessions")
    ap.add_argument("--pods", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=24)
    a = ap.parse_args()
    if a.quick:
        a.pods, a.sessions = 2, 8
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(json.dumps(asyncio.run(main(a))))
