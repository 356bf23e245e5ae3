"""smetric replay: token ids that carry a trace's block sharing, checked against an engine's own
prefix cache (the mock engine's cached_tokens, vLLM's rule: whole blocks, never the last token)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from replay_helpers import check_feedback

from smetric_lmc.lab.mock_engine.cli import options, running_mocks
from smetric_lmc.lab.replay.prompts import TokenSpace, prompt_tokens, scaled_ids
from smetric_lmc.lab.replay.runner import Record, Replay, ReplayConfig
from smetric_lmc.lab.replay.summary import summarize_records
from smetric_lmc.lab.sim.cluster import chained_lcp
from smetric_lmc.lab.sim.config import SLO, SimConfig
from smetric_lmc.lab.workload import synthetic
from smetric_lmc.lab.workload.model import TraceRequest, TraceSession, Workload


def _req(ids: list[int], extra: int = 0) -> TraceRequest:
    return TraceRequest(0.0, 64 * len(ids) + extra, 8, np.asarray(ids, dtype=np.uint64))


def test_equal_block_ids_give_equal_token_blocks_and_nothing_else_is_shared() -> None:
    sp = TokenSpace(4096, 16)
    a = prompt_tokens(_req([1, 2, 3, 4], extra=10), 64, sp, salt=1)
    b = prompt_tokens(_req([1, 2, 9, 10], extra=10), 64, sp, salt=2)
    assert len(a) == len(b) == 4 * 64 + 10
    assert a[:128] == b[:128]
    # Past the shared blocks no 32-token engine block is equal, and the unshared tails differ.
    assert all(a[i : i + 32] != b[i : i + 32] for i in range(128, 256, 32))
    assert a[256:] != b[256:]
    assert min(a + b) >= 16 and max(a + b) < 4096
    with pytest.raises(ValueError):
        TokenSpace(16, 16)


def test_context_scale_keeps_prefix_structure() -> None:
    ids = np.arange(1, 101, dtype=np.uint64)
    other = ids.copy()
    other[60:] += 1000  # shares 60 blocks
    for scale in (0.5, 0.25, 0.1):
        n = int(100 * scale)
        sa, sb = scaled_ids(ids, n, scale), scaled_ids(other, n, scale)
        assert len(sa) == n and abs(chained_lcp(sa, sb) - 60 * scale) <= 1


def _small_agent_workload(sessions: int, turns: int) -> Workload:
    wl = synthetic(sessions, seed=3)
    roots = [TraceSession(s.session_id, s.requests[:turns]) for s in wl.sessions if s.parent_id is None]
    return Workload("small-agents", wl.block_size, roots)


async def test_replay_reproduces_the_traces_block_sharing() -> None:
    """Every request's cached_tokens equals the longest recorded prefix it shares with any request
    that finished before it was sent (its predecessor, for an agent's follow-up), in whole blocks."""
    wl = _small_agent_workload(sessions=3, turns=6)
    async with running_mocks(options(speed=400.0)) as mocks:
        url = mocks[0][0].http_url
        rp = Replay(wl, ReplayConfig(url=url, rate=50.0, time_scale=0.0005, seed=1, feedback=False))
        records = await rp.run()
    assert len(records) == sum(len(s.requests) for s in wl.sessions)
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    by_id = {s.session_id: s for s in wl.sessions}
    followups_checked = 0
    for r in records:
        tr = by_id[r.session_id].requests[r.request]
        cap = (r.input - 1) // 32 * 32
        done_before = [q for q in records if q.finish <= r.arrival]
        shared = max((chained_lcp(by_id[q.session_id].requests[q.request].block_ids, tr.block_ids)
                      for q in done_before), default=0)
        assert r.cached_tokens == min(shared * wl.block_size, cap), (r.session_id, r.request)
        if r.request > 0:
            prev = by_id[r.session_id].requests[r.request - 1]
            if chained_lcp(prev.block_ids, tr.block_ids) == shared:
                followups_checked += 1
    assert followups_checked >= 10  # the predecessor is what a follow-up shares most with
    res = summarize_records(records)
    total_in = sum(r.input for r in records)
    assert res.summary["hit_local"] == pytest.approx(sum(r.cached_tokens or 0 for r in records) / total_in)
    assert res.summary["hit_local"] > 0.5


async def test_scaled_replay_and_skipped_requests() -> None:
    """Context scaling shrinks prompts; requests over the engine's max_model_len (learned from
    /v1/models) are skipped as rejected, not sent."""
    wl = _small_agent_workload(sessions=2, turns=4)
    async with running_mocks(options(speed=400.0, max_model_len=2500)) as mocks:
        url = mocks[0][0].http_url
        records = await Replay(wl, ReplayConfig(url=url, rate=50.0, time_scale=0.0005, context_scale=0.05,
                                                output_scale=0.5)).run()
    for r in records:
        tr = next(s for s in wl.sessions if s.session_id == r.session_id).requests[r.request]
        assert r.input == round(tr.input_tokens * 0.05)
        assert r.rejected == (r.input + r.output > 2500)
        assert r.ok != r.rejected
        if r.ok:
            assert r.completion_tokens == r.output == max(1, round(tr.output_tokens * 0.5))
    assert any(r.ok and r.cached_tokens for r in records)


@contextlib.asynccontextmanager
async def _serving(app: web.Application) -> AsyncIterator[int]:
    """``app`` on a free loopback port (yielded) until the block ends."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def test_text_prompts_resend_the_answer_without_return_token_ids() -> None:
    """With text prompts the answer's text is its ids (the byte tokenizer): the closed loop works
    without ``return_token_ids``, a field vllm-router's kv_aware refuses cache credit for. And each
    request carries its session's key in the headers the peers' session affinity reads."""
    wl = _small_agent_workload(sessions=2, turns=6)
    bodies: list[dict] = []
    keys: list[tuple[str | None, str | None]] = []

    @web.middleware
    async def spy(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.path == "/v1/completions":
            bodies.append(json.loads(await request.read()))
            keys.append((request.headers.get("x-session-id"), request.headers.get("X-SMG-Routing-Key")))
        return await handler(request)

    async with running_mocks(options(speed=400.0)) as mocks:
        engine = mocks[0][0].http_url
        app = web.Application(middlewares=[spy])

        async def forward(request: web.Request) -> web.StreamResponse:
            async with aiohttp.ClientSession() as s, s.post(engine + "/v1/completions",
                                                            data=await request.read(),
                                                            headers={"Content-Type": "application/json"}) as up:
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers["Content-Type"]})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        app.router.add_post("/v1/completions", forward)
        async with _serving(app) as port:
            records = await Replay(wl, ReplayConfig(url=f"http://127.0.0.1:{port}", rate=50.0, time_scale=0.0005,
                                                    context_scale=0.1, output_scale=0.1,
                                                    tokens=TokenSpace(128, 16), text_prompts=True,
                                                    session_headers=("x-session-id", "X-SMG-Routing-Key"))).run()
    assert bodies and all("return_token_ids" not in b and isinstance(b["prompt"], str) for b in bodies)
    # one key per replayed session, the same in both headers, on every one of its requests
    assert all(a is not None and a == b for a, b in keys)
    assert sorted(Counter(a for a, _ in keys).values()) == sorted(Counter(r.session for r in records).values())
    assert len(set(keys)) == len({r.session for r in records}) >= 2
    assert all(r.ok for r in records)
    assert check_feedback(records, 32) >= 5


async def test_replay_resends_the_generated_answer_and_it_hits() -> None:
    wl = _small_agent_workload(sessions=2, turns=6)
    totals: list[int] = []
    done: list[int] = []
    async with running_mocks(options(speed=400.0)) as mocks:
        records = await Replay(wl, ReplayConfig(url=mocks[0][0].http_url, rate=50.0, time_scale=0.0005,
                                                context_scale=0.1, output_scale=0.1),
                               progress=done.append, on_total=totals.append).run()
    assert all(r.ok for r in records)
    assert check_feedback(records, 32) >= 5
    # the progress bar's total is known before the first request, and every request counts once
    assert totals == [len(records)] == [sum(done)]


def test_smetric_replay_command(tmp_path) -> None:
    """The console command end to end against a mock engine process: tables, JSON summary, records."""
    import json
    import subprocess
    import sys
    import time

    ready = tmp_path / "ready.json"
    engine = subprocess.Popen([sys.executable, "-m", "smetric_lmc.cli", "mock-engine", "--speed", "200",
                               "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert engine.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        url = json.loads(ready.read_text())["instances"][0]["http_url"]
        out = subprocess.run(
            [sys.executable, "-m", "smetric_lmc.cli", "replay", "--url", url, "--sessions", "2", "--rate", "20",
             "--time-scale", "0.0005", "--context-scale", "0.05", "--output-scale", "0.05", "--quiet", "--json",
             "--records", str(tmp_path / "r.jsonl")], capture_output=True, text=True, timeout=120)
    finally:
        engine.terminate()
        engine.wait(10)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| policy | TPS in SLO (tok/s) |" in out.stdout
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = (tmp_path / "r.jsonl").read_text().splitlines()
    assert summary["requests"] == len(rows) > 10 and summary["failed"] == 0
    assert 0 < summary["hit_local"] < 1


async def test_first_token_is_timed_when_its_text_is_empty() -> None:
    """vLLM streams a token whose text it holds back (part of a UTF-8 character) with empty text and
    its id; TTFT is that chunk's arrival, not the first chunk with text (here none ever has text)."""
    gap = 0.3

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(3):
            if k:
                await asyncio.sleep(gap)
            chunk = {"choices": [{"index": 0, "text": "", "token_ids": [7 + k]}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": 64, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with _serving(app) as port:
        wl = Workload("one", 64, [TraceSession("s", [TraceRequest(0.0, 64, 3, np.asarray([1], dtype=np.uint64))])])
        (rec,) = await Replay(wl, ReplayConfig(url=f"http://127.0.0.1:{port}", max_model_len=4096)).run()
    assert rec.ok and rec.completion_tokens == 3
    assert rec.first_token - rec.arrival < gap  # the first (empty-text) chunk, not one 0.3 s later
    assert rec.finish - rec.first_token >= 2 * gap * 0.9


def test_the_summary_says_whether_tps_within_slo_was_lost_to_ttft_or_to_tpot() -> None:
    """Three served requests of 1,100 tokens each: one within both SLOs, one past its TTFT limit,
    one on time but decoding slower than the TPOT limit; each loses a third of the tokens."""
    def rec(k: int, first: float, finish: float) -> Record:
        return Record(session=k, session_id=str(k), request=0, turn=0, input=1000, output=100, arrival=0.0,
                      first_token=first, finish=finish, status=200, ok=True, instance="a")

    slo = SLO()
    late = slo.ttft_limit(1000) + 1.0
    records = [rec(0, 0.5, 0.5 + 99 * 0.01), rec(1, late, late + 99 * 0.01), rec(2, 0.5, 0.5 + 99 * 0.1)]
    s = summarize_records(records, SimConfig(slo=slo)).summary
    assert s["tokens_lost_ttft"] == pytest.approx(1 / 3)
    assert s["tokens_lost_tpot"] == pytest.approx(1 / 3)
    assert s["slo_attainment"] == pytest.approx(1 / 3)
