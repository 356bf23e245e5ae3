"""The read-only index APIs other stacks call, as their clients call them, on a real controller.

Dynamo's standalone indexer / the Mooncake KV Indexer RFC over HTTP (JSON bodies as their docs give
them) and llm-d's ``IndexerService.GetPodScores`` through a grpcio client built from our .proto.
Their answers are checked against the controller's own ``route`` decisions on the same index, and
hostile input must get clear errors while the controller keeps answering.

GetPodScores carries text: the controller tokenizes it with an engine's ``/tokenize``
(``tests/test_dropin.py`` runs that path on mock engines); here a stand-in tokenizer reads the
prompt's token ids back from the text, so the prompts can be random ids.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import AsyncIterator

import aiohttp
import pytest

from smetric_lmc.config import parse_config
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.dropin import harness

MAX_QUERY_TOKENS = 4096
HAVE_GRPC = importlib.util.find_spec("grpc") is not None and importlib.util.find_spec("grpc_tools") is not None


def _grpc_or_skip() -> None:
    if not HAVE_GRPC:
        if os.environ.get("CI"):
            pytest.fail("grpcio / grpcio-tools missing (pip install -e '.[indexer]')")
        pytest.skip("LOUD SKIP: grpcio / grpcio-tools missing (pip install -e '.[indexer]'): GetPodScores untested")


async def text_tokens(_model: str, prompt: str) -> list[int]:
    return [int(t) for t in prompt.split()]


@pytest.fixture
async def controller() -> AsyncIterator[tuple[ControllerApp, int, int]]:
    cfg = parse_config({
        "model": "tiny",
        "hashing": {"block_size": 16},
        "instances": [{"id": f"i{k}", "http": "http://127.0.0.1:9"} for k in range(4)],
        "server": {"route_url": "tcp://127.0.0.1:*", "metrics_port": 0},
        "load": {"metrics_poll_s": 0, "instance_timeout_s": 0},  # no engines here: all routable
        "lmcache": {"enabled": True, "pull_url": "tcp://127.0.0.1:*", "reply_url": "tcp://127.0.0.1:*"},
        "peer_apis": {"http_port": -1, "grpc_port": -1 if HAVE_GRPC else 0,  # -1: any free port
                      "max_query_tokens": MAX_QUERY_TOKENS},
    })
    app = ControllerApp(cfg, enable_metrics_http=False)
    await app.start()
    grpc_port = 0
    if app.peer_apis.grpc is not None:
        app.peer_apis.grpc.tokenize = text_tokens
        grpc_port = app.peer_apis.grpc.port
    try:
        yield app, app.peer_apis.http_port, grpc_port
    finally:
        await app.close()


def test_off_by_default() -> None:
    cfg = parse_config({})
    assert cfg.peer_apis.http_port == 0 and cfg.peer_apis.grpc_port == 0


async def test_answers_agree_with_route(controller: tuple[ControllerApp, int, int]) -> None:
    app, http_port, grpc_port = controller
    prompts = harness.seed_index(app, random.Random(7), sessions=12)
    prompts = [p[:MAX_QUERY_TOKENS] for p in prompts]
    got = await harness.indexer_agreement(app.service.endpoint, f"http://127.0.0.1:{http_port}",
                                          grpc_port if HAVE_GRPC else None, "tiny", prompts,
                                          app.hashing.block_size, lambda t: " ".join(map(str, t)))
    n = len(prompts)
    assert got["n"] == n and got["http"] == n and got["rfc"] == n
    assert got["holders_max"] >= 2  # shared system prompt: every holder is listed, not the first
    if HAVE_GRPC:
        assert got["grpc"] == n
    else:
        _grpc_or_skip()


async def test_query_shapes_and_tiers(controller: tuple[ControllerApp, int, int]) -> None:
    from smetric_lmc.hashing import fast_chain, lmcache_chunk_chain

    app, http_port, _ = controller
    hs = app.hashing
    toks = list(range(1, 1025))
    app.index.gpu_stored_hashes("i1", fast_chain(toks[:512], hs.block_size, root=hs.fast_root))
    chunks = lmcache_chunk_chain(toks, hs.chunk_size, root=hs.lmcache_root, algo=hs.lmcache_algo)
    app.index.lmcache_admit("i2", chunks[:3])
    app.index.global_stored(chunks[:2])
    url = f"http://127.0.0.1:{http_port}"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/query", json={"token_ids": toks, "model_name": "tiny"}) as r:
            dyn = await r.json()
        async with http.post(f"{url}/query_by_hash", json={
                "block_hashes": fast_chain(toks, hs.block_size, root=hs.fast_root), "model_name": "tiny"}) as r:
            by_hash = await r.json()
        async with http.post(f"{url}/query", json={"model": "tiny", "lora_name": "", "token_ids": toks,
                                                   "tenant_id": "t1", "instance_id": "i2"}) as r:
            rfc = await r.json()
        async with http.get(f"{url}/workers") as r:
            workers = await r.json()
        async with http.get(f"{url}/health") as r:
            assert await r.text() == "OK"
    i1, i2, i0 = dyn["instances"]["i1"], dyn["instances"]["i2"], dyn["instances"]["i0"]
    assert (i1["gpu"], i1["cpu"], i1["global"], i1["longest_matched"]) == (512, 512, 512, 512)
    assert (i2["gpu"], i2["cpu"], i2["disk"], i2["longest_matched"]) == (0, 768, 768, 768)
    assert (i0["gpu"], i0["cpu"], i0["longest_matched"]) == (0, 0, 512)  # the global tier alone
    assert dyn["scores"]["i1"] == {"0": 512}
    assert by_hash["instances"]["i1"]["gpu"] == 512  # no chunks from hashes: GPU tier only
    assert rfc == {"t1": {"i2": {"longest_matched": 768, "GPU": 0, "DP": {"0": 0}, "CPU": 768, "DISK": 768,
                                 "GLOBAL": 512}}}
    assert [w["instance_id"] for w in workers] == ["i0", "i1", "i2", "i3"]


async def test_hostile_http_input(controller: tuple[ControllerApp, int, int]) -> None:
    app, http_port, _ = controller
    url = f"http://127.0.0.1:{http_port}"
    results = await harness.hostile_http(url, MAX_QUERY_TOKENS)
    assert [(n, e) for n, e, g in results if e != g] == []
    assert app.peer_apis.query.counters["refused"] > 0
    # still serving: a good query and a route
    async with aiohttp.ClientSession() as http, http.post(f"{url}/query", json={"token_ids": [1] * 64,
                                                                                "model_name": "tiny"}) as r:
        assert r.status == 200
    from smetric_lmc.client import AsyncRouteClient

    client = AsyncRouteClient(app.service.endpoint)
    try:
        assert (await client.route("after-hostile", model="tiny", token_ids=[1] * 64)).instance_id is not None
    finally:
        await client.close()


async def test_hostile_grpc_input(controller: tuple[ControllerApp, int, int]) -> None:
    _grpc_or_skip()
    app, _, grpc_port = controller
    results = await harness.hostile_grpc(grpc_port, MAX_QUERY_TOKENS)
    assert [(n, e, g) for n, e, g in results if e != g] == []
    from smetric_lmc.controller.indexer_grpc import load_proto

    pb2, _ = load_proto()
    # the contract's package, service and field numbers are llm-d-kv-cache's api/indexerpb/indexer.proto
    fields = {m: {f.name: f.number for f in getattr(pb2, m).DESCRIPTOR.fields}
              for m in ("GetPodScoresRequest", "GetPodScoresResponse", "PodScore")}
    assert fields == {"GetPodScoresRequest": {"prompt": 1, "model_name": 2, "pod_identifiers": 3},
                      "GetPodScoresResponse": {"scores": 1},
                      "PodScore": {"pod": 1, "score": 2, "data_parallel_rank": 3}}
    assert pb2.DESCRIPTOR.package == "indexer.v1"
    assert pb2.DESCRIPTOR.services_by_name["IndexerService"].methods_by_name["GetPodScores"]
    assert app.peer_apis.grpc.counters["invalid"] >= 3


async def test_tokenizer_failure_is_unavailable(controller: tuple[ControllerApp, int, int]) -> None:
    _grpc_or_skip()
    import grpc

    from smetric_lmc.controller.indexer_grpc import load_proto

    app, _, grpc_port = controller

    async def broken(_m: str, _p: str) -> list[int]:
        raise RuntimeError("no engine answered /tokenize")

    app.peer_apis.grpc.tokenize = broken
    pb2, pb2_grpc = load_proto()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb2_grpc.IndexerServiceStub(ch).GetPodScores(pb2.GetPodScoresRequest(prompt="hi", model_name="m"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no engine answered" in (err.value.details() or "")


