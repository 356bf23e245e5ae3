"""The controller app end to end on real sockets: recorded vLLM KV events in, route decisions out.

Peers standing in for programs that are not run here: a zmq XPUB replays the frames vLLM 0.32
published (fixture ``vllm_kv_events.json``), a zmq ROUTER answers replay requests from the same
recording, and small aiohttp servers stand in for vLLM's ``/metrics`` HTTP endpoint.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import helpers
import pytest
import yaml
import zmq
import zmq.asyncio
from app_helpers import FakeEngine, RecordedEngine, base_config
from services import fixture_path, free_port

from smetric_lmc.client import AsyncRouteClient, RouteClient
from smetric_lmc.config import parse_config
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.hashing import fast_chain

# These waits follow in-process sockets, which answer within a few milliseconds.
wait_for = functools.partial(helpers.wait_for, poll_s=0.01)


@pytest.fixture
async def running() -> AsyncIterator[Callable[..., Any]]:
    """Start ControllerApps from config dicts; all are closed at the end."""
    apps: list[ControllerApp] = []

    async def start(cfg: dict[str, Any], **kw: Any) -> ControllerApp:
        app = ControllerApp(parse_config(cfg), **kw)
        await app.start()
        apps.append(app)
        return app

    yield start
    for app in apps:
        await app.close()


# ---- end to end: recorded vLLM events -> route ------------------------------------------------------


def _chat(fixture: dict[str, Any], session: str, turn: int) -> dict[str, Any]:
    return next(r for r in fixture["requests"] if r.get("session") == session and r.get("turn") == turn)


def _est_hit(previous: dict[str, Any]) -> int:
    # The carried history = the previous turn's prompt plus its answer (DESIGN §1 est_hit).
    return previous["usage"]["prompt_tokens"] + previous["usage"]["completion_tokens"]


async def test_recorded_vllm_events_drive_the_route_decision(running: Callable[..., Any]) -> None:
    fixture = json.loads(fixture_path("vllm_kv_events.json").read_text())
    ctx = zmq.asyncio.Context()
    engine = RecordedEngine(fixture["frames"], ctx)
    try:
        app: ControllerApp = await running(
            base_config(
                instances=[
                    {
                        "id": "a",
                        "http": "http://127.0.0.1:9",
                        "kv_events": f"tcp://127.0.0.1:{engine.pub_port}",
                        "replay": f"tcp://127.0.0.1:{engine.replay_port}",
                    },
                    {"id": "b", "http": "http://127.0.0.1:10"},
                ]
            )
        )
        await engine.wait_subscribed()
        sub = app.subscribers["a"]
        async with AsyncRouteClient(app.service.endpoint or "", timeout_s=3.0) as client:
            # Before any event the controller balances (its index is empty after a start).
            early = await client.route("early", token_ids=[1] * 64, turn=0)
            assert early.policy == "load_balance"
            assert (await client.health()).index_ready is False
            await client.done("early")

            # Session A's first three turns; batch 2 is "lost" and must come back through replay.
            for seq in (0, 1, 3):
                await engine.publish(seq)
            await wait_for(lambda: sub.stats.last_seq == 3, what="seq 3 applied")
            assert engine.replay_requests == [2] and sub.stats.gaps == 1

            a4 = _chat(fixture, "A", 4)
            d = await client.route("A4", token_ids=a4["prompt_token_ids"], turn=3, est_hit_tokens=_est_hit(_chat(fixture, "A", 3)))
            # SMetric sticks to the instance holding the session, and the hit it sees is exactly
            # what vLLM reported as cached for that request.
            assert (d.instance_id, d.endpoint, d.reason.value, d.policy) == ("a", "http://127.0.0.1:9", "sticky", "smetric")
            assert d.local_hit_tokens == a4["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
            await client.done("A4")

            # The rest: session B, eviction fillers, reset_prefix_cache, session C.
            for seq in range(4, len(engine.frames)):
                await engine.publish(seq)
            await wait_for(lambda: sub.stats.last_seq == len(engine.frames) - 1, what="all batches applied")
            b2 = _chat(fixture, "B", 2)
            d2 = await client.route("B2", token_ids=b2["prompt_token_ids"], turn=1, est_hit_tokens=_est_hit(_chat(fixture, "B", 1)))
            assert (d2.instance_id, d2.reason.value) == ("a", "sticky")
            assert d2.local_hit_tokens == b2["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
            # Session A was evicted: its follow-up is balanced, not pinned.
            d3 = await client.route("A4-again", token_ids=a4["prompt_token_ids"], turn=3, est_hit_tokens=256)
            assert d3.reason.value == "evicted_fallback" and d3.local_hit_tokens == 0

            stats = await client.stats()
            ev = stats["kv_events"]["a"]
            assert ev["events"]["AllBlocksCleared"] == 1 and ev["events"]["blocks_stored"] == 147
            assert stats["index_ready"] is True

        assert app.metrics_server is not None
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{app.metrics_server.port}"
            async with http.get(f"{base}/metrics") as r:
                text = await r.text()
            async with http.get(f"{base}/healthz") as r:
                health = await r.json()
                status = r.status
        assert 'smetric_route_decisions_total{policy="smetric",reason="sticky"} 2.0' in text
        assert 'smetric_kv_event_blocks_total{backend="a",op="stored"} 147.0' in text
        assert 'smetric_kv_events_total{backend="a",kind="AllBlocksCleared"} 1.0' in text
        assert 'kind="blocks_stored"' not in text  # blocks have their own family
        assert 'smetric_kv_event_gaps_total{backend="a"} 1.0' in text
        assert 'smetric_route_fallbacks_total{kind="index_not_ready"} 1.0' in text
        assert 'smetric_route_hit_tokens_total{tier="local_chosen"} 352.0' in text
        assert "smetric_route_latency_seconds_bucket" in text
        assert status == 200 and health["ok"] and health["index_ready"] and health["routable_instances"] == 2
    finally:
        await engine.close()
        ctx.destroy(linger=0)


# ---- liveness and engine metrics ---------------------------------------------------------------------


async def test_silent_instance_leaves_routing_and_comes_back(running: Callable[..., Any]) -> None:
    port_a, port_b = free_port(), free_port()
    engine_a = await FakeEngine(port_a).start()
    engine_b = FakeEngine(port_b)  # not started yet: instance b is silent
    try:
        app: ControllerApp = await running(
            base_config(
                instances=[
                    {"id": "a", "http": f"http://127.0.0.1:{port_a}"},
                    {"id": "b", "http": f"http://127.0.0.1:{port_b}"},
                ],
                load={"metrics_poll_s": 0.05, "instance_timeout_s": 0.4},
            )
        )
        # b served a session before (its blocks are in b's index) but does not answer now: only a,
        # whose /metrics answered, enters routing.
        session = list(range(1000, 1000 + 32 * 8))
        app.index.gpu_stored("b", list(range(8)), None, session, 32)
        await wait_for(lambda: app.membership.routable_ids() == ["a"], 3.0, "a to enter routing, b not")
        # Out of routing, but its index is kept (marked stale), not wiped.
        assert app.index.gpu_blocks_of("b") == 8
        assert app.index.stale_instances() == ["b"]
        assert app.poller is not None and app.poller.healthy("b") is False and app.poller.healthy("a") is True
        async with AsyncRouteClient(app.service.endpoint or "", timeout_s=3.0) as client:
            chosen = set()
            for k in range(8):
                chosen.add((await client.route(f"r{k}", token_ids=[k] * 40, turn=0)).instance_id)
                await client.done(f"r{k}")
            follow_up = session + [7] * 40
            # (another continuation: f0's prompt counts as pending on a, and f1 must not extend it)
            d = await client.route("f0", token_ids=session + [8] * 40, turn=2, est_hit_tokens=len(session))
            assert d.instance_id == "a" and d.reason.value == "evicted_fallback"  # b is not a candidate
            await client.done("f0")
            assert chosen == {"a"}
            assert (await client.health()).routable_instances == 1
            infos = {i.id: i for i in await client.instances()}
            assert infos["b"].routable is False and infos["a"].routable is True
            await engine_b.start()
            await wait_for(lambda: sorted(app.membership.routable_ids()) == ["a", "b"], 3.0, "b to come back")
            # The session's KV is still on b: its next turn sticks there instead of rebalancing.
            d = await client.route("f1", token_ids=follow_up, turn=2, est_hit_tokens=len(session))
            assert (d.instance_id, d.reason.value, d.local_hit_tokens) == ("b", "sticky", len(session))
            await client.done("f1")
            chosen = set()
            for k in range(8):
                chosen.add((await client.route(f"s{k}", token_ids=[k] * 40, turn=0)).instance_id)
                await client.done(f"s{k}")
            assert chosen == {"a", "b"}
    finally:
        await engine_a.stop()
        await engine_b.stop()


async def test_engine_metrics_heal_a_lost_done(running: Callable[..., Any]) -> None:
    port = free_port()
    engine = await FakeEngine(port).start()
    engine.running = 1  # the engine is busy with our request
    try:
        app: ControllerApp = await running(
            base_config(
                instances=[{"id": "a", "http": f"http://127.0.0.1:{port}"}],
                load={"metrics_poll_s": 0.05, "lost_done_grace_s": 0.0, "instance_timeout_s": 30},
            )
        )
        await wait_for(lambda: app.membership.routable_ids() == ["a"], 3.0, "a alive")
        async with AsyncRouteClient(app.service.endpoint or "", timeout_s=3.0) as client:
            d = await client.route("lost", token_ids=[7] * 64, turn=0)
            assert d.instance_id == "a" and len(app.load) == 1
            hits = engine.hits
            await wait_for(lambda: engine.hits >= hits + 3, what="polls")
            # The engine agrees it runs one request: ours, kept (and no external load on top).
            assert app.load.in_flight("a") == 1 and len(app.load) == 1 and app.load.stats["healed"] == 0
            engine.running = 0  # finished, but its done report never arrives
            await wait_for(lambda: app.load.in_flight("a") == 0, 3.0, "lost done healed")
            assert app.load.stats["healed"] == 1
            ack = await client.done("lost")  # a late done is harmless
            assert ack.released is False
            stats = await client.stats()
            assert stats["engine_metrics"]["a"]["healed"] == 1 and stats["engine_metrics"]["a"]["ok"] is True
    finally:
        await engine.stop()


async def test_healthz_is_503_without_routable_instances(running: Callable[..., Any]) -> None:
    app: ControllerApp = await running(base_config(instances=[]))
    assert app.metrics_server is not None
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{app.metrics_server.port}/healthz") as r:
        assert r.status == 503
        body = await r.json()
    assert body["ok"] is False and body["routable_instances"] == 0


# ---- hot reload --------------------------------------------------------------------------------------


async def test_policy_hot_reloads_from_the_file(running: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "smetric.yaml"
    cfg = base_config(policy={"name": "smetric", "overload": 2.0, "hit_ratio": 0.5})
    path.write_text(yaml.safe_dump(cfg))
    app: ControllerApp = await running(cfg, config_path=path, reload_poll_s=0.05)

    def rewrite(data: str) -> None:
        path.write_text(data)
        st = path.stat()  # make sure the stamp moves even within one mtime tick
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))

    cfg["policy"] = {"name": "bailian", "overload": 3.5, "hit_ratio": 0.25, "bailian_lambda": 0.7}
    cfg["server"] = {**cfg["server"], "metrics_port": 1}  # not hot-reloadable: logged, ignored
    rewrite(yaml.safe_dump(cfg))
    await wait_for(lambda: app.router.policy_cfg.name == "bailian", 3.0, "policy reload")
    p = app.router.policy_cfg
    assert (p.overload, p.hit_ratio, p.bailian_lambda) == (3.5, 0.25, 0.7)
    assert app.cfg.server.metrics_port == 0
    async with AsyncRouteClient(app.service.endpoint or "", timeout_s=3.0) as client:
        assert (await client.stats())["policy"]["name"] == "bailian"
        app.index.gpu_stored_hashes("a", fast_chain([1] * 64, 32, root=app.index.fast_root))  # index ready
        d = await client.route("after-reload", token_ids=[1] * 64, turn=0)
        assert d.policy == "bailian"

    rewrite("policy: {hit_ratio: 7}\n")  # invalid: ignored, the running policy stays
    await wait_for(lambda: app.reloader.counts["rejected"] == 1, 3.0, "rejected reload")
    rewrite("policy: [unclosed\n")
    await wait_for(lambda: app.reloader.counts["rejected"] == 2, 3.0, "rejected reload")
    assert app.router.policy_cfg.name == "bailian" and app.reloader.counts["applied"] == 1


def test_cli_runs_reloads_on_sighup_and_stops_on_sigterm(tmp_path: Path) -> None:
    route_url = f"tcp://127.0.0.1:{free_port()}"
    cfg = base_config(server={"route_url": route_url, "metrics_port": 0})
    path = tmp_path / "smetric.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # A long poll so the reload can only come from the signal.
    proc = subprocess.Popen(
        [sys.executable, "-m", "smetric_lmc.cli", "controller", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        with RouteClient(route_url, timeout_s=0.5) as client:
            deadline = time.monotonic() + 20
            while True:
                try:
                    assert client.health().routable_instances == 2
                    break
                except Exception:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
            cfg["policy"] = {"name": "lmetric", "lmetric_load_offset": 2.0}
            path.write_text(yaml.safe_dump(cfg))
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 5
            while client.stats()["policy"]["name"] != "lmetric":
                assert time.monotonic() < deadline, "SIGHUP did not reload the policy"
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out.decode()
    text = out.decode()
    assert "policy changed" in text and "name='smetric'->'lmetric'" in text and "controller stopped" in text


def test_cli_bad_config_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("policy: {overload: fast}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "smetric_lmc.cli", "controller", "--config", str(path)],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 2 and "policy.overload" in proc.stderr


def test_example_config_loads() -> None:
    cfg = parse_config(yaml.safe_load((Path(__file__).resolve().parent.parent / "configs" / "smetric.yaml").read_text()))
    assert [i.id for i in cfg.instances] == ["vllm-0", "vllm-1"] and cfg.policy.name == "smetric"
    assert cfg.policy.overload == 2.0 and cfg.policy.hit_ratio == 0.5


async def test_lmcache_workers_and_global_store_are_wired(running: Callable[..., Any]) -> None:
    from smetric_lmc.controller import lmcache_proto as P
    from smetric_lmc.hashing import lmcache_chunk_chain

    pull, reply = free_port(), free_port()
    app: ControllerApp = await running(
        base_config(
            hashing={"block_size": 16},
            instances=[
                {"id": "a", "http": "http://127.0.0.1:9", "lmcache_instance_id": "lmc-a"},
                {"id": "b", "http": "http://127.0.0.1:10"},
            ],
            lmcache={"enabled": True, "pull_url": f"tcp://127.0.0.1:{pull}", "reply_url": f"tcp://127.0.0.1:{reply}"},
            # Nothing listens there: the controller must run local-only and say so.
            global_store={"kind": "redis", "url": f"redis://127.0.0.1:{free_port()}/0"},
        )
    )
    assert app.lmcache_server is not None and app.global_tier is not None
    tokens = list(range(5000, 5600))
    chunks = lmcache_chunk_chain(tokens, 256, root=0)
    ctx = zmq.asyncio.Context()
    dealer, push = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    try:
        dealer.connect(f"tcp://127.0.0.1:{reply}")
        push.connect(f"tcp://127.0.0.1:{pull}")
        await dealer.send_multipart([b"", P.encode(P.RegisterMsg("lmc-a", 0, "127.0.0.1", 0, None))])
        assert await asyncio.wait_for(dealer.poll(5000), 6)
        await dealer.recv_multipart()
        ops = [P.KVOpEvent("admit", h, i) for i, h in enumerate(chunks)]
        await push.send(P.encode(P.BatchedKVOperationMsg("lmc-a", 0, "LocalCPUBackend", ops)))
        await wait_for(lambda: app.index.stats["lmcache_admitted"] == 2, what="LMCache admits applied")
        async with AsyncRouteClient(app.service.endpoint or "", timeout_s=3.0) as client:
            d = await client.route("lm1", token_ids=tokens, turn=1, est_hit_tokens=512)
            assert (d.instance_id, d.local_hit_tokens, d.reason.value) == ("a", 512, "sticky")
            h = await client.health()
            assert h.global_store == "redis:down" and h.ok
            stats = await client.stats()
            assert "lmcache" in stats and stats["global_tier"]["available"] is False
    finally:
        dealer.close(linger=0)
        push.close(linger=0)
        ctx.destroy(linger=0)
