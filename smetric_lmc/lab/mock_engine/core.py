"""A simulated vLLM engine run in real time: the simulator's engine model behind a live interface.

The batching, iteration times, KV capacity and eviction are the simulator's own
(``smetric_lmc.lab.sim.engine.Instance`` with its ``Profile``): this module only drives that model from
an asyncio clock instead of a discrete-event heap, turns its callbacks into vLLM KV events (one
batch per engine step) and token streams, and counts what vLLM's ``/metrics`` reports.

Model time runs ``speed`` times faster than wall time. Block hashes are vLLM's own chain
(``--prefix-caching-hash-algo``), so the events carry the hashes a real engine would send for the
same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from smetric_lmc.lab.mock_engine.kv_events import (
    KVEventPublisher,
    all_blocks_cleared,
    block_removed,
    block_stored,
)
from smetric_lmc.lab.mock_engine.retrieve import MockClock, TierView
from smetric_lmc.lab.mock_engine.vllm_hash import SUPPORTED_ALGOS, chain_digests, event_hash
from smetric_lmc.lab.sim.cache import PrefixCache
from smetric_lmc.lab.sim.config import SLO
from smetric_lmc.lab.sim.engine import SEG_MIXED, Instance
from smetric_lmc.lab.sim.profile import Profile
from smetric_lmc.lab.sim.request import SimRequest

log = logging.getLogger(__name__)


class RequestTooLong(ValueError):
    """The prompt plus max_tokens do not fit the engine (vLLM answers 400)."""


@dataclass
class Handle:
    """One request's side of the engine: the model's record plus what the HTTP handler awaits."""

    rid: str
    tokens: list[int]  # the prompt's, then the generated ones appended when the request ends
    sim: SimRequest
    chain: np.ndarray  # vLLM block hashes of ``tokens``' full blocks
    last_digest: bytes | None  # full digest of the last hashed block (continues the chain)
    queue: asyncio.Queue[tuple[str, int]] = field(default_factory=asyncio.Queue)
    sent: int = 0  # output tokens already handed to the stream
    cached_tokens: int = 0
    cpu_tokens: int = 0  # of the fetched tokens: those from the instance's local CPU tier
    aborted: bool = False
    finished: bool = False
    # wall seconds of its decode spent in steps waiting on another request's load or a store
    waited_s: float = 0.0


# A step ending this much (wall seconds) after its modelled end counts as late: a tenth of the
# 30 ms TPOT SLO, above the event loop's own timer jitter.
LATE_S = 0.003


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    requests_ok: int = 0
    requests_aborted: int = 0
    # vLLM's inter-token latency histogram, summed: wall seconds after each request's first token, and
    # the tokens they produced (the mean over an interval is the time per output token then)
    itl_sum_s: float = 0.0
    itl_count: int = 0
    steps: int = 0
    # how late engine steps ended in wall time, past their modelled end: a busy event loop (the
    # machine short of CPU) delivers tokens late, which clients measure as slower TTFT / TPOT
    step_lag_sum_s: float = 0.0
    step_lag_max_s: float = 0.0
    steps_late: int = 0  # steps that ended more than LATE_S after their modelled end
    evicted_blocks: int = 0
    # where prompt tokens came from (the engine's own accounting, as LMCache's hit counters)
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    global_hit_tokens: int = 0
    # LMCache's retrieve histogram and retrieved-token counter: each request's load past its GPU
    # hit (local CPU and global tier together, one retrieve), in wall seconds
    retrieves: int = 0
    retrieve_sum_s: float = 0.0
    retrieved_tokens: int = 0
    # where the modelled GPU's time went, in wall seconds (the simulator's busy / stall accounting):
    # every step, the steps that carried prompt chunks, and the waits of steps on loads and stores;
    # with the iterations they ran, these say what a slower time per output token is made of
    busy_s: float = 0.0
    mixed_s: float = 0.0
    stall_s: float = 0.0
    iterations: int = 0
    # the TPOT SLO as the engine sees it: prompt + output tokens of the requests it finished, and of
    # those whose time per output token here (first token to last, in wall time) passed the SLO;
    # beside the client's figure it tells time lost in the engines from time lost on the way out
    finished_tokens: int = 0
    slow_tpot_tokens: int = 0
    # of those, the tokens of requests that would have met the SLO had their decode not waited on
    # loads and stores (the fetches' share of the losses, against the co-batched prefill's)
    slow_tpot_tokens_by_waits: int = 0
    decode_waited_s: float = 0.0  # the finished requests' decodes' waits on transfers, summed


class _Index:
    """What the engine model reports its cache changes to: here, the KV event batch of the step."""

    def __init__(self, core: MockEngineCore) -> None:
        self.core = core

    def gpu_stored_hashes(self, iid: str, hashes: list[int], parent: int | None) -> None:
        self.core._stored(hashes, parent)

    def gpu_removed_hashes(self, iid: str, hashes: Sequence[int]) -> None:  # pragma: no cover - see _removed
        raise AssertionError("the mock engine reports removals block by block")


class _MockInstance(Instance):
    """The simulator's engine with three hooks: removals block by block (as vLLM sends them), and the
    request whose prompt or generated blocks are being stored (their tokens go into ``BlockStored``)."""

    core: MockEngineCore

    def _removed(self, chain: np.ndarray, s: int, e: int) -> None:
        self.core._removed(chain[s:e])

    def _prefill_done(self, r: SimRequest, t: float) -> None:
        with self.core.completing(r):
            super()._prefill_done(r, t)

    def _keep_generated(self, r: SimRequest, t: float) -> None:
        with self.core.completing(r):
            super()._keep_generated(r, t)

    def _fetch_all(self, loads: list[SimRequest], now: float, done: Any) -> None:
        """The loads of one step through the mock's tiers (local CPU, then global), each request
        at its retrieve path's cost; the step waits for all of them (sync load mode)."""
        view = self.sim.gtier
        assert isinstance(view, TierView)
        left = [len(loads)]

        def one(r: SimRequest, t: float) -> None:
            r.load_pending = False
            r.load_s = t - now
            c = self.core.counters
            c.retrieves += 1
            c.retrieve_sum_s += r.load_s / self.core.speed  # model seconds -> wall
            c.retrieved_tokens += r.global_tokens
            self._release_gnode(r, t)
            left[0] -= 1
            if left[0] == 0:
                done(t)

        for r in loads:
            r.session.cpu_tokens = view.fetch_request(r, now, lambda t, r=r: one(r, t))


