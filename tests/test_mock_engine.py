"""The mock engine speaks vLLM's protocols: KV event frames byte for byte as a real vLLM 0.32 sends
them (recorded fixture), decoded by the controller's own subscriber over real ZMQ sockets into a
mirror equal to the engine's cache; OpenAI streaming with cached_tokens; a clean error when killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from helpers import wait_for

from smetric_lmc.controller.vllm_events import VllmEventSubscriber
from smetric_lmc.controller.vllm_wire import decode_payload
from smetric_lmc.lab.mock_engine.cli import options, running_mocks
from smetric_lmc.lab.mock_engine.kv_events import (
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
)
from smetric_lmc.lab.mock_engine.server import encode_text, render_chat
from smetric_lmc.lab.replay.runner import Replay, ReplayConfig
from smetric_lmc.lab.workload.model import TraceRequest, TraceSession, Workload


@contextlib.asynccontextmanager
async def subscribed(info: Any, sink: Any) -> AsyncIterator[VllmEventSubscriber]:
    """A real vLLM KV-event subscriber following one mock engine (connects, as to a vLLM that binds)."""
    sub = VllmEventSubscriber(info.kv_events_endpoint, info.instance_id, sink,
                              replay_endpoint=info.replay_endpoint, bind=False)
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        await sub.close()
        task.cancel()



def _rebuild(event: Any) -> dict[str, Any]:
    name = type(event).__name__
    if name == "BlockStored":
        assert len(event.block_hashes) * event.block_size == len(event.token_ids)
        return block_stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
    if name == "BlockRemoved":
        assert len(event.block_hashes) == 1
        return block_removed(event.block_hashes[0])
    assert name == "AllBlocksCleared", name
    return all_blocks_cleared()


def test_event_frames_are_byte_identical_to_real_vllm(vllm_fixture: dict) -> None:
    """Every recorded batch, decoded by the controller and re-encoded by the mock, gives vLLM's bytes."""
    for topic, seq, payload_hex in vllm_fixture["frames"]:
        payload = bytes.fromhex(payload_hex)
        batch = decode_payload(payload)
        ours = encode_batch([_rebuild(e) for e in batch.events], batch.ts, batch.data_parallel_rank or 0)
        assert ours == payload, f"seq {int(seq, 16)} differs"
        assert bytes.fromhex(topic) == b"kv"


