"""One simulated vLLM instance: continuous batching with a chunked-prefill token budget.

The engine advances in *segments*: one mixed iteration while any prompt is being prefilled, or a run
of pure-decode iterations up to the next completion. A decode run's iteration times come in closed
form from the profile (contexts grow by one token per decoder per iteration), so thousands of decode
steps cost one numpy call. A request that arrives during a run cuts it at the next iteration
boundary, where the scheduler would have seen it.

KV from the global tier is loaded as the configured ``kv_load_mode`` says (DESIGN §4):
``sync`` (vLLM's ``LMCacheConnectorV1``: the step that first schedules the request waits for the
load, so the whole batch waits), ``layerwise`` (LMCache ``use_layerwise``: load overlapped with
compute layer by layer) or ``async`` (only the fetching request waits, outside the batch). The
prompt blocks a step computes are stored to the global tier at the end of that step, the
device→host copy on the step (``wait_for_save``); decode KV is not stored (LMCache's default).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from smetric_lmc.lab.sim.cache import PrefixCache
from smetric_lmc.lab.sim.global_tier import GlobalTier, Put
from smetric_lmc.lab.sim.profile import Profile
from smetric_lmc.lab.sim.request import SimRequest
from smetric_lmc.lab.sim.slowdown import Slowdown

# What the step in progress is (``Instance.seg_kind``): prompt chunks with the batch's decodes, or
# a run of pure-decode iterations.
SEG_MIXED = 1
SEG_DECODE = 2


class EngineHost(Protocol):
    """What an instance needs from the cluster around it."""

    cfg: Any
    index: Any
    gtier: GlobalTier | None

    def push_segment(self, inst: Instance) -> None: ...
    def push_call(self, t: float, fn: Callable[[float], None]) -> None: ...
    def account(self, pos: int, t: float, tokens: int, decoded: int = 0) -> None: ...
    def account_busy(self, pos: int, t0: float, t1: float) -> None: ...
    def on_prefill_done(self, r: SimRequest, t: float) -> None: ...
    def on_finish(self, r: SimRequest, t: float) -> None: ...
    def generated_blocks(self, r: SimRequest) -> np.ndarray | None: ...


class Instance:
    def __init__(self, host: EngineHost, iid: str, pos: int, node: int, profile: Profile, block_size: int) -> None:
        self.sim = host
        self.iid = iid
        self.pos = pos
        self.node = node
        self.profile = profile
        self.bs = block_size
        self.pd = host.cfg.pd
        self.load_mode: str = host.cfg.kv_load_mode
        self.cache = PrefixCache(profile.local_capacity_blocks(block_size), on_removed=self._removed)
        self.waiting: deque[SimRequest] = deque()
        self.loading: list[SimRequest] = []  # async load mode: admitted, waiting for their KV
        self.prefilling: list[SimRequest] = []
        self.decoding: list[SimRequest] = []
        self.dec_ctx = 0  # sum of decoders' contexts
        # Running requests must fit in GPU memory even when the local tier extends to host memory.
        self.gpu_blocks = profile.gpu_capacity_blocks(block_size)
        self.running_blocks = 0
        self.busy = False
        self.version = 0
        self.seg_kind = 0
        self.seg_start = 0.0
        self.seg_end = 0.0
        self.seg_cum: np.ndarray | None = None
        self.seg_chunks: list[tuple[SimRequest, int]] = []
        self.busy_time = 0.0  # a step in progress, load and store waits included
        self.stall_time = 0.0  # of which: the step waiting for a sync load or a store
        self.iterations = 0
        # a step that waits on transfers: its end, and the transfers it still waits for
        self._step_end = 0.0
        self._step_dt = 0.0
        self._step_waits = 0
        self._pending_loads = 0
        self.slowdown = Slowdown(host.cfg.slowdown_cv, host.cfg.slowdown_period_s, host.cfg.seed, pos)

    def _removed(self, chain: np.ndarray, s: int, e: int) -> None:
        # One id suffices: the index drops the instance's descendants of a removed block.
        self.sim.index.gpu_removed_hashes(self.iid, (int(chain[s]),))

    # ---- arrivals ------------------------------------------------------------------------------
    def enqueue(self, r: SimRequest, now: float) -> None:
        self.waiting.append(r)
        if not self.busy:
            self._plan(now)
        elif self.seg_kind == SEG_DECODE and self.seg_cum is not None:
            self._cut(now)

    def _cut(self, now: float) -> None:
        """Stop the current decode run at the first iteration boundary after ``now``."""
        cum = self.seg_cum
        assert cum is not None
        done = int(np.searchsorted(cum, now - self.seg_start, side="right"))
        if done + 1 >= len(cum):
            return
        self.seg_cum = cum[: done + 1]
        self.seg_end = self.seg_start + float(self.seg_cum[-1])
        self.version += 1
        self.sim.push_segment(self)

    # ---- scheduling ----------------------------------------------------------------------------
    def _admit(self, now: float) -> None:
        cache = self.cache
        gt = self.sim.gtier
        max_seqs = self.profile.max_num_seqs
        bs = self.bs
        while self.waiting and len(self.prefilling) + len(self.decoding) + len(self.loading) < max_seqs:
            r = self.waiting[0]
            node, h = cache.match_exact(r.blocks)
            cache.pin(node, now)
            total = -(-(r.input + (0 if self.pd else r.output)) // bs)
            need = total - h
            if self.running_blocks + total > self.gpu_blocks or not cache.reserve(need):
                cache.unpin(node, now)
                break
            self.waiting.popleft()
            # What the global tier holds now, not what it held at routing: a prefix evicted here
            # since routing is loaded again from there (LMCache looks up at scheduling time).
            g_held, gnode = gt.lookup_pin(r.blocks, h, now) if gt is not None else (0, None)
            g = max(g_held, h)
            hit_tokens = min(g * bs, r.input - 1)  # the engine always computes the last token
            r.local_blocks, r.global_blocks = h, g - h
            r.local_tokens = min(h * bs, hit_tokens)
            r.global_tokens = hit_tokens - r.local_tokens
            r.todo = r.input - hit_tokens
            r.ctx = hit_tokens
            r.node = node
            r.reserved = need
            r.admit_hit = h
            r.saved = g_held  # LMCache stores from the end of its own hit
            self.running_blocks += total
            r.gpu_total = total
            if gnode is not None and r.global_tokens > 0:
                r.gnode = gnode
                if self.load_mode == "async":
                    self.loading.append(r)
                    assert gt is not None
                    gt.fetch(self.pos, self.node, r.blocks[h:g], now, lambda t, r=r, t0=now: self._loaded(r, t0, t))
                    continue
                r.load_pending = True
            elif gnode is not None:
                assert gt is not None
                gt.unpin(gnode, now)
            self.prefilling.append(r)

    def _loaded(self, r: SimRequest, t0: float, t: float) -> None:
        """Async mode: the request's KV arrived; it joins the batch."""
        r.load_s = t - t0
        self._release_gnode(r, t)
        self.loading.remove(r)
        self.prefilling.append(r)
        if not self.busy:
            self._plan(t)
        elif self.seg_kind == SEG_DECODE and self.seg_cum is not None:
            self._cut(t)

    def _release_gnode(self, r: SimRequest, t: float) -> None:
        if r.gnode is not None:
            gt = self.sim.gtier
            assert gt is not None
            gt.unpin(r.gnode, t)
            r.gnode = None

    def _plan(self, now: float) -> None:
        self._admit(now)
        prof = self.profile
        n_dec = len(self.decoding)
        if self.prefilling:
            budget = prof.max_num_batched_tokens - n_dec
            chunks: list[tuple[SimRequest, int]] = []
            for r in self.prefilling:
                if budget <= 0:
                    break
                n = min(r.todo, budget)
                chunks.append((r, n))
                budget -= n
            dt = prof.iteration_time([(n, r.ctx) for r, n in chunks], n_dec, self.dec_ctx) * self.slowdown.factor(now)
            self.seg_kind = SEG_MIXED
            self.seg_chunks = chunks
            self.seg_cum = None
            if self.sim.gtier is not None:
                self._start_step(now, dt, chunks)
                return
        elif n_dec:
            k = min(r.output - r.decoded for r in self.decoding)
            k = max(1, min(k, self.sim.cfg.decode_run_max))
            cum = prof.decode_run_times(n_dec, self.dec_ctx, k) * self.slowdown.factor(now)
            dt = float(cum[-1])
            self.seg_kind = SEG_DECODE
            self.seg_cum = cum
        else:
            self.busy = False
            self.seg_kind = 0
            if self.waiting and not self.loading:
                # Idle with nothing pinned: the head request must fit; if not, the model is broken.
                raise RuntimeError(f"{self.iid}: idle but cannot admit request {self.waiting[0].rid}")
            return
        self.busy = True
        self.seg_start = now
        self.seg_end = now + dt
        self.version += 1
        self.sim.push_segment(self)

    # ---- a mixed step with transfers -----------------------------------------------------------
    def _start_step(self, now: float, dt: float, chunks: list[tuple[SimRequest, int]]) -> None:
        """A mixed step when a global tier exists: loads of requests it schedules for the first time
        (sync / layerwise), then compute, then the store of the prompt blocks it completes."""
        gt = self.sim.gtier
        assert gt is not None
        self.busy = True
        self.seg_start = now
        self._step_dt = dt
        self.version += 1
        loads = [r for r, _ in chunks if r.load_pending]
        stores: list[Put] = []
        bs = self.bs
        for r, n in chunks:
            # LMCache saves whole chunks only (save_unfull_chunk: false)
            full = gt.chunk_floor(min((r.ctx + n) // bs, r.n_blocks))
            if full > r.saved:
                p = max(r.saved, gt.plan_store(r.blocks, full))
                if full > p:
                    stores.append((r.blocks, p, full))
                r.saved = full
        if not loads and not stores:
            self._end_at(now + dt)
            return
        if self.load_mode == "layerwise":
            # Each layer's load precedes its compute and each layer's store follows it: the step
            # ends one layer's compute after the slower of the transfers, or when compute ends.
            layer = dt / self.profile.layers
            self._step_end = now + dt
            self._step_waits = (1 if loads else 0) + (1 if stores else 0)
            if loads:
                self._fetch_all(loads, now, lambda t: self._wait_done(t + layer))
            if stores:
                gt.copy_out(self.pos, self.node, stores, now, lambda t: self._wait_done(t + layer))
            return

        def computed(t: float) -> None:
            if stores:
                gt.copy_out(self.pos, self.node, stores, t, lambda ts: self._stalled_end(ts - t, ts))
            else:
                self._end_at(t)

        def after_load(t: float) -> None:
            self.stall_time += t - now
            self.sim.push_call(t + dt, computed)

        if loads:
            self._fetch_all(loads, now, after_load)
        else:
            after_load(now)

    def _fetch_all(self, loads: list[SimRequest], now: float, done: Callable[[float], None]) -> None:
        gt = self.sim.gtier
        assert gt is not None
        self._pending_loads = len(loads)

        def one(r: SimRequest, t: float) -> None:
            r.load_pending = False
            r.load_s = t - now
            self._release_gnode(r, t)
            self._pending_loads -= 1
            if self._pending_loads == 0:
                done(t)

        for r in loads:
            gt.fetch(self.pos, self.node, r.blocks[r.local_blocks : r.local_blocks + r.global_blocks], now,
                     lambda t, r=r: one(r, t))  # fmt: skip

    def _wait_done(self, t_end: float) -> None:
        self._step_end = max(self._step_end, t_end)
        self._step_waits -= 1
        if self._step_waits == 0:
            self.stall_time += max(0.0, self._step_end - self.seg_start - self._step_dt)
            self._end_at(self._step_end)

    def _stalled_end(self, stall: float, t: float) -> None:
        self.stall_time += stall
        self._end_at(t)

    def _end_at(self, t: float) -> None:
        self.seg_end = t
        self.sim.push_segment(self)

    def on_segment_end(self, t: float, version: int) -> None:
        if version != self.version or not self.busy:
            return  # superseded by a cut
        self.busy_time += t - self.seg_start
        self.sim.account_busy(self.pos, self.seg_start, t)
        if self.seg_kind == SEG_MIXED:
            self._apply_mixed(t)
        else:
            self._apply_decode(t)
        self._plan(t)

    def _apply_decode(self, t: float) -> None:
        assert self.seg_cum is not None
        k = len(self.seg_cum)
        self.iterations += k
        n_dec = len(self.decoding)
        self.dec_ctx += k * n_dec
        self.sim.account(self.pos, t, k * n_dec, decoded=k * n_dec)
        self._decode_steps(k, t)
        self.seg_cum = None

    def _decode_steps(self, k: int, t: float) -> None:
        """Every decoding request emits k tokens; those that reach their output length finish."""
        still: list[SimRequest] = []
        for r in self.decoding:
            r.decoded += k
            if r.decoded >= r.output:
                self.dec_ctx -= r.input + r.decoded
                self._finish(r, t)
            else:
                still.append(r)
        self.decoding = still

    def _apply_mixed(self, t: float) -> None:
        self.iterations += 1
        n_dec = len(self.decoding)
        tokens = n_dec
        self.dec_ctx += n_dec
        self._decode_steps(1, t)
        finished_prefill: list[SimRequest] = []
        for r, n in self.seg_chunks:
            r.todo -= n
            r.ctx += n
            tokens += n
            if r.todo == 0:
                finished_prefill.append(r)
        self.sim.account(self.pos, t, tokens, decoded=n_dec)
        if finished_prefill:
            done = set(map(id, finished_prefill))
            self.prefilling = [r for r in self.prefilling if id(r) not in done]
            for r in finished_prefill:
                self._prefill_done(r, t)
        self.seg_chunks = []

    def _prefill_done(self, r: SimRequest, t: float) -> None:
        cache = self.cache
        n = r.n_blocks
        node, p = cache.insert(r.blocks, n, t)
        if p < n:
            parent = int(r.blocks[p - 1]) if p else None
            self.sim.index.gpu_stored_hashes(self.iid, r.blocks[p:n].tolist(), parent)
        # The prompt's blocks moved from the reservation into the tree.
        moved = n - r.admit_hit
        cache.release(moved)
        r.reserved -= moved
        cache.pin(node, t)
        assert r.node is not None
        cache.unpin(r.node, t)
        r.node = node
        r.first_token = t
        r.prefill_done_at = t
        r.decoded = 1
        self.sim.on_prefill_done(r, t)
        if self.pd or r.output <= 1:
            self._finish(r, t)
        else:
            self.decoding.append(r)
            self.dec_ctx += r.input + 1

    def _finish(self, r: SimRequest, t: float) -> None:
        cache = self.cache
        cache.release(r.reserved)
        r.reserved = 0
        if not self.pd:
            self._keep_generated(r, t)
        if r.node is not None:
            cache.unpin(r.node, t)
            r.node = None
        self.running_blocks -= r.gpu_total
        r.finish = t
        self.sim.on_finish(r, t)

    def _keep_generated(self, r: SimRequest, t: float) -> None:
        """vLLM's prefix cache keeps the full blocks of generated tokens (their hashes chain on the
        prompt's), so a follow-up that resends this answer hits them. Their ids are the next
        prompt's, when that prompt continues this one; they go to the GPU tier only (LMCache does
        not save decode KV by default)."""
        ext = self.sim.generated_blocks(r)
        if ext is None:
            return
        cache = self.cache
        end = min(len(ext), (r.input + r.output) // self.bs)
        if end <= r.n_blocks:
            return
        node, p = cache.insert(ext, end, t)
        if p < end:
            parent = int(ext[p - 1]) if p else None
            self.sim.index.gpu_stored_hashes(self.iid, ext[p:end].tolist(), parent)

    # ---- introspection -----------------------------------------------------------------------
    @property
    def n_running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + len(self.loading)
