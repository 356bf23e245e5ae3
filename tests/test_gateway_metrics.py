"""The gateway's ``/metrics``: real requests through a real gateway and controller (real ZMQ), then a
scrape of what the gateway exported. The engines are the HTTP peers of tests/gateway_helpers.py (they
answer with OpenAI-shaped bodies whose ``cached_tokens`` the test knows: 32 for a JSON answer,
48 for a stream)."""

from __future__ import annotations

import asyncio

import pytest
from gateway_helpers import BLOCK, MSGS, Stack, StackFactory, render, tokens_of
from scrape import Scrape, scrape

from smetric_lmc.hashing import fast_chain

FOLLOW = [*MSGS, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "Again."}]


async def _metrics(s: Stack) -> Scrape:
    return await scrape(s.http, f"{s.base}/metrics")


async def _metrics_once_delivered(s: Stack, n: int, timeout_s: float = 10.0) -> Scrape:
    """A scrape taken once the gateway counted ``n`` delivered done reports: the controller holds a
    report a moment before the gateway reads its ack, so ``wait_dones`` alone races the counter."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        m = await _metrics(s)
        if m.value("smetric_gateway_done_reports_total", result="delivered") >= n:
            return m
        assert asyncio.get_running_loop().time() < deadline, "the gateway never counted its done reports"
        await asyncio.sleep(0.02)


async def test_histograms_and_funnel_move_with_requests(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    assert s.controller is not None
    before = await _metrics(s)
    assert before.value("smetric_gateway_requests_total") == 0
    assert before.value("smetric_gateway_controller_up") == 1

    # 1. Nothing indexed yet: the controller balances, and the response says why.
    resp = await s.chat(MSGS)
    assert resp.status == 200 and resp.headers["X-SMetric-Index-Ready"] == "false"
    first = resp.headers["X-SMetric-Instance"]
    await s.wait_dones(1)
    m = await _metrics(s)
    assert m.value("smetric_gateway_index_not_ready_routes_total") == 1
    assert m.value("smetric_gateway_requests_total", backend=first, status="200") == 1
    assert m.value("smetric_gateway_route_rtt_seconds_count", outcome="ok") == 1
    assert 0 < m.value("smetric_gateway_route_rtt_seconds_sum") < 0.3  # within the route timeout
    # the gateway's own routing time holds the round trip and the prompt's reading on top of it
    assert m.value("smetric_gateway_routing_seconds_count") == 1
    assert m.value("smetric_gateway_routing_seconds_sum") > m.value("smetric_gateway_route_rtt_seconds_sum")
    assert m.value("smetric_gateway_request_duration_seconds_count", backend=first) == 1
    # A JSON answer has no first token to time: no TTFT for it.
    assert m.value("smetric_gateway_ttft_seconds_count") == 0
    n0 = len(tokens_of(render(MSGS, True)))
    assert m.value("smetric_gateway_cache_funnel_tokens_total", backend=first, stage="prompt") == n0
    assert m.value("smetric_gateway_cache_funnel_tokens_total", backend=first, stage="predicted_local") == 0
    assert m.value("smetric_gateway_cache_funnel_tokens_total", backend=first, stage="engine_cached") == 32

    # 2. KV events (here: the index fed directly) say e1 holds the history: the follow-up sticks,
    # and the controller's predicted hit lands next to what the engine reported.
    hist = tokens_of(render(FOLLOW[:3], False))
    index = s.controller.index
    index.gpu_stored_hashes("e1", fast_chain(hist, BLOCK, root=index.fast_root))
    resp = await s.chat(FOLLOW)
    assert resp.headers["X-SMetric-Reason"] == "sticky" and resp.headers["X-SMetric-Index-Ready"] == "true"
    predicted = len(hist) // BLOCK * BLOCK
    assert int(resp.headers["X-SMetric-Local-Hit"]) == predicted
    await s.wait_dones(2)
    m2 = await _metrics_once_delivered(s, 2)
    funnel = "smetric_gateway_cache_funnel_tokens_total"
    assert m2.value(funnel, backend="e1", stage="predicted_local") == predicted
    assert m2.value(funnel, backend="e1", stage="est_hit") == predicted
    # The engine said 32 cached, the controller predicted more: the loss the funnel is there to show.
    assert m2.value(funnel, backend="e1", stage="engine_cached") - m.value(funnel, backend="e1",
                                                                            stage="engine_cached") == 32
    assert m2.value("smetric_gateway_requests_total", backend="e1", reason="sticky", status="200") == 1
    assert m2.value("smetric_gateway_index_not_ready_routes_total") == 1  # unchanged: ready now

    # 3. A stream: TTFT and TPOT (2 output tokens -> one inter-token interval) are timed.
    resp = await s.chat(FOLLOW, stream=True)
    await resp.read()
    inst = resp.headers["X-SMetric-Instance"]
    await s.wait_dones(3)
    m3 = await _metrics_once_delivered(s, 3)
    assert m3.value("smetric_gateway_ttft_seconds_count", backend=inst) == 1
    assert m3.value("smetric_gateway_tpot_seconds_count", backend=inst) == 1
    ttft = m3.value("smetric_gateway_ttft_seconds_sum", backend=inst)
    duration = m3.value("smetric_gateway_request_duration_seconds_sum", backend=inst) - m2.value(
        "smetric_gateway_request_duration_seconds_sum", backend=inst)
    assert 0 < ttft < duration  # the stream's writes are spread over ~10 ms after the first event
    assert m3.value("smetric_gateway_ttft_seconds_bucket", backend=inst, le="+Inf") == 1
    assert m3.value(funnel, backend=inst, stage="engine_cached") - m2.value(funnel, backend=inst,
                                                                             stage="engine_cached") == 48
    assert m3.value("smetric_gateway_output_tokens_total") == 3 + 3 + 2
    assert m3.value("smetric_gateway_done_reports_total", result="delivered") == 3
    assert m3.value("smetric_gateway_in_flight") == 0


async def test_retries_fallbacks_and_errors_are_counted(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    s.engines[0].fail_status = 503
    for _ in range(4):
        assert (await s.chat(MSGS)).status == 200
    failed = len(s.engines[0].received)
    assert failed >= 1
    s.engines[1].fail_status = 500  # both fail now: the client gets the gateway's 502
    assert (await s.chat(MSGS)).status == 502
    assert (await s.http.post(f"{s.base}/v1/chat/completions", data=b"{nope")).status == 400
    m = await _metrics(s)
    assert m.value("smetric_gateway_requests_total", backend="e1", status="200") == 4
    assert m.value("smetric_gateway_requests_total", backend="none", status="502") == 1
    assert m.value("smetric_gateway_requests_total", backend="none", status="400") == 1
    assert m.value("smetric_gateway_retries_total", backend="e0") == failed + 1
    assert m.value("smetric_gateway_upstream_failures_total", backend="e0", stage="before_response") == failed + 1
    assert m.value("smetric_gateway_upstream_failures_total", backend="e1", stage="before_response") == 1
    # Failed attempts are not timed as successes.
    assert m.value("smetric_gateway_request_duration_seconds_count") == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_controller_down_is_visible(make_stack: StackFactory, stream: bool) -> None:
    s: Stack = await make_stack(controller=False)
    for _ in range(2):
        resp = await s.chat(MSGS, stream=stream)
        await resp.read()
        assert resp.status == 200 and "X-SMetric-Index-Ready" not in resp.headers
    m = await _metrics(s)
    assert m.value("smetric_gateway_controller_up") == 0
    assert m.value("smetric_gateway_fallback_routes_total", cause="controller_unavailable") == 2
    # Only the first request waited for the controller; the second skipped it.
    assert m.value("smetric_gateway_route_rtt_seconds_count", outcome="timeout") == 1
    assert m.value("smetric_gateway_requests_total", reason="gateway_round_robin", status="200") == 2
    # Nothing was routed by the controller, but the answers are still timed and counted.
    assert m.value("smetric_gateway_request_duration_seconds_count") == 2
    assert m.value("smetric_gateway_ttft_seconds_count") == (2 if stream else 0)


def test_an_attempt_without_an_est_hit_estimate_is_counted_not_fatal() -> None:
    """A completion routed without any history estimate (and no controller decision) still
    lands in the funnel, with its est_hit stage counted as 0."""
    from smetric_lmc.gateway_metrics import AttemptRecord, GatewayMetrics

    m = GatewayMetrics(["e0"])
    m.in_flight.labels(backend="e0").inc()
    m.observe_attempt(AttemptRecord("e0", True, True, 0.0, 1.0, 0.2, 100, 5, None, 0, 32))
    prompt = m.registry.get_sample_value("smetric_gateway_cache_funnel_tokens_total", {"backend": "e0", "stage": "prompt"})
    assert prompt == 100
    assert m.registry.get_sample_value("smetric_gateway_cache_funnel_tokens_total",
                                       {"backend": "e0", "stage": "est_hit"}) == 0


def test_a_series_is_looked_up_once_and_is_the_one_labels_returns() -> None:
    from smetric_lmc.gateway_metrics import GatewayMetrics

    m = GatewayMetrics(["i0"])
    child = m.series(m.funnel, "i0", "prompt")
    assert child is m.funnel.labels(backend="i0", stage="prompt")  # positional values in the declared order
    assert m.series(m.funnel, "i0", "prompt") is child
    child.inc(5)
    assert m.registry.get_sample_value("smetric_gateway_cache_funnel_tokens_total",
                                       {"backend": "i0", "stage": "prompt"}) == 5
    assert m.series(m.in_stage, "read") is not m.series(m.in_stage, "route")