class SetSink:
    """The controller's GPU-tier sink protocol, kept as a set of engine block hashes."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()

    def gpu_stored(self, instance_id: str, block_hashes: Sequence[int], parent: int | None,
                   token_ids: Sequence[int], block_size: int) -> int:
        self.blocks.update(block_hashes)
        return len(block_hashes)

    def gpu_removed(self, instance_id: str, block_hashes: Sequence[int]) -> int:
        self.blocks.difference_update(block_hashes)
        return len(block_hashes)

    def gpu_cleared(self, instance_id: str) -> None:
        self.blocks.clear()


async def _complete(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[list[dict], dict]:
    """Stream one request; returns the data chunks and the usage."""
    chunks: list[dict] = []
    async with http.post(f"{url}/v1/{'chat/completions' if 'messages' in body else 'completions'}",
                         json={"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **body}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks, chunks[-1]["usage"]


async def test_first_frame_equals_real_vllm_for_the_same_prompt(vllm_fixture: dict) -> None:
    """The fixture's first chat, sent as its token ids, yields the frame a real vLLM published
    (same hashes, tokens and layout; timestamps aside): same NONE_HASH seed, block size 32."""
    req = vllm_fixture["requests"][0]
    frame0 = vllm_fixture["frames"][0]
    recorded = decode_payload(bytes.fromhex(frame0[2]))
    args = options(none_hash_seed=vllm_fixture["server"]["none_hash_seed"], speed=100.0)
    async with running_mocks(args) as mocks, aiohttp.ClientSession() as http:
        info, core = mocks[0]
        sink = SetSink()
        async with subscribed(info, sink) as sub:
            await asyncio.sleep(0.2)  # the SUB connects before the first batch, as in the recording
            _, usage = await _complete(http, info.http_url, {"prompt": req["prompt_token_ids"], "max_tokens": 4})
            assert usage["prompt_tokens"] == len(req["prompt_token_ids"])
            await wait_for(lambda: sub.stats.batches >= 1, what="first batch")
    payload = core.publisher.buffered()[0][1]  # type: ignore[union-attr]
    ours = decode_payload(payload)
    assert ours.events == recorded.events
    assert payload == encode_batch([_rebuild(e) for e in recorded.events], ours.ts)
    assert sink.blocks == set(req["prompt_full_block_hashes"])


async def test_events_mirror_the_cache_through_eviction_and_late_replay() -> None:
    """Small KV: prompts evict each other. A subscriber attached from the start and one attached
    late (it fills from the replay ROUTER) both end with exactly the engine's cached blocks."""
    args = options(num_gpu_blocks=24, speed=200.0, max_model_len=768)
    async with running_mocks(args) as mocks, aiohttp.ClientSession() as http:
        info, core = mocks[0]
        early = SetSink()
        sub1 = VllmEventSubscriber(info.kv_events_endpoint, info.instance_id, early,
                                   replay_endpoint=info.replay_endpoint, bind=False)
        t1 = asyncio.create_task(sub1.run())
        await asyncio.sleep(0.2)
        session = [7] * 5
        usages = []
        for k in range(10):
            session = session + list(range(100 + 37 * k, 100 + 37 * k + 50))  # each turn extends the last
            prompt = session if k % 3 else [1000 + k] * 300  # every third request is unrelated and evicts
            _, u = await _complete(http, info.http_url, {"prompt": prompt, "max_tokens": 8})
            usages.append((k, len(prompt), u["prompt_tokens_details"]["cached_tokens"]))
        assert core.counters.evicted_blocks > 0
        await wait_for(lambda: early.blocks == core.cached_block_hashes(), what="live mirror")
        late = SetSink()
        sub2 = VllmEventSubscriber(info.kv_events_endpoint, info.instance_id, late,
                                   replay_endpoint=info.replay_endpoint, bind=False)
        t2 = asyncio.create_task(sub2.run())
        await asyncio.sleep(0.2)
        await _complete(http, info.http_url, {"prompt": [5] * 70, "max_tokens": 2})  # a batch to notice the gap
        await wait_for(lambda: late.blocks == core.cached_block_hashes(), what="replayed mirror")
        assert sub2.stats.replays >= 1 and early.blocks == late.blocks
        for sub, task in ((sub1, t1), (sub2, t2)):
            await sub.close()
            task.cancel()
    # Follow-ups hit whole blocks of their history, never the last token (vLLM's rule).
    assert any(c > 0 for _, _, c in usages)
    assert all(c % 32 == 0 and c <= n - 1 for _, n, c in usages)


async def test_reset_prefix_cache_clears_the_engine_and_its_mirror() -> None:
    """``POST /reset_prefix_cache`` as vLLM answers it: refused while a request holds blocks, else the
    cache empties, an ``AllBlocksCleared`` event empties a subscriber's mirror, and the same prompt
    misses afterwards."""
    async with running_mocks(options(speed=20.0)) as mocks, aiohttp.ClientSession() as http:
        info, core = mocks[0]
        sink = SetSink()
        async with subscribed(info, sink):
            await asyncio.sleep(0.2)
            prompt = list(range(300, 300 + 200))
            await _complete(http, info.http_url, {"prompt": prompt, "max_tokens": 2})
            _, warm = await _complete(http, info.http_url, {"prompt": prompt, "max_tokens": 2})
            assert warm["prompt_tokens_details"]["cached_tokens"] == 192
            await wait_for(lambda: sink.blocks and sink.blocks == core.cached_block_hashes(), what="mirror")
            # A long generation holds blocks: the reset is refused and nothing is announced.
            busy = asyncio.create_task(_complete(http, info.http_url, {"prompt": [9] * 64, "max_tokens": 400}))
            await wait_for(lambda: core.running == 1, what="a running request")
            async with http.post(f"{info.http_url}/reset_prefix_cache") as r:
                assert r.status == 200 and await r.json() == {"success": False}
            assert core.cached_block_hashes() == sink.blocks != set()
            await busy
            async with http.post(f"{info.http_url}/reset_prefix_cache") as r:
                assert r.status == 200 and await r.json() == {"success": True}
            assert core.cached_block_hashes() == set()
            await wait_for(lambda: not sink.blocks, what="AllBlocksCleared at the subscriber")
            _, cold = await _complete(http, info.http_url, {"prompt": prompt, "max_tokens": 2})
            assert cold["prompt_tokens_details"]["cached_tokens"] == 0
            await wait_for(lambda: sink.blocks == core.cached_block_hashes() != set(), what="mirror after reset")
    frames = [decode_payload(p) for _, p in core.publisher.buffered()]  # type: ignore[union-attr]
    assert sum(type(e).__name__ == "AllBlocksCleared" for f in frames for e in f.events) == 1


