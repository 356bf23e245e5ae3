"""Instances joining and leaving a running controller: Membership.add / set_ready / remove, the
engine-metrics poller's and the gateway's prompt reader's targets."""

from __future__ import annotations

import aiohttp
from app_helpers import FakeEngine
from services import free_port

from smetric_lmc.config import InstanceConfig
from smetric_lmc.controller.engine_metrics import EngineMetricsPoller
from smetric_lmc.controller.membership import Membership
from smetric_lmc.gateway_prompt import PromptReader
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker


def _membership(*, liveness: bool = False) -> Membership:
    m = Membership([InstanceConfig(id="a", http="http://a")], TierIndex(16, 256), LoadTracker(),
                   liveness_enforced=liveness, timeout_s=5.0)
    m.start()
    return m


def test_not_ready_instance_is_indexed_but_held_until_ready() -> None:
    m = _membership()
    pod = InstanceConfig(id="pod", http="http://pod", lmcache_instance_id="pod-lmc")
    assert m.add(pod, ready=False)
    assert not m.add(pod)  # known already: nothing changes
    assert "pod" in m.index.instances and m.routable_ids() == ["a"]
    m.seen("pod")  # a sign of life (its LMCache worker) does not make a held pod routable
    assert m.routable_ids() == ["a"] and m.lmcache_owner("pod-lmc") == "pod"
    assert m.set_ready("pod") and not m.set_ready("pod")
    assert m.routable_ids() == ["a", "pod"]


def test_removed_instance_leaves_everything_and_a_late_poll_cannot_trip_it() -> None:
    m = _membership()
    m.add(InstanceConfig(id="pod", http="http://pod"))
    m.index.gpu_stored_hashes("pod", [11, 12])
    assert m.index.gpu_blocks_of("pod") == 2
    assert m.remove("pod") and not m.remove("pod")
    assert m.index.gpu_blocks_of("pod") == 0 and "pod" not in m.index.instances and "pod" not in m.known and m.routable_ids() == ["a"]
    assert m.lmcache_owner("pod") is None and [r.id for r in m.rows()] == ["a"]
    m.poll_result("pod", False)  # a poll that was in flight when it left
    assert m.breaker("pod") is None


def test_with_liveness_a_ready_instance_waits_for_its_first_sign_of_life() -> None:
    m = _membership(liveness=True)
    m.add(InstanceConfig(id="pod", http="http://pod"))
    assert "pod" not in m.routable_ids()
    m.seen("pod")
    assert "pod" in m.routable_ids()


async def test_poller_and_prompt_reader_follow_joining_and_leaving_engines() -> None:
    engine = await FakeEngine(free_port()).start()
    url = f"http://127.0.0.1:{engine.port}"
    results: list[tuple[str, bool]] = []
    poller = EngineMetricsPoller({}, LoadTracker(), on_result=lambda iid, ok: results.append((iid, ok)))
    try:
        poller.add_target("pod", url + "/")
        await poller.poll_once()
        assert results == [("pod", True)] and poller.healthy("pod")
        poller.remove_target("pod")
        await poller.poll_once()
        assert results == [("pod", True)] and engine.hits == 1  # not polled once it left
        async with aiohttp.ClientSession() as http:
            reader = PromptReader([], http)
            reader.add_url(url + "/")
            reader.add_url(url)  # the same engine: once
            assert reader.urls == [url]
            reader.remove_url(url)
            reader._observe(url, 0.5)  # a tokenize call that ended after its engine left
            assert reader.urls == []  # not added back
    finally:
        await poller.close()
        await engine.stop()
