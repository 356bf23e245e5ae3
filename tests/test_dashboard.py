"""The Grafana dashboard (dashboards/smetric.json) only asks for what a running stack exports.

Every PromQL expression of the dashboard is read for its metric names and label names; then a real
controller (``ControllerApp``: real ZMQ, real HTTP ``/metrics``) fed with vLLM's recorded KV event
frames, and a real gateway in front of two HTTP peers standing in for engines (those of
tests/gateway_helpers.py), serve some requests and are scraped. Each metric the dashboard uses must
be among the samples they export, and each label it filters or groups by must be on them.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq.asyncio
from aiohttp import web
from app_helpers import RecordedEngine
from gateway_helpers import MSGS, FakeEngine
from scrape import Scrape, scrape
from services import fixture_path

from smetric_lmc.config import parse_config
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.gateway import Gateway
from smetric_lmc.workers.launch import free_ports

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "smetric.json"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}
_SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_IDENT = re.compile(r"(?<![\w:$.])([a-zA-Z_:][\w:]*)\b(?!\s*\()")


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "expr" and isinstance(v, str):
                yield v
            else:
                yield from _exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _exprs(v)


def uses(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """(metric -> labels its selectors match on, labels grouped by) of one PromQL expression."""
    metrics: dict[str, set[str]] = {}
    grouped = {lab.strip() for g in _GROUPING.findall(expr) for lab in g.split(",") if lab.strip()}
    rest = _GROUPING.sub(" ", expr)
    for name, matchers in _SELECTOR.findall(rest):
        metrics.setdefault(name, set()).update(_MATCHER.findall(matchers))
    rest = _SELECTOR.sub(lambda m: m.group(1), rest)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # range selectors, e.g. [$__rate_interval]
    rest = re.sub(r'"[^"]*"', " ", rest)
    for name in _IDENT.findall(rest):
        if name.lower() not in _KEYWORDS:
            metrics.setdefault(name, set())
    return metrics, grouped


def test_the_expression_reader_finds_names_and_labels() -> None:
    m, g = uses('histogram_quantile(0.9, sum by (le, backend) (rate(a_bucket{backend=~"$backend"}[5m]))) '
                '/ on (backend) b_total + c')
    assert m == {"a_bucket": {"backend"}, "b_total": set(), "c": set()} and g == {"le", "backend"}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_is_grafana_json_with_the_asked_for_panels() -> None:
    d = _dashboard()
    titles = {p["title"] for p in d["panels"]}
    for t in ("Route mix", "Stickiness", "Funnel (controller)", "Predicted vs cached (gateway)",
              "In flight per instance", "TTFT p50 / p90 / p99", "KV event lag", "Index size"):
        assert t in titles
    assert any(p["type"] == "heatmap" for p in d["panels"])
    assert d["uid"] and d["schemaVersion"] >= 30
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:  # no two panels overlap on the grid
        if p["type"] == "row":
            continue
        a = p["gridPos"]
        for q in d["panels"]:
            b = q["gridPos"]
            if q is p or q["type"] == "row":
                continue
            overlap = a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and \
                a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]
            assert not overlap, (p["title"], q["title"])


@pytest.fixture
async def exported() -> Any:
    """Scrapes of a controller and a gateway that have routed real requests and ingested KV events."""
    fixture = json.loads(fixture_path("vllm_kv_events.json").read_text())
    ctx = zmq.asyncio.Context()
    recorded = RecordedEngine(fixture["frames"], ctx)
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    for e in engines:
        await e.start()
    route_port, gw_port = free_ports(2)
    cfg = parse_config({
        "model": "tiny",
        "hashing": {"block_size": 16},
        "instances": [
            {"id": "e0", "http": engines[0].url, "kv_events": f"tcp://127.0.0.1:{recorded.pub_port}",
             "replay": f"tcp://127.0.0.1:{recorded.replay_port}"},
            {"id": "e1", "http": engines[1].url},
        ],
        "server": {"route_url": f"tcp://127.0.0.1:{route_port}", "metrics_port": 0},
        "load": {"metrics_poll_s": 0},
    })
    app = ControllerApp(cfg)
    await app.start()
    gw = Gateway(cfg, route_timeout_s=1.0)
    runner = web.AppRunner(gw.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", gw_port).start()
    try:
        await recorded.wait_subscribed()
        for seq in range(len(recorded.frames)):
            await recorded.publish(seq)
        sub = app.subscribers["e0"]
        for _ in range(500):
            if sub.stats.last_seq == len(recorded.frames) - 1:
                break
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{gw_port}"
            for stream in (False, True, False, True):
                async with http.post(f"{base}/v1/chat/completions",
                                     json={"model": "tiny", "messages": MSGS, "stream": stream}) as resp:
                    assert resp.status == 200
                    await resp.read()
            assert app.metrics_server is not None
            # an engine's LMCache retrieves, as the engine-metrics poller hands them over (it is off here)
            app._observe_retrieve("e0", 2.0, 0.2, 4000.0)
            controller = await scrape(http, f"http://127.0.0.1:{app.metrics_server.port}/metrics")
            for _ in range(100):  # done reports travel after the response
                gateway = await scrape(http, f"{base}/metrics")
                if gateway.value("smetric_gateway_done_reports_total", result="delivered") == 4:
                    break
                await asyncio.sleep(0.02)
        yield controller, gateway
    finally:
        await runner.cleanup()
        await app.close()
        for e in engines:
            await e.stop()
        await recorded.close()
        ctx.destroy(linger=0)


def test_every_metric_and_label_the_dashboard_uses_is_exported(exported: tuple[Scrape, Scrape]) -> None:
    controller, gateway = exported
    labels_of: dict[str, set[str]] = {}
    for name, labels, _v in controller.samples + gateway.samples:
        labels_of.setdefault(name, set()).update(labels)
    d = _dashboard()
    seen: set[str] = set()
    for expr in _exprs(d["panels"]):
        metrics, grouped = uses(expr)
        assert metrics, f"no metric in {expr!r}"
        for name, matched in metrics.items():
            assert name in labels_of, f"{name} (in {expr!r}) is not exported by the controller or gateway"
            missing = matched - labels_of[name]
            assert not missing, f"{name} has no label(s) {missing} (in {expr!r})"
            seen.add(name)
        have = set().union(*(labels_of[n] for n in metrics))
        assert grouped <= have, f"grouping by {grouped - have} in {expr!r}: no such label"
    # The backend variable's query, too.
    var = next(v for v in d["templating"]["list"] if v["name"] == "backend")
    metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"]).groups()  # type: ignore[union-attr]
    assert label in labels_of[metric]
    # Both halves of the stack are on the dashboard.
    assert any(n.startswith("smetric_gateway_") for n in seen)
    assert any(not n.startswith("smetric_gateway_") for n in seen)
    assert len(seen) >= 25