async def test_chat_tokenize_models_and_metrics_agree() -> None:
    async with running_mocks(options(speed=100.0)) as mocks, aiohttp.ClientSession() as http:
        url = mocks[0][0].http_url
        messages = [{"role": "system", "content": "be brief " * 20}, {"role": "user", "content": "hi"}]
        async with http.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}) as r:
            ids = (await r.json())["tokens"]
        assert ids == encode_text(render_chat(messages))
        chunks, usage = await _complete(http, url, {"messages": messages, "max_tokens": 5})
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "abcde"
        assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 5
        _, again = await _complete(http, url, {"messages": messages, "max_tokens": 5})
        assert again["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 32 * 32
        async with http.get(f"{url}/v1/models") as r:
            card = (await r.json())["data"][0]
        assert card["id"] == "tiny" and card["max_model_len"] > 0
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        assert f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {float(again["prompt_tokens_details"]["cached_tokens"])}' in text
        assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0' in text
        async with http.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [1] * 10,
                                                             "max_tokens": 10**9}) as r:
            assert r.status == 400 and "maximum context length" in (await r.json())["message"]


def test_engine_killed_mid_stream_gives_the_client_a_clean_error(tmp_path: Path) -> None:
    """A replay whose engine dies while streaming records a failed request with the reason and
    carries on; nothing hangs and nothing raises."""
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "smetric_lmc.cli", "mock-engine", "--speed", "0.05",
                             "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "mock engine did not start"
            time.sleep(0.1)
        url = json.loads(ready.read_text())["instances"][0]["http_url"]
        req = TraceRequest(0.0, 64 * 10, 4000, np.arange(10, dtype=np.uint64))
        wl = Workload("one", 64, [TraceSession("s", [req])])

        async def run() -> list:
            rp = Replay(wl, ReplayConfig(url=url, timeout_s=60))
            task = asyncio.create_task(rp.run())
            await asyncio.sleep(3.0)  # prefill done (0.05x speed), tokens streaming
            os.killpg(proc.pid, signal.SIGKILL)
            return await asyncio.wait_for(task, 30)

        records = asyncio.run(run())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (rec,) = records
    assert not rec.ok and rec.status == 200
    assert rec.first_token == rec.first_token  # it had started streaming
    assert rec.error, "the failure must say why"
    # aiohttp's word for a chunked stream cut short; the record keeps it for the operator.
    assert rec.error.startswith("ClientPayloadError"), rec.error


async def test_steps_that_end_late_in_wall_time_are_counted() -> None:
    """A blocked event loop (the machine short of CPU) makes engine steps end after their modelled
    end: the engine counts how late, so a bench can tell a slow router from a slow machine."""
    async with running_mocks(options(speed=1.0)) as mocks, aiohttp.ClientSession() as http:
        info, core = mocks[0]
        busy = asyncio.create_task(_complete(http, info.http_url, {"prompt": [7] * 64, "max_tokens": 200}))
        await wait_for(lambda: core.counters.steps > 2, what="decoding steps")
        time.sleep(0.08)  # the loop is held: the step due meanwhile ends late
        await busy
        c = core.counters
        assert c.step_lag_max_s >= 0.05 and c.steps_late >= 1
        assert c.step_lag_sum_s >= c.step_lag_max_s and c.steps_late < c.steps


async def test_the_engine_counts_the_tokens_of_requests_past_the_tpot_slo() -> None:
    """The engine's own account of the TPOT SLO (beside the client's, it tells time lost in the
    engines from time lost between engine and client): prompt + output tokens of every finished
    request, and of those whose time per output token here passed --tpot-slo-ms."""
    for slo_ms, slow in ((1e-3, True), (1e4, False)):
        async with running_mocks(options(speed=20.0, tpot_slo_ms=slo_ms)) as mocks, aiohttp.ClientSession() as http:
            info, core = mocks[0]
            await _complete(http, info.http_url, {"prompt": [7] * 64, "max_tokens": 12})
            await _complete(http, info.http_url, {"prompt": [9] * 40, "max_tokens": 1})  # no TPOT
            c = core.counters
            assert c.finished_tokens == 64 + 12 + 40 + 1
            assert c.slow_tpot_tokens == (64 + 12 if slow else 0)
    with pytest.raises(ValueError, match="TPOT SLO"):
        async with running_mocks(options(tpot_slo_ms=0.0)):
            pass
