"""One real vLLM CPU engine: prefix-cache hits on a follow-up turn and the KV events behind them."""

from __future__ import annotations

import hashlib
import json
import logging
import time
import urllib.request
from typing import Any

import cbor2
import msgspec
import pytest
import zmq

from smetric_lmc.workers.launch import RunningEngine, group_rss_bytes

log = logging.getLogger(__name__)

pytestmark = pytest.mark.e2e

SYSTEM = (
    "You are a careful coding agent working in a Python repository. Read files before editing "
    "them, keep changes small, run the tests after each change, and explain what you did. "
) * 6


def post_json(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def chat(engine: RunningEngine, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return post_json(
        f"{engine.http_url}/v1/chat/completions",
        {"model": engine.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0},
    )


def prompt_tokens(engine: RunningEngine, messages: list[dict[str, str]]) -> list[int]:
    out = post_json(
        f"{engine.http_url}/tokenize",
        {"model": engine.model, "messages": messages, "add_generation_prompt": True},
    )
    return list(out["tokens"])


class KVEventReader:
    """Minimal SUB client: collects decoded events and the seq numbers they came with."""

    def __init__(self, ctx: zmq.Context, endpoint: str, topic: str = "kv") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.seqs: list[int] = []
        self.events: list[dict[str, Any]] = []

    def poll(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                return
            topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            _ts, events, *_ = msgspec.msgpack.decode(payload)
            self.events.extend(events)

    def wait_for(self, pred: Any, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred() and time.monotonic() < deadline:
            self.poll(0.2)

    def stored(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == "BlockStored"]

    def close(self) -> None:
        self.sock.close()


def replay_seqs(ctx: zmq.Context, endpoint: str, start_seq: int = 0) -> list[int]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        seqs: list[int] = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:  # end-of-replay marker
                return seqs
            seqs.append(seq)
        raise AssertionError("replay did not finish")
    finally:
        dealer.close()


def block_hashes(tokens: list[int], block_size: int, seed: str) -> list[int]:
    # vLLM sha256_cbor: digest = sha256(cbor([parent_digest, tokens, extra_keys])); the event
    # carries the digest's last 8 bytes. The root parent is the digest of the seed string.
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def test_follow_up_turn_hits_prefix_cache_and_events_match(start_engines: Any, record_property: Any) -> None:
    t0 = time.monotonic()
    (engine,) = start_engines(1)
    bs = engine.block_size
    record_property("engine_ready_s", round(engine.ready_s, 1))
    rss = group_rss_bytes(engine.process.pid or 0)
    record_property("engine_rss_mib", rss // 2**20)
    log.info(
        "engine ready in %.1f s (fixture %.1f s), RSS %d MiB",
        engine.ready_s,
        time.monotonic() - t0,
        rss >> 20,
    )

    ctx = zmq.Context()
    reader = KVEventReader(ctx, engine.kv_events_endpoint)
    try:
        # SUB connects asynchronously; give it time so the first turn's events are not lost.
        reader.poll(1.0)

        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}]
        tokens1 = prompt_tokens(engine, turn1)
        # max_tokens=1: no decode step fills a block, so exactly the prompt's full blocks are stored.
        t = time.monotonic()
        r1 = chat(engine, turn1, max_tokens=1)
        lat1 = time.monotonic() - t
        assert r1["usage"]["prompt_tokens"] == len(tokens1)
        full1 = len(tokens1) // bs
        assert full1 >= 3, "prompt too short to exercise prefix caching"
        reader.wait_for(lambda: sum(len(e["block_hashes"]) for e in reader.stored()) >= full1)
        stored1 = reader.stored()
        hashes1 = [h for e in stored1 for h in e["block_hashes"]]
        assert len(hashes1) == full1
        assert [tok for e in stored1 for tok in e["token_ids"]] == tokens1[: full1 * bs]
        assert all(e["block_size"] == bs for e in stored1)
        assert stored1[0].get("parent_block_hash") is None
        # The launcher fixes PYTHONHASHSEED, which vLLM uses as its NONE_HASH seed.
        assert hashes1 == block_hashes(tokens1, bs, engine.process.launch.env["PYTHONHASHSEED"])

        turn2 = [
            *turn1,
            {"role": "assistant", "content": r1["choices"][0]["message"]["content"] or ""},
            {"role": "user", "content": "Now open the README and summarise it."},
        ]
        tokens2 = prompt_tokens(engine, turn2)
        t = time.monotonic()
        r2 = chat(engine, turn2, max_tokens=8)
        lat2 = time.monotonic() - t
        cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        common = next(
            (i for i, (a, b) in enumerate(zip(tokens1, tokens2, strict=False)) if a != b),
            min(len(tokens1), len(tokens2)),
        )
        expected = min(common // bs, full1) * bs
        assert cached > 0
        assert cached == expected, (cached, expected, len(tokens1), len(tokens2))

        n_events_before = len(stored1)
        reader.wait_for(lambda: len(reader.stored()) > n_events_before)
        new_blocks = [h for e in reader.stored()[n_events_before:] for h in e["block_hashes"]]
        # Turn 2 stores the blocks past the hit: its prompt's remaining full blocks and, at most,
        # blocks its 8 generated tokens filled.
        out2 = r2["usage"]["completion_tokens"]
        lo = len(tokens2) // bs - cached // bs
        hi = (len(tokens2) + out2 - 1) // bs - cached // bs
        assert lo <= len(new_blocks) <= hi, (len(new_blocks), lo, hi)
        prefix2 = block_hashes(tokens2, bs, engine.process.launch.env["PYTHONHASHSEED"])
        assert new_blocks[:lo] == prefix2[cached // bs :]

        # Nothing was lost on the SUB side: the replay buffer holds exactly the seqs we saw.
        assert reader.seqs == list(range(len(reader.seqs)))
        assert replay_seqs(ctx, engine.replay_endpoint) == reader.seqs

        record_property("turn1_latency_s", round(lat1, 3))
        record_property("turn2_latency_s", round(lat2, 3))
        log.info(
            "turn1 %d tokens in %.2f s; turn2 %d tokens, %d cached, in %.2f s",
            len(tokens1),
            lat1,
            len(tokens2),
            cached,
            lat2,
        )
    finally:
        reader.close()
        ctx.term()
