"""``smetric gateway`` against a real controller (in-process ``ControllerApp``, real ZMQ).

The engines here are small aiohttp servers on 127.0.0.1: HTTP peers that replay OpenAI-shaped
responses (JSON and SSE) and a byte-level ``/tokenize``. They exist to test what the gateway does
with HTTP — proxying, SSE pass-through byte for byte, retries, the 502, the done report — without
vLLM; tests/e2e/test_e2e_routing.py runs the same gateway against real vLLM engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from gateway_helpers import (
    BLOCK,
    MSGS,
    SSE_EVENTS,
    Stack,
    StackFactory,
    render,
    tokens_of,
)

from smetric_lmc.hashing import fast_chain, lmcache_chunk_chain, lmcache_root
from smetric_lmc.workers.launch import free_ports


async def test_chat_is_proxied_with_decision_headers_and_done_report(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    resp = await s.chat(MSGS, max_tokens=8)
    assert resp.status == 200
    body = await resp.json()
    inst = resp.headers["X-SMetric-Instance"]
    assert body["choices"][0]["message"]["content"] == f"from {inst}"
    assert resp.headers["X-SMetric-Turn"] == "0"
    assert resp.headers["X-SMetric-Local-Hit"] == "0"
    assert "X-SMetric-Fallback" not in resp.headers
    # The body the engine got is the client's, unchanged.
    engine = next(e for e in s.engines if e.name == inst)
    assert engine.received == [{"model": "tiny", "messages": MSGS, "max_tokens": 8}]
    (done,) = await s.wait_dones(1)
    n = len(tokens_of(render(MSGS, True)))
    assert (done.instance_id, done.prompt_tokens, done.output_tokens, done.cached_tokens, done.ok) == (
        inst, n, 3, 32, True)
    assert done.e2e_s is not None and done.e2e_s > 0
    assert s.controller is not None and len(s.controller.load) == 0  # released


async def test_a_small_json_answer_goes_out_whole_and_a_large_one_streams(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    small = await s.chat(MSGS)
    small_body = await small.read()
    # Read whole and sent in one write: with its length, not chunked.
    assert small.headers["Content-Length"] == str(len(small_body))
    assert "Transfer-Encoding" not in small.headers
    for e in s.engines:
        e.padding = 2 << 20  # above what the gateway buffers
    large = await s.chat(MSGS)
    large_body = await large.read()
    assert large.headers.get("Transfer-Encoding") == "chunked" and len(large_body) > 2 << 20
    for resp, body in ((small, small_body), (large, large_body)):
        inst = resp.headers["X-SMetric-Instance"]
        assert json.loads(body)["choices"][0]["message"]["content"] == f"from {inst}"
    dones = await s.wait_dones(2)
    # Both answers' usage reached the controller.
    assert [(d.output_tokens, d.cached_tokens, d.ok) for d in dones] == [(3, 32, True), (3, 32, True)]


async def test_an_engine_dying_inside_a_small_json_answer_is_retried(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    s.engines[0].die_mid_body = True
    seen = set()
    for _ in range(4):  # round trips until one lands on the dying engine first
        resp = await s.chat(MSGS)
        assert resp.status == 200
        seen.add(resp.headers.get("X-SMetric-Retried-From"))
        # Nothing of the cut answer reached the client: it gets the other engine's, whole.
        assert json.loads(await resp.read())["choices"][0]["message"]["content"] == f"from {s.engines[1].name}"
    assert s.engines[0].name in seen
    assert s.gateway.counters["retries"] >= 1 and s.gateway.counters["bad_gateway"] == 0


async def test_sse_stream_passes_through_byte_for_byte_as_it_arrives(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    for e in s.engines:
        e.hold_stream = True
    resp = await s.chat(MSGS, stream=True)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    # The first event reaches the client while the engine still holds the rest back: streamed.
    first = await asyncio.wait_for(resp.content.readexactly(len(SSE_EVENTS[0])), 5.0)
    assert first == SSE_EVENTS[0]
    for e in s.engines:
        e.release_stream.set()
    rest = await resp.content.read()
    assert first + rest == b"".join(SSE_EVENTS)
    (done,) = await s.wait_dones(1)
    assert (done.prompt_tokens, done.output_tokens, done.cached_tokens, done.ok) == (70, 2, 48, True)
    # The first streamed bytes told the controller the prompt was prefilled.
    assert s.controller is not None and s.controller.core.counters["prefilled"] == 1
    assert s.gateway.counters["prefilled_reports"] == 1 and s.controller.load.stats["prefilled"] == 1
    assert done.ttft_s is not None and done.ttft_s <= done.e2e_s  # type: ignore[operator]


async def test_follow_up_sticks_where_the_index_holds_its_history(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    assert s.controller is not None
    follow = [*MSGS, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "Again."}]
    history = follow[:3]
    hist_ids = tokens_of(render(history, False))
    # What KV events would have told the controller: e1 holds the history's blocks.
    index = s.controller.index
    index.gpu_stored_hashes("e1", fast_chain(hist_ids, BLOCK, root=index.fast_root))
    resp = await s.chat(follow)
    assert resp.status == 200
    h = resp.headers
    assert h["X-SMetric-Instance"] == "e1"
    assert h["X-SMetric-Reason"] == "sticky"
    assert h["X-SMetric-Turn"] == "1"
    assert int(h["X-SMetric-Local-Hit"]) == len(hist_ids) // BLOCK * BLOCK
    assert int(h["X-SMetric-Est-Hit"]) == len(hist_ids) // BLOCK * BLOCK
    # An explicit turn overrides the count: turn 0 balances instead of sticking.
    resp = await s.chat(follow, headers={"X-SMetric-Turn": "0"})
    assert resp.headers["X-SMetric-Turn"] == "0" and resp.headers["X-SMetric-Reason"] == "first_turn"


LONG = [{"role": "system", "content": "You are a careful assistant. " * 20},
        {"role": "user", "content": "Summarise the plan in one line."},
        {"role": "assistant", "content": "Plan: do it."}, {"role": "user", "content": "Again, shorter."}]


async def test_lmcache_chunks_are_hashed_from_the_resolved_root(make_stack: StackFactory) -> None:
    # LMCache's NONE_HASH given by kind: the gateway must hash chunks from the same int root the
    # controller resolved, or every LMCache-tier hit of a gateway request reads as zero.
    p1, p2 = free_ports(2)
    extra = {"hashing": {"block_size": BLOCK, "lmcache_root": "vllm_sha256_cbor", "lmcache_root_seed": "0"},
             "lmcache": {"enabled": True, "pull_url": f"tcp://127.0.0.1:{p1}", "reply_url": f"tcp://127.0.0.1:{p2}"}}
    s: Stack = await make_stack(extra=extra)
    assert s.controller is not None
    hs = s.controller.hashing
    assert hs.lmcache_root == lmcache_root("vllm_sha256_cbor", seed="0") and s.gateway.hashing == hs
    hist_ids = tokens_of(render(LONG[:3], False))
    assert len(hist_ids) >= 2 * hs.chunk_size
    # Only the LMCache tier of e1 holds the history (its GPU blocks were evicted). With LMCache on,
    # an instance enters routing at its workers' first message, as the LMCache server reports them.
    s.controller.sink.lmcache_worker_seen("e0")
    s.controller.sink.lmcache_admit("e1", lmcache_chunk_chain(hist_ids, hs.chunk_size, root=hs.lmcache_root))
    resp = await s.chat(LONG)
    h = resp.headers
    assert (h["X-SMetric-Instance"], h["X-SMetric-Reason"]) == ("e1", "sticky")
    assert int(h["X-SMetric-Local-Hit"]) == len(hist_ids) // hs.chunk_size * hs.chunk_size


async def test_gateway_adopts_the_controllers_hashing_and_recovers_from_a_mismatch(
    make_stack: StackFactory,
) -> None:
    s: Stack = await make_stack(gateway_hashing={"block_size": BLOCK, "fast_namespace": "another-model"})
    assert s.controller is not None
    assert s.gateway.hashing == s.controller.hashing  # adopted at start, every field
    hist_ids = tokens_of(render(LONG[:3], False))
    index = s.controller.index
    index.gpu_stored_hashes("e1", fast_chain(hist_ids, BLOCK, root=index.fast_root))
    # The controller restarted with other settings than the gateway adopted (here: the gateway's
    # copy is made stale): its route is refused, counted and logged, then hashed again and routed.
    s.gateway.hashing = dataclasses.replace(s.gateway.hashing, fast_root=index.fast_root ^ 1)
    resp = await s.chat(LONG)
    assert (resp.headers["X-SMetric-Instance"], resp.headers["X-SMetric-Reason"]) == ("e1", "sticky")
    assert s.gateway.counters["hash_mismatch"] == 1 and s.controller.core.counters["hash_mismatch"] == 1
    assert s.gateway.hashing == s.controller.hashing


def chat_with_history(k: int) -> list[dict[str, Any]]:
    words = " ".join(f"word{(k * 7 + j) % 50}" for j in range(90))
    return [{"role": "system", "content": f"Session {k}. " + words},
            {"role": "user", "content": words[::-1]}, {"role": "assistant", "content": words.upper()},
            {"role": "user", "content": "And then?"}]


async def test_untokenized_history_is_estimated_by_the_one_calibrated_estimator(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    for k in range(6):  # engines tokenize these: exact counts, each also calibrates the estimate
        resp = await s.chat(chat_with_history(k))
        exact = len(tokens_of(render(chat_with_history(k)[:3], False)))
        assert int(resp.headers["X-SMetric-Est-Hit"]) == exact // BLOCK * BLOCK
    for e in s.engines:
        e.tokenize_broken = True
    msgs = chat_with_history(99)
    resp = await s.chat(msgs)
    assert resp.status == 200
    true = len(tokens_of(render(msgs[:3], False)))  # what the served tokenizer would count
    est = int(resp.headers["X-SMetric-Est-Hit"])
    assert abs(est - true) <= 0.15 * true, (est, true)
    assert s.gateway.prompt_reader is not None and s.gateway.prompt_reader.estimator.observations >= 6


async def test_5xx_is_retried_once_on_another_instance(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    s.engines[0].fail_status = 503
    s.engines[1].fail_status = None
    for _ in range(4):  # whichever instance the controller picks first, every request succeeds
        resp = await s.chat(MSGS)
        assert resp.status == 200
        assert resp.headers["X-SMetric-Instance"] == "e1"
    failed_first = len(s.engines[0].received)
    assert failed_first >= 1
    assert s.gateway.counters["retries"] == failed_first
    dones = await s.wait_dones(4 + failed_first)
    bad = [d for d in dones if not d.ok]
    assert len(bad) == failed_first and all(d.instance_id == "e0" for d in bad)
    assert s.controller is not None and len(s.controller.load) == 0


async def test_connect_error_is_retried_and_both_failing_gives_502(make_stack: StackFactory) -> None:
    s: Stack = await make_stack(1, dead_instance=True)
    for _ in range(3):
        resp = await s.chat(MSGS)
        assert resp.status == 200 and resp.headers["X-SMetric-Instance"] == "e0"
    s.engines[0].fail_status = 500
    resp = await s.chat(MSGS)
    assert resp.status == 502
    err = (await resp.json())["error"]
    assert err["type"] == "upstream_error" and "e0" in err["message"] and "dead" in err["message"]
    assert s.gateway.counters["bad_gateway"] == 1


async def test_controller_down_falls_back_to_round_robin(make_stack: StackFactory) -> None:
    s: Stack = await make_stack(controller=False)
    seen = []
    assert s.gateway.route_client is not None
    asked = 0
    route = s.gateway.route_client.route

    async def counting_route(*a: Any, **kw: Any) -> Any:
        nonlocal asked
        asked += 1
        return await route(*a, **kw)

    s.gateway.route_client.route = counting_route  # type: ignore[method-assign]
    for _ in range(4):
        resp = await s.chat(MSGS)
        assert resp.status == 200
        assert resp.headers["X-SMetric-Fallback"] == "controller_unavailable"
        assert resp.headers["X-SMetric-Reason"] == "gateway_round_robin"
        seen.append(resp.headers["X-SMetric-Instance"])
    assert sorted(seen) == ["e0", "e0", "e1", "e1"]
    # Only the first request waited for the route timeout; the rest skipped the controller.
    assert asked == 1


async def test_completions_without_turn_stay_where_their_prompt_is_cached(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    assert s.controller is not None
    index = s.controller.index
    prompt = "Once upon a time, " * 4
    homes = []
    for t in range(4):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        resp = await s.http.post(f"{s.base}/v1/completions", json=body)
        assert resp.status == 200
        h = resp.headers
        homes.append(h["X-SMetric-Instance"])
        assert h["X-SMetric-Turn-Source"] == ("index_first_turn" if t == 0 else "index_follow_up")
        if t > 0:  # (the first route found the index still empty, and balanced by load alone)
            assert h["X-SMetric-Reason"] == "sticky"
        await s.wait_dones(t + 1)
        # What the engine's KV events would report: it cached the prompt it served.
        index.gpu_stored_hashes(h["X-SMetric-Instance"], fast_chain(tokens_of(prompt), BLOCK, root=index.fast_root))
        prompt += f" and then chapter {t} went on for a while."
    assert len(set(homes)) == 1, homes
    stats = s.controller.metrics.turn_sources
    assert stats.labels(source="index_follow_up")._value.get() == 3


async def test_models_completions_and_bad_requests(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    async with s.http.get(f"{s.base}/v1/models") as resp:
        assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "tiny"
    async with s.http.post(f"{s.base}/v1/completions", json={"model": "tiny", "prompt": "def f(x):"}) as resp:
        assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == " x"
        assert resp.headers["X-SMetric-Prompt-Tokens"] == str(len(b"def f(x):"))
    async with s.http.post(f"{s.base}/v1/chat/completions", data=b"{not json") as resp:
        assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
    resp = await s.chat(MSGS, headers={"X-SMetric-Turn": "-1"})
    assert resp.status == 400
    async with s.http.post(f"{s.base}/v1/chat/completions", json={"model": "tiny", "messages": "hi"}) as resp:
        assert resp.status == 400
    assert json.loads(await (await s.http.get(f"{s.base}/healthz")).read())["ok"] is True


async def test_engine_dying_mid_stream_ends_with_an_sse_error_event(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    for e in s.engines:
        e.die_mid_stream = True
    resp = await s.chat(MSGS, stream=True)
    assert resp.status == 200
    first = await resp.content.readexactly(len(SSE_EVENTS[0]))
    assert first == SSE_EVENTS[0]
    # Bytes already went out, so no retry: the client is told the stream broke, not left with a
    # silently short one.
    rest = await resp.content.read()
    assert rest.startswith(b"event: error\ndata: ") and rest.endswith(b"\n\n")
    err = json.loads(rest.split(b"data: ", 1)[1])["error"]
    assert err["type"] == "upstream_error" and err["code"] == 502 and "mid-stream" in err["message"]
    (done,) = await s.wait_dones(1)
    assert done.ok is False and done.error == "cut"
    assert s.gateway.counters["retries"] == 0 and s.gateway.counters["upstream_failures"] == 1


async def test_client_going_away_mid_stream_is_reported_not_ok(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    for e in s.engines:
        e.hold_stream = True
    resp = await s.chat(MSGS, stream=True)
    await resp.content.readexactly(len(SSE_EVENTS[0]))
    resp.close()  # the client hangs up while the engine is still generating
    await asyncio.sleep(0.05)
    for e in s.engines:
        e.release_stream.set()
    (done,) = await s.wait_dones(1)
    assert done.ok is False
    assert s.gateway.counters["client_disconnects"] == 1
    assert s.controller is not None and len(s.controller.load) == 0


async def test_client_closing_right_after_done_marker_is_reported_ok(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    for e in s.engines:
        e.hold_after_done = True
    resp = await s.chat(MSGS, stream=True)
    body = b""
    while not body.endswith(b"data: [DONE]\n\n"):
        body += await resp.content.readany()
    resp.close()  # the client has its whole answer and hangs up before the body's end
    await asyncio.sleep(0.05)
    for e in s.engines:
        e.release_stream.set()
    (done,) = await s.wait_dones(1)
    assert done.ok is True and done.error is None and done.output_tokens == 2
    assert s.gateway.counters["client_disconnects"] == 0


async def test_gateway_errors_are_json_in_openai_shape(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
        async with s.http.request(method, f"{s.base}{path}") as resp:
            assert resp.status == status and resp.content_type == "application/json"
            err = (await resp.json())["error"]
            assert err["code"] == status and err["type"] == "invalid_request_error" and err["message"]
    assert s.gateway.prompt_reader is not None

    async def broken(*_a: Any, **_kw: Any) -> Any:
        raise RuntimeError("tokenizer exploded")

    s.gateway.prompt_reader.read = broken  # type: ignore[method-assign]
    resp = await s.chat(MSGS)
    assert resp.status == 500 and resp.content_type == "application/json"
    err = (await resp.json())["error"]
    assert err["type"] == "server_error" and "tokenizer exploded" in err["message"]


async def test_connect_error_takes_the_instance_out_of_the_controllers_routing(make_stack: StackFactory) -> None:
    s: Stack = await make_stack(1, dead_instance=True)
    assert s.controller is not None
    assert sorted(s.controller.membership.routable_ids()) == ["dead", "e0"]  # no poller: routable from the start
    for _ in range(4):
        resp = await s.chat(MSGS)
        assert resp.status == 200 and resp.headers["X-SMetric-Instance"] == "e0"
    failed = [d for d in await s.wait_dones(1) if d.instance_id == "dead"]
    # The controller balanced the first turn onto "dead" at most once: the report took it out.
    assert len(failed) == 1 and failed[0].error == "connect" and failed[0].ok is False
    assert s.controller.membership.routable_ids() == ["e0"]


async def test_gateway_fails_over_to_a_controller_replica(make_stack: StackFactory) -> None:
    s: Stack = await make_stack(dead_replica=True)
    for _ in range(3):
        resp = await s.chat(MSGS)
        assert resp.status == 200 and "X-SMetric-Fallback" not in resp.headers
        assert resp.headers["X-SMetric-Reason"] != "gateway_round_robin"
    assert s.gateway.route_client is not None and s.gateway.route_client.failovers == 1
    await s.wait_dones(3)
    assert s.controller is not None and len(s.controller.load) == 0


async def test_a_wrong_model_name_gets_openais_not_found_and_is_not_routed(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    body = {"model": "gpt-4o", "messages": MSGS}
    async with s.http.post(f"{s.base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 404
        err = (await resp.json())["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert "gpt-4o" in err["message"] and "tiny" in err["message"]
    assert all(not e.received for e in s.engines)
    assert s.controller is not None and s.controller.core.stats()["service"]["route"] == 0
    # a name an engine lists (a LoRA adapter, say) is served
    assert (await s.chat(MSGS)).status == 200


async def test_status_page_shows_instances_tiers_reasons_and_policy(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    routed = await s.chat(MSGS, max_tokens=8)
    assert routed.status == 200
    reason = routed.headers["X-SMetric-Reason"]
    async with s.http.get(f"{s.base}/") as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
        page = await resp.text()
    for needle in ("<td>e0</td>", "<td>e1</td>", "routable", "Index size per tier", "LMCache local",
                   "global store", "policy <b>smetric</b>", "overload = 2.0", "hit_ratio = 0.5", f"<td>{reason}</td><td>1</td><td>100.0%</td>",
                   "in flight (requests)"):
        assert needle in page, needle


async def test_status_page_without_a_controller_says_so(make_stack: StackFactory) -> None:
    s: Stack = await make_stack(controller=False)
    async with s.http.get(f"{s.base}/") as resp:
        assert resp.status == 200
        assert "does not answer" in await resp.text()


async def test_metrics_carry_no_created_series(make_stack: StackFactory) -> None:
    s: Stack = await make_stack()
    assert (await s.chat(MSGS)).status == 200
    async with s.http.get(f"{s.base}/metrics") as resp:
        text = await resp.text()
    assert "smetric_gateway" in text and "_created" not in text


async def test_with_a_tokenizer_directory_no_request_waits_on_an_engine_tokenize(
        make_stack: StackFactory, tmp_path: Path) -> None:
    from smetric_lmc.lab.mock_engine.tokenizer_dir import write_tokenizer_dir

    # the fake engines tokenize as the mock does (UTF-8 bytes, ChatML), so its directory serves them
    tok_dir = write_tokenizer_dir(tmp_path / "tok")
    s: Stack = await make_stack(gateway_kw={"tokenizer_dir": str(tok_dir)})
    for e in s.engines:
        e.tokenize_broken = True  # were it asked, the counts below would be estimates
    seen = []
    reader = s.gateway.prompt_reader
    assert reader is not None
    read = reader.read

    async def spy(*a: Any) -> Any:
        seen.append(await read(*a))
        return seen[-1]

    reader.read = spy  # type: ignore[method-assign]
    for k in range(3):
        msgs = chat_with_history(k)
        resp = await s.chat(msgs)
        assert resp.status == 200
        assert seen[-1].token_ids == tokens_of(render(msgs, True))
        assert int(resp.headers["X-SMetric-Est-Hit"]) == len(tokens_of(render(msgs[:3], False))) // BLOCK * BLOCK
    assert reader.counters == {"tokenize_calls": 0, "tokenize_failures": 0, "untokenized": 0}


async def test_a_local_tokenizer_is_checked_against_the_engines_and_dropped_when_it_disagrees(
        make_stack: StackFactory, tmp_path: Path) -> None:
    from smetric_lmc.lab.mock_engine.tokenizer_dir import CHATML_TEMPLATE, write_tokenizer_dir

    agrees = write_tokenizer_dir(tmp_path / "same")
    s: Stack = await make_stack(gateway_kw={"tokenizer_dir": str(agrees)})
    reader = s.gateway.prompt_reader
    assert reader is not None and await reader.check_local("tiny") is True and reader.local

    # a template one space off: every prompt's hashes would differ from what the engines report
    differs = write_tokenizer_dir(tmp_path / "off")
    cfg = json.loads((differs / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML_TEMPLATE.replace("'<|im_end|>\\n'", "' <|im_end|>\\n'")
    (differs / "tokenizer_config.json").write_text(json.dumps(cfg))
    s = await make_stack(gateway_kw={"tokenizer_dir": str(differs)})
    reader = s.gateway.prompt_reader
    assert reader is not None and reader.local
    assert await reader.check_local("tiny") is False
    assert not reader.local and reader.counters["local_tokenizer_mismatch"] == 1
    resp = await s.chat(MSGS)
    assert resp.status == 200 and reader.counters["tokenize_calls"] >= 1  # the engines tokenize now


async def test_the_check_waits_for_an_engine_and_keeps_the_tokenizer_when_none_answers(
        make_stack: StackFactory, tmp_path: Path) -> None:
    from smetric_lmc.lab.mock_engine.tokenizer_dir import write_tokenizer_dir

    s: Stack = await make_stack(gateway_kw={"tokenizer_dir": str(write_tokenizer_dir(tmp_path / "tok"))})
    reader = s.gateway.prompt_reader
    assert reader is not None
    for e in s.engines:
        e.tokenize_broken = True
    assert await reader.check_local("tiny", attempts=2, first_wait_s=0.01) is None and reader.local
    for e in s.engines:
        e.tokenize_broken = False
    assert await reader.check_local("tiny", attempts=2, first_wait_s=0.01) is True


async def test_a_gateway_in_the_controllers_process_routes_without_the_socket(make_stack: StackFactory) -> None:
    s: Stack = await make_stack(in_process=True)
    assert s.controller is not None
    for _ in range(3):
        resp = await s.chat(MSGS)
        assert resp.status == 200 and resp.headers["X-SMetric-Reason"] != "controller_unavailable"
    await s.wait_dones(3)
    assert s.controller.core.counters["route"] >= 3  # answered by the controller's core ...
    assert s.controller.service.counters["frames"] == 0  # ... and none crossed its route socket
    assert s.gateway.counters["fallback_routes"] == 0
