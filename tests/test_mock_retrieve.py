"""The mock cluster's shared global tier and its settable retrieve path: a prompt computed on one
instance is fetched by another (counted by that engine as a global hit), a put is visible only once
it landed, the fetch costs what the retrieve path says, and a change at run time (HTTP or the
watched file) applies to the next fetch. The engines are the simulator's model run in real time:
the GPUs and the RDMA store they stand for cannot run here."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from smetric_lmc.lab.mock_engine.cli import options, running_mocks
from smetric_lmc.lab.mock_engine.retrieve import RetrieveCosts
from smetric_lmc.lab.sim.fetch_path import load_fetch_path

PROMPT = list(range(1, 200)) * 40  # 7,960 tokens: ~0.8 GB of KV at 96 KiB/token


async def _ask(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}) as r:
        body = await r.json()
        assert r.status == 200, body
    return time.perf_counter() - t0, body


async def _stats(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(f"{url}/mock/stats") as r:
        return await r.json()


def test_costs_validate_and_update() -> None:
    c = RetrieveCosts()
    # The defaults are the simulator's sourced fetch-path profiles, not numbers of the mock's own.
    assert c.global_ == load_fetch_path("lmcache-mooncake-rdma")
    assert c.local_cpu == load_fetch_path("lmcache-local-cpu")
    slow = c.updated({"scale": 4, "global": {"gbps": 1.6, "chunk_ms": 0.1}})
    assert slow.global_.request_gbs == 1.6 and slow.local_cpu == c.local_cpu and slow.scale == 4
    eff = slow.effective(slow.global_)
    assert eff.request_bps == pytest.approx(0.4e9)
    assert eff.fixed_s(2) == pytest.approx(4 * (c.global_.lookup_s + 2 * 0.1e-3))
    assert math.isinf(c.updated({"global": {"gbps": 0}}).global_.request_gbs)
    assert c.updated({"global": {"profile": "lmcache-redis"}}).global_ == load_fetch_path("lmcache-redis")
    for bad in ({"scale": 0}, {"global": {"gbps": -1}}, {"bogus": 1}, {"global": {"gbps": "x"}}, [1],
                {"global": {"profile": "nope"}}, {"chunk_tokens": 256}):
        with pytest.raises(ValueError):
            c.updated(bad)


def test_a_prompt_computed_elsewhere_is_fetched_at_the_retrieve_paths_cost(tmp_path: Path) -> None:
    costs_file = tmp_path / "retrieve.json"

    async def main() -> None:
        args = options(instances=3, global_gib=64.0, retrieve_gbps=2.0, retrieve_lookup_ms=5.0,
                       retrieve_file=str(costs_file))
        async with running_mocks(args) as mocks, aiohttp.ClientSession() as s:
            (a, _), (b, _), (c, _) = mocks
            await _ask(s, a.http_url, PROMPT)  # computed on a, put to the global tier
            await asyncio.sleep(0.3)  # the put lands
            fast, body = await _ask(s, b.http_url, PROMPT)
            st = await _stats(s, b.http_url)
            assert st["counters"]["global_hit_tokens"] >= 7680, st
            assert st["counters"]["gpu_hit_tokens"] == 0
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 7680
            # The same fetch 4x slower: posted to one instance, it holds for the whole process.
            async with s.post(f"{a.http_url}/mock/retrieve", json={"scale": 4}) as r:
                assert (await r.json())["scale"] == 4
            async with s.post(f"{a.http_url}/mock/retrieve", json={"scale": -1}) as r:
                assert r.status == 400 and "scale" in (await r.json())["message"]
            slow, _ = await _ask(s, c.http_url, PROMPT)
            nbytes = 7680 * 98304  # 30 chunks of 256 tokens at 96 KiB/token
            expect_fast = 5e-3 + nbytes / 2e9  # the profile's per-chunk cost is 0
            # The slow fetch costs 3 x the fast one's fetch more (prefill of the tail and the HTTP
            # round trip are the same in both).
            assert slow - fast == pytest.approx(3 * expect_fast, rel=0.35), (fast, slow)
            # The watched file changes the costs too.
            costs_file.write_text(json.dumps({"scale": 1, "global": {"gbps": 0}}))
            for _ in range(40):
                async with s.get(f"{b.http_url}/mock/retrieve") as r:
                    now = await r.json()
                if now["scale"] == 1:
                    break
                await asyncio.sleep(0.05)
            assert now["scale"] == 1 and now["global"]["gbps"] == 0

    asyncio.run(main())


def test_the_engine_accounts_its_time_busy_mixed_and_stalled_on_a_fetch() -> None:
    """Where the modelled GPU's time goes (the simulator's busy / stall accounting, in wall
    seconds): a decode batch on b waits while a prompt's sync fetch from the global tier loads, so
    b's stall time is at least that fetch's cost; the steps carrying prompt chunks are counted
    apart, and so are the iterations that produced b's tokens. The decoding request sat through
    that wait; with a TPOT SLO it meets only without the wait, its tokens count as lost to it."""
    first = asyncio.run(_decode_beside_a_fetch(slo_ms=1e4))
    fetch_s = 20e-3 + 7680 * 98304 / 2e9
    assert 0.9 * fetch_s <= first["decode_waited_s"] <= first["stall_s"], first
    # the decoding request's time per token with and without its wait: an SLO between the two
    span = first["itl_sum_s"]
    slo_ms = 1e3 * (span - first["decode_waited_s"] / 2) / 119
    second = asyncio.run(_decode_beside_a_fetch(slo_ms=slo_ms))
    assert second["slow_tpot_tokens"] == second["slow_tpot_tokens_by_waits"] == 300 + 120, second
    assert first["slow_tpot_tokens"] == first["slow_tpot_tokens_by_waits"] == 0


async def _decode_beside_a_fetch(slo_ms: float) -> dict[str, Any]:
    """The scenario of the test above; b's counters after it, with checks of its time accounting."""
    out: dict[str, Any] = {}

    async def main() -> None:
        args = options(instances=2, global_gib=64.0, retrieve_gbps=2.0, retrieve_lookup_ms=20.0,
                       tpot_slo_ms=slo_ms)
        async with running_mocks(args) as mocks, aiohttp.ClientSession() as s:
            (a, _), (b, _) = mocks
            await _ask(s, a.http_url, PROMPT)  # computed on a, put to the global tier
            await asyncio.sleep(0.3)  # the put lands
            before = (await _stats(s, b.http_url))["counters"]
            decoding = asyncio.create_task(s.post(f"{b.http_url}/v1/completions",
                                                  json={"model": "tiny", "prompt": [5] * 300, "max_tokens": 120}))
            await asyncio.sleep(0.3)  # its decode runs
            await _ask(s, b.http_url, PROMPT)  # a sync fetch: the decoding batch waits for it
            async with await decoding as r:
                assert r.status == 200
                await r.read()
            c = (await _stats(s, b.http_url))["counters"]
            fetch_s = 20e-3 + 7680 * 98304 / 2e9
            assert c["stall_s"] - before["stall_s"] >= 0.9 * fetch_s, (c, fetch_s)
            # the waits are inside the steps that schedule the prompts; decode runs make the rest
            assert c["busy_s"] > c["mixed_s"] >= c["stall_s"] > 0, c
            # 121 tokens in 120 iterations: two steps carried a prompt (each gave its request's first
            # token, the second also one of the batch's decodes), then 118 pure decode iterations
            assert c["generation_tokens"] == 121 and c["iterations"] == 120, c
            out.update(c)

    await main()
    return out


def test_a_put_is_invisible_until_it_lands() -> None:
    async def main() -> None:
        args = options(instances=2, global_gib=64.0)
        async with running_mocks(args) as mocks, aiohttp.ClientSession() as s:
            (a, ca), (b, _) = mocks
            tier = ca.tiers.shared.tier
            task = asyncio.create_task(_ask(s, a.http_url, PROMPT))
            # While a computes the prompt nothing is in the global tier.
            await asyncio.sleep(0.05)
            assert tier.cache.used == 0
            await task
            await asyncio.sleep(0.3)
            assert tier.cache.used >= 240
            async with s.get(f"{b.http_url}/mock/retrieve") as r:
                assert r.status == 200

    asyncio.run(main())


def test_no_tier_no_retrieve_endpoint() -> None:
    async def main() -> None:
        async with running_mocks(options(instances=1)) as mocks, aiohttp.ClientSession() as s, \
                s.get(f"{mocks[0][0].http_url}/mock/retrieve") as r:
            assert r.status == 404

    asyncio.run(main())
