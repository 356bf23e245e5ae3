"""16 mock engines behind the real controller and gateway (``smetric up --mock``), driven by
``smetric replay``: sessions stick, overloaded and evicted sessions fall back, the controller's
predicted hit is what each engine serves from cache, and its index mirrors every engine's cache."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from smetric_lmc.client import RouteClient
from smetric_lmc.lab.mock_engine.stack import bring_up_mock
from smetric_lmc.lab.replay.runner import Record, ReplayConfig, replay
from smetric_lmc.lab.workload import synthetic
from smetric_lmc.workers import up

#: 16 mock-engine processes behind the real controller and gateway: a multi-process stack.
pytestmark = pytest.mark.integration

N = 16
OVERLOAD = 1.3  # sheds at 1.3 x mean load: with ~2 sessions an instance, hot spots occur


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[up.LocalStack]:
    work = tmp_path_factory.mktemp("mock-cluster")
    args = argparse.Namespace(mock=N, mock_processes=1, host="127.0.0.1", port=0,
                              policy="smetric", mock_args="--speed 20 --num-gpu-blocks 128")
    s = bring_up_mock(args, work, policy_overrides={"overload": OVERLOAD})
    try:
        yield s
    finally:
        s.stop()


def _route_url(s: up.LocalStack) -> str:
    return yaml.safe_load(Path(s.config_path).read_text())["server"]["route_url"]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def records(stack: up.LocalStack) -> list[Record]:
    # The controller routes load-only until its index holds something: one request warms it.
    body = json.dumps({"model": "tiny", "prompt": list(range(10, 80)), "max_tokens": 1}).encode()
    warm = urllib.request.Request(f"{stack.gateway_url}/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(warm, timeout=30) as r:
        assert r.status == 200
    with RouteClient(_route_url(stack)) as c:
        deadline = time.monotonic() + 30
        while not c.health().index_ready:
            assert time.monotonic() < deadline, "controller index never ready"
            time.sleep(0.2)
    wl = synthetic(32, seed=5)
    cfg = ReplayConfig(url=stack.gateway_url, rate=8.0, time_scale=0.003, context_scale=0.04, seed=2)
    return replay(wl, cfg)


def test_every_request_served_and_routed_by_smetric(records: list[Record]) -> None:
    served = [r for r in records if not r.rejected]
    assert len(served) > 500
    assert all(r.ok for r in served), Counter(r.error[:80] for r in served if not r.ok)
    assert len({r.instance for r in served}) == N
    reasons = Counter(r.reason for r in served)
    assert set(reasons) <= {"first_turn", "sticky", "overloaded_fallback", "evicted_fallback"}, reasons
    assert reasons["first_turn"] == sum(1 for r in served if r.turn == 0)


def test_predicted_hits_are_what_engines_serve_from_cache(records: list[Record]) -> None:
    served = [r for r in records if r.ok]
    wrong = [r for r in served if r.local_hit != r.cached_tokens]
    # KV events travel asynchronously: a block evicted in the same instant may still count.
    assert len(wrong) <= 0.01 * len(served), [(r.reason, r.local_hit, r.cached_tokens) for r in wrong[:10]]


def test_followups_stick_to_the_instance_holding_their_kv(records: list[Record]) -> None:
    by_session: dict[int, list[Record]] = {}
    for r in sorted((r for r in records if r.ok), key=lambda r: r.request):
        by_session.setdefault(r.session, []).append(r)
    sticky = stayed = 0
    for reqs in by_session.values():
        for prev, cur in zip(reqs, reqs[1:]):
            if cur.reason == "sticky" and cur.request == prev.request + 1:
                sticky += 1
                stayed += cur.instance == prev.instance
    assert sticky > 300
    assert stayed >= 0.95 * sticky
    hits = [r for r in records if r.reason == "sticky"]
    assert sum(r.cached_tokens or 0 for r in hits) >= 0.8 * sum(r.input for r in hits)


def test_fallbacks_leave_overloaded_and_evicted_instances(records: list[Record]) -> None:
    reasons = Counter(r.reason for r in records if r.ok)
    assert reasons["overloaded_fallback"] > 0, reasons
    assert reasons["evicted_fallback"] > 0, reasons
    for r in records:
        if r.reason == "evicted_fallback":
            # Less than HIT_RATIO (0.5) of what the session had cached was left anywhere.
            assert r.est_hit > 0 and r.local_hit is not None and r.local_hit <= 0.5 * r.est_hit
            assert r.cached_tokens == r.local_hit


def test_controller_index_matches_every_engine_cache(stack: up.LocalStack, records: list[Record]) -> None:
    assert records
    engines = {e.instance_id: e.http_url for e in stack.engines}  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while True:
        with RouteClient(_route_url(stack)) as c:
            indexed = {i.id: i.indexed_blocks for i in c.instances()}
        held = {iid: len(_get(f"{url}/mock/cache")["block_hashes"]) for iid, url in engines.items()}
        if indexed == held or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert indexed == held
    assert sum(held.values()) > N * 64  # the caches are well used, so the comparison means something
    evicted = sum(_get(f"{url}/mock/cache")["evicted_blocks"] for url in engines.values())
    assert evicted > 0
