"""No silent waits in the gateway's request path: every wait on a peer ends, and says so.

Real gateway, real in-process controller (real ZMQ), and the HTTP engines of tests/gateway_helpers.py
on 127.0.0.1 (they stand in for vLLM: these tests are about the gateway's own HTTP client).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import pytest
from gateway_helpers import MSGS, SSE_EVENTS, Stack, StackFactory
from scrape import scrape

# More streams at once than aiohttp's default connection pool holds (100 in use per session).
HELD_STREAMS = 120


async def _wait_received(s: Stack, n: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        got = sum(len(e.received) for e in s.engines)
        if got >= n or time.monotonic() >= deadline:
            return got
        await asyncio.sleep(0.02)


async def test_more_concurrent_streams_than_a_default_pool_all_reach_an_engine(make_stack: StackFactory) -> None:
    """Every stream here stays open until the test releases them all. With aiohttp's default pool
    (the gateway's before), the first 100 held every connection and the others waited, without a
    log line or a metric, for one of them to end: they never reached an engine."""
    s: Stack = await make_stack()
    for e in s.engines:
        e.hold_stream = True
    # The test's own client must not cap its connections either.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        responses: list[aiohttp.ClientResponse] = []

        async def open_stream(k: int) -> None:
            msgs = [*MSGS[:1], {"role": "user", "content": f"Stream {k}."}]
            resp = await http.post(f"{s.base}/v1/chat/completions",
                                   json={"model": "tiny", "messages": msgs, "stream": True})
            responses.append(resp)
            assert resp.status == 200
            assert await resp.content.readexactly(len(SSE_EVENTS[0])) == SSE_EVENTS[0]

        openers = [asyncio.create_task(open_stream(k)) for k in range(HELD_STREAMS)]
        try:
            got = await _wait_received(s, HELD_STREAMS, timeout_s=20.0)
            stages = await scrape(s.http, f"{s.base}/metrics")
            assert got == HELD_STREAMS, (
                f"only {got} of {HELD_STREAMS} concurrent streams reached an engine; the gateway's stages: "
                f"{ {st: stages.value('smetric_gateway_requests_in_stage', stage=st) for st in _STAGES} }")
            await asyncio.wait_for(asyncio.gather(*openers), 10.0)
            # Where the requests are now: all of them streaming back, none stuck before.
            assert stages.value("smetric_gateway_requests_in_stage", stage="respond") == HELD_STREAMS
            assert stages.value("smetric_gateway_requests_in_stage", stage="upstream") == 0
            # Nor did any wait for a connection until it gave up and retried elsewhere: no engine failed.
            assert stages.value("smetric_gateway_upstream_failures_total") == 0
            assert stages.value("smetric_gateway_retries_total") == 0
        finally:
            for e in s.engines:
                e.release_stream.set()
            for t in openers:
                t.cancel()
        bodies = await asyncio.wait_for(asyncio.gather(*(r.read() for r in responses)), 10.0)
        assert all(SSE_EVENTS[0] + b == b"".join(SSE_EVENTS) for b in bodies)
        for r in responses:
            r.release()
    await s.wait_dones(HELD_STREAMS)
    after = await scrape(s.http, f"{s.base}/metrics")
    assert all(after.value("smetric_gateway_requests_in_stage", stage=st) == 0 for st in _STAGES)
    assert after.value("smetric_gateway_requests_total", status="200") == HELD_STREAMS


_STAGES = ("read", "route", "upstream", "respond")


async def test_a_tokenize_call_that_does_not_answer_is_cut_counted_and_logged(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Both engines' /tokenize answer after 2 s; each call is cut at 0.2 s, the request is routed on
    the estimate at once, and the metrics and the log say what happened."""
    s: Stack = await make_stack(gateway_kw={"tokenize_timeout_s": 0.2})
    for e in s.engines:
        e.tokenize_delay_s = 2.0
    caplog.set_level(logging.WARNING, logger="smetric_lmc.gateway_prompt")
    t0 = time.monotonic()
    resp = await s.chat(MSGS)
    elapsed = time.monotonic() - t0
    assert resp.status == 200, await resp.text()
    assert elapsed < 1.5, f"the request waited {elapsed:.2f} s for /tokenize"
    assert int(resp.headers["X-SMetric-Prompt-Tokens"]) > 0  # the estimate routed it
    m = await scrape(s.http, f"{s.base}/metrics")
    assert m.value("smetric_gateway_tokenize_failures_total", outcome="timeout") == 2  # one call per engine
    assert m.value("smetric_gateway_untokenized_prompts_total") == 1
    assert sum("tokenize failed" in r.getMessage() and "no answer within 0.2 s" in r.getMessage()
               for r in caplog.records) == 2


async def test_stages_drain_when_requests_fail(make_stack: Any) -> None:
    """A request that ends in an error leaves no stage counted (the gauge is what shows a stuck one)."""
    s: Stack = await make_stack()
    for e in s.engines:
        e.fail_status = 503
    resp = await s.chat(MSGS)
    assert resp.status == 502
    bad = await s.http.post(f"{s.base}/v1/chat/completions", data=b"not json")
    assert bad.status == 400
    m = await scrape(s.http, f"{s.base}/metrics")
    assert all(m.value("smetric_gateway_requests_in_stage", stage=st) == 0 for st in _STAGES)
    assert m.value("smetric_gateway_upstream_failures_total", stage="before_response") == 2
