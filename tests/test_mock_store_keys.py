"""The mock's global tier named in a real Redis as LMCache's redis connector names it, followed by the
controller's own Redis adapter: what the controller sees is exactly the whole chunks the mock's tier
holds, after puts and after evictions. The engines are the simulator's model run in real time (the
GPUs and the store's RDMA cannot run here); the Redis and the controller's adapter are the real ones."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from helpers import RecorderSink, wait_for
from services import RedisServer, free_port, require_redis

from smetric_lmc.controller.global_redis import RedisGlobalTier
from smetric_lmc.controller.lmcache_keys import format_key
from smetric_lmc.hashing import lmcache_chunk_chain
from smetric_lmc.lab.mock_engine.cli import options, run_mock_engine, running_mocks, store_keys
from smetric_lmc.lab.mock_engine.stack import bring_up_mock
from smetric_lmc.lab.mock_engine.store_keys import StoreKeys
from smetric_lmc.lab.mock_engine.vllm_hash import chain_digests, event_hash

PROMPT_A = list(range(1, 200)) * 40  # 7,960 tokens: 31 whole chunks of 256
PROMPT_B = list(range(300, 499)) * 40


def _blocks(tokens: list[int], bs: int = 32) -> np.ndarray:
    return np.array([event_hash(d) for d in chain_digests(tokens, bs, None, "0")], dtype=np.uint64)


def test_chunk_names_follow_the_tiers_last_block_and_the_latest_word_wins() -> None:
    keys = StoreKeys("redis://127.0.0.1:1/0", model="tiny", block_size=32)
    blocks = _blocks(PROMPT_A)
    keys.note_prompt(PROMPT_A, blocks)
    chunks = lmcache_chunk_chain(PROMPT_A, 256)
    assert len(chunks) == 31
    # Only a chunk's last block names it: a put that ends inside a chunk announces nothing for it.
    keys.global_stored(blocks[:12].tolist())
    assert keys._pending == {chunks[0]: True}
    keys.global_stored(blocks[12:16].tolist() + [12345])  # a block no prompt named: ignored
    keys.global_removed(blocks[7:16].tolist())
    assert keys._pending == {chunks[0]: False, chunks[1]: False}
    assert keys.keys(chunks[0]) == [format_key("tiny", 1, 0, chunks[0], "bfloat16", suffix="kv_bytes"),
                                    format_key("tiny", 1, 0, chunks[0], "bfloat16", suffix="metadata")]
    with pytest.raises(ValueError, match="whole blocks"):
        StoreKeys("redis://127.0.0.1:1/0", model="tiny", block_size=48)


def test_keys_without_a_tier_or_a_store_are_refused() -> None:
    with pytest.raises(ValueError, match="global-gib"):
        store_keys(options(global_store_keys="redis://127.0.0.1:1/0"))
    # Nothing listens there: a clear error and exit status 1, no traceback.
    args = options(global_gib=1.0, global_store_keys=f"redis://127.0.0.1:{free_port()}/0")
    assert run_mock_engine(args) == 1


async def _ask(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}) as r:
        assert r.status == 200, await r.text()


def _held(tier: object, blocks: np.ndarray, chain: Iterable[int]) -> set[int]:
    """The chunks of a prompt the mock's tier holds whole (its leading blocks, in chunks of 8)."""
    _, p = tier.cache.match(blocks)  # type: ignore[attr-defined]
    return set(list(chain)[: p // 8])


@pytest.mark.services
def test_the_controller_sees_what_the_mocks_tier_holds() -> None:
    async def main(url: str) -> None:
        sink = RecorderSink()
        follower = RedisGlobalTier(url, sink, model="tiny", reconcile_interval_s=60.0,
                                   backoff_initial_s=0.05, backoff_max_s=0.2)
        task = asyncio.create_task(follower.run())
        # 1 GiB: 42 chunks of 256 tokens at the profile's 96 KiB/token; the two prompts need 62
        args = options(instances=2, global_gib=1.0, global_store_keys=url)
        try:
            await wait_for(lambda: follower.available, what="the controller's adapter connected")
            async with running_mocks(args) as mocks, aiohttp.ClientSession() as s:
                (a, core), (b, _) = mocks
                tier = core.tiers.shared.tier
                chain_a, chain_b = lmcache_chunk_chain(PROMPT_A, 256), lmcache_chunk_chain(PROMPT_B, 256)
                await _ask(s, a.http_url, PROMPT_A)
                await wait_for(lambda: sink.chunks == set(chain_a), what="A's 31 chunks", timeout_s=10)
                await _ask(s, b.http_url, PROMPT_B)  # its put evicts A's tail
                want = _held(tier, _blocks(PROMPT_A), chain_a) | _held(tier, _blocks(PROMPT_B), chain_b)
                assert set(chain_b) <= want and len(want & set(chain_a)) < 31
                await wait_for(lambda: sink.chunks == want, what="the tier after eviction", timeout_s=10)
                assert core.tiers.shared.keys.errors == 0
        finally:
            await follower.close()
            await task

    with RedisServer() as srv:
        asyncio.run(main(srv.url))


@pytest.mark.services
def test_smetric_up_mock_with_a_global_tier_routes_on_it(tmp_path: Path) -> None:
    """``smetric up --mock 2 --mock-global-gib 1``: a prompt computed on one instance is, for the
    controller, in the global tier (the gateway's X-SMetric-Global-Hit), and its redis-server stops
    with the stack."""
    require_redis()
    args = argparse.Namespace(mock=2, mock_processes=1, host="127.0.0.1", port=0, policy="smetric",
                              mock_args="--speed 20", mock_global_gib=1.0)
    with pytest.raises(ValueError, match="mock-processes 1"):
        bring_up_mock(argparse.Namespace(**{**vars(args), "mock_processes": 2}), tmp_path)
    stack = bring_up_mock(args, tmp_path)
    try:
        body = json.dumps({"model": "tiny", "prompt": PROMPT_A, "max_tokens": 1}).encode()
        req = urllib.request.Request(f"{stack.gateway_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + 20
        while True:  # the put lands, then Redis tells the controller
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200
                global_hit = int(r.headers["X-SMetric-Global-Hit"])
            if global_hit or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert global_hit == 31 * 256
        store = stack.processes[-3]  # mocks' process, the store, then controller and gateway
        assert store.name == "redis-store" and store.poll() is None
    finally:
        stack.stop()
    assert store.poll() is not None