class MockEngineCore:
    """One engine: the model instance, its clock, its KV event publisher and its live requests."""

    def __init__(
        self,
        instance_id: str,
        profile: Profile,
        *,
        block_size: int = 32,
        num_gpu_blocks: int | None = None,
        max_model_len: int | None = None,
        speed: float = 1.0,
        stream_interval: int = 4,
        hash_algo: str = "sha256_cbor",
        none_hash_seed: str | None = "0",
        publisher: KVEventPublisher | None = None,
        clock: MockClock | None = None,
        tiers: TierView | None = None,
        tpot_slo_s: float = SLO().tpot_s,
    ) -> None:
        """``clock``: the process's model clock (instances sharing ``tiers`` must share it);
        ``tiers``: this instance's local CPU and global tiers (None: a vLLM engine alone);
        ``tpot_slo_s``: the TPOT SLO its own accounting counts against (wall seconds per token)."""
        if speed <= 0:
            raise ValueError("speed must be > 0")
        if hash_algo not in SUPPORTED_ALGOS:
            raise ValueError(f"the mock engine hashes blocks with {SUPPORTED_ALGOS}, not {hash_algo!r}")
        if tpot_slo_s <= 0:
            raise ValueError("the TPOT SLO must be > 0")
        self.tpot_slo_s = tpot_slo_s
        self.instance_id = instance_id
        self.profile = profile
        self.block_size = block_size
        self.speed = speed
        self.hash_algo = hash_algo
        self.none_hash_seed = none_hash_seed
        self.publisher = publisher
        host = SimpleNamespace(
            # the engine's own speed is --speed; the simulator's per-instance slowdown stays off
            cfg=SimpleNamespace(pd=False, decode_run_max=max(1, stream_interval), kv_load_mode="sync",
                                slowdown_cv=0.0, slowdown_period_s=1.0, seed=0),
            index=_Index(self),
            gtier=tiers,
            push_segment=self._push_segment,
            push_call=self._push_call,
            account=self._account,
            account_busy=self._account_busy,
            on_prefill_done=self._on_prefill_done,
            on_finish=self._on_finish,
            generated_blocks=self._generated_blocks,
        )
        self.inst = _MockInstance(host, instance_id, 0, 0, profile, block_size)  # type: ignore[arg-type]
        self.inst.core = self
        # A vLLM engine without LMCache: its prefix cache is its GPU KV, nothing more.
        gpu = num_gpu_blocks if num_gpu_blocks is not None else profile.gpu_capacity_blocks(block_size)
        if gpu < 1:
            raise ValueError(f"{instance_id}: no KV capacity (num_gpu_blocks={gpu})")
        self.inst.gpu_blocks = gpu
        self.inst.cache.capacity = gpu
        self.num_gpu_blocks = gpu
        self.max_model_len = min(max_model_len or profile.max_model_len, gpu * block_size)
        self.counters = EngineCounters()
        self._events: list[dict[str, Any]] = []
        self._completing: SimRequest | None = None
        self._handles: dict[str, Handle] = {}
        self._ids = itertools.count()
        self.clock = clock or MockClock(speed)
        if self.clock.speed != speed:
            raise ValueError("the clock's speed and the engine's differ")
        self.tiers = tiers
        if tiers is not None:
            tiers.shared.after_wake.append(self._flush)

    # ---- clock ----------------------------------------------------------------------------------
    def _now(self) -> float:
        return self.clock.now()

    def _push_segment(self, inst: Instance) -> None:
        self.clock.call_at(inst.seg_end, self._segment_end, inst.seg_end, inst.version)

    def _push_call(self, t: float, fn: Any) -> None:
        self.clock.call_at(t, self._call, fn, t)

    def _call(self, fn: Any, t: float) -> None:
        fn(t)
        self._flush()

    def _segment_end(self, t: float, version: int) -> None:
        if version != self.inst.version:
            return  # superseded by a cut; the model ignores it too
        lag = max(0.0, self._now() - t) / self.speed  # wall seconds
        c = self.counters
        c.step_lag_sum_s += lag
        c.step_lag_max_s = max(c.step_lag_max_s, lag)
        c.steps_late += lag > LATE_S
        self.inst.on_segment_end(t, version)
        c.steps += 1
        for r in self.inst.decoding:
            self._deliver(r)
        self._flush()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, token_ids: Sequence[int], max_tokens: int) -> Handle:
        """Queue a request; its first token, further tokens and end arrive on ``handle.queue``."""
        n = len(token_ids)
        if n == 0:
            raise RequestTooLong("the prompt is empty")
        if max_tokens < 1:
            raise RequestTooLong("max_tokens must be at least 1")
        if n + max_tokens > self.max_model_len:
            raise RequestTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion).")
        digests = chain_digests(token_ids, self.block_size, None, self.none_hash_seed)
        blocks = np.array([event_hash(d) for d in digests], dtype=np.uint64)
        rid = f"{self.instance_id}-{next(self._ids)}"
        now = self._now()
        if self.tiers is not None:
            self.tiers.shared.keys.note_prompt(token_ids, blocks)
        r = SimRequest(rid, 0, None, 0, blocks, n, max_tokens, now)
        h = Handle(rid, list(token_ids), r, blocks, digests[-1] if digests else None)
        r.session = h
        self._handles[rid] = h
        self.inst.enqueue(r, now)
        self._flush()
        return h

    def abort(self, h: Handle) -> None:
        """Stop a request the client gave up on. Queued: dropped. Running: it ends at its next step
        (a prefill in progress completes first; the model has no partial rollback)."""
        if h.finished or h.aborted:
            return
        h.aborted = True
        r = h.sim
        if r in self.inst.waiting:
            self.inst.waiting.remove(r)
            self._handles.pop(h.rid, None)
            h.finished = True
            self.counters.requests_aborted += 1
            return
        r.output = max(1, r.decoded)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``POST /reset_prefix_cache``: forget every cached block, announced by one
        ``AllBlocksCleared``. Like vLLM it refuses (False) while a running request holds blocks;
        waiting requests hold none and simply miss afterwards. vLLM publishes the event with its
        next engine step; the mock publishes it at once (an idle vLLM needs a request to flush it)."""
        inst = self.inst
        if inst.prefilling or inst.decoding or inst.loading or inst.cache.reserved:
            log.warning("%s: prefix cache not reset: %d requests still hold blocks", self.instance_id, self.running)
            return False
        old = inst.cache
        inst.cache = PrefixCache(old.capacity, on_removed=old.on_removed)
        self._events.append(all_blocks_cleared())
        self._flush()
        log.info("%s: prefix cache reset (%d blocks dropped)", self.instance_id, old.used)
        return True

    # ---- model callbacks ------------------------------------------------------------------------
    def _account(self, pos: int, t: float, tokens: int, decoded: int = 0) -> None:
        pass  # throughput is measured by clients; the model's windows are not needed live

    def _account_busy(self, pos: int, t0: float, t1: float) -> None:
        """A step ended (called before the model applies it, so its kind is still set)."""
        c, inst = self.counters, self.inst
        c.busy_s += (t1 - t0) / self.speed
        if inst.seg_kind == SEG_MIXED:
            c.mixed_s += (t1 - t0) / self.speed
            c.iterations += 1
        elif inst.seg_cum is not None:  # a decode run, as far as it ran (a cut shortens it first)
            c.iterations += len(inst.seg_cum)
        waited = inst.stall_time / self.speed - c.stall_s  # this step's waits on transfers
        if waited > 0:
            for r in inst.decoding:  # the batch's decodes sat through them
                r.session.waited_s += waited
        c.stall_s = inst.stall_time / self.speed

    def _generated_blocks(self, r: SimRequest) -> np.ndarray:
        """vLLM keeps the full blocks of prompt + generated tokens: the chain continued over the
        tokens this engine generated (``output_text``'s bytes)."""
        h: Handle = r.session
        bs = self.block_size
        h.tokens += [97 + j % 26 for j in range(min(r.decoded, r.output))]
        start = len(h.chain) * bs
        more = chain_digests(h.tokens[start:], bs, h.last_digest, self.none_hash_seed)
        if more:
            ext = np.array([event_hash(d) for d in more], dtype=np.uint64)
            h.chain = np.concatenate([h.chain, ext])
            h.last_digest = more[-1]
        return h.chain

    @contextlib.contextmanager
    def completing(self, r: SimRequest) -> Iterator[None]:
        """Blocks the engine model stores meanwhile belong to ``r`` (its prompt or its output)."""
        self._completing = r
        try:
            yield
        finally:
            self._completing = None

    def _stored(self, hashes: list[int], parent: int | None) -> None:
        r = self._completing
        assert r is not None, "blocks stored outside a prefill or a completion"
        h: Handle = r.session
        bs = self.block_size
        first = 0 if parent is None else int(np.flatnonzero(h.chain == np.uint64(parent))[0]) + 1
        toks = h.tokens[first * bs : (first + len(hashes)) * bs]
        self._events.append(block_stored(hashes, parent, toks, bs))

    def _removed(self, hashes: np.ndarray) -> None:
        self.counters.evicted_blocks += len(hashes)
        # vLLM's free queue gives up a run's blocks tail first, one event each.
        for x in reversed(hashes.tolist()):
            self._events.append(block_removed(int(x)))

    def _on_prefill_done(self, r: SimRequest, t: float) -> None:
        h: Handle = r.session
        bs = self.block_size
        # vLLM never serves the last prompt token from cache and hits whole blocks only.
        h.cached_tokens = min(r.local_blocks, (r.input - 1) // bs) * bs
        c = self.counters
        c.prompt_tokens += r.input
        c.prefix_queries += r.input
        c.prefix_hits += h.cached_tokens
        # vLLM's usage counts what a KV connector loaded as cached too (num_cached_tokens)
        h.cached_tokens += r.global_tokens
        c.gpu_hit_tokens += r.local_tokens
        cpu = min(h.cpu_tokens, r.global_tokens)
        c.cpu_hit_tokens += cpu
        c.global_hit_tokens += r.global_tokens - cpu
        if not h.aborted:
            h.queue.put_nowait(("first", h.cached_tokens))
        self._deliver(r)

    def _on_finish(self, r: SimRequest, t: float) -> None:
        h: Handle = r.session
        self._deliver(r)
        h.finished = True
        self._handles.pop(h.rid, None)
        if h.aborted:
            self.counters.requests_aborted += 1
        else:
            c = self.counters
            c.requests_ok += 1
            c.finished_tokens += r.input + r.output
            c.decode_waited_s += h.waited_s
            if r.output > 1 and t > r.first_token:
                wall = (t - r.first_token) / self.speed  # model seconds -> wall
                c.itl_sum_s += wall
                c.itl_count += r.output - 1
                if wall / (r.output - 1) > self.tpot_slo_s:
                    c.slow_tpot_tokens += r.input + r.output
                    if (wall - h.waited_s) / (r.output - 1) <= self.tpot_slo_s:
                        c.slow_tpot_tokens_by_waits += r.input + r.output
            h.queue.put_nowait(("end", h.sent))

    def _deliver(self, r: SimRequest) -> None:
        h: Handle = r.session
        k = min(r.decoded, r.output) - h.sent
        if k > 0:
            h.sent += k
            self.counters.generation_tokens += k
            if not h.aborted:
                h.queue.put_nowait(("tokens", k))

    def _flush(self) -> None:
        if self._events and self.publisher is not None:
            self.publisher.publish(self._events)
        self._events = []

    # ---- introspection ------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return self.inst.n_running

    @property
    def waiting(self) -> int:
        return len(self.inst.waiting)

    @property
    def kv_usage(self) -> float:
        return self.inst.running_blocks / self.num_gpu_blocks

    def cached_block_hashes(self) -> set[int]:
        """Every block hash the prefix cache holds (what its KV events should have announced)."""
        out: set[int] = set()
        for node in self.inst.cache.nodes():
            out.update(int(x) for x in node.chain[node.s : node.e])
        return out
