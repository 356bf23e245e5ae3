"""One simulated vLLM instance: continuous batching with a chunked-prefill token budget.

The engine advances in *segments*: one mixed iteration while any prompt is being prefilled, or a run
of pure-decode iterations up to the next completion. A decode run's iteration times come in closed
form from the profile (contexts grow by one token per decoder per iteration), so thousands of decode
steps cost one numpy call. A request that arrives during a run cuts it at the next iteration
boundary, where the scheduler would have seen it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from smetric_lmc.sim.cache import Node, PrefixCache
from smetric_lmc.sim.profile import Profile

if TYPE_CHECKING:
    from smetric_lmc.sim.cluster import Simulator

_MIXED = 1
_DECODE = 2


class SimRequest:
    """Runtime state of one request in the simulator."""

    __slots__ = (
        "rid", "idx", "session", "turn", "blocks", "n_blocks", "input", "output", "arrival",
        "inst", "reason", "fetch_from", "fetch_to", "local_blocks", "global_blocks",
        "local_tokens", "global_tokens", "todo", "ctx", "node", "reserved", "admit_hit",
        "decoded", "first_token", "finish", "prefill_done_at", "gpu_total", "sticky",
    )  # fmt: skip

    def __init__(
        self, rid: str, idx: int, session: Any, turn: int, blocks: np.ndarray, input_tokens: int,
        output_tokens: int, arrival: float,
    ) -> None:  # fmt: skip
        self.rid = rid
        self.idx = idx
        self.session = session
        self.turn = turn
        self.blocks = blocks
        self.n_blocks = len(blocks)
        self.input = max(1, input_tokens)
        self.output = max(1, output_tokens)
        self.arrival = arrival
        self.inst: Instance | None = None
        self.reason = ""
        self.fetch_from = 0  # blocks [fetch_from, fetch_to) were fetched from the global tier
        self.fetch_to = 0
        self.local_blocks = 0
        self.global_blocks = 0
        self.local_tokens = 0
        self.global_tokens = 0
        self.todo = 0  # prompt tokens still to compute
        self.ctx = 0  # tokens with KV on the instance
        self.node: Node | None = None  # deepest pinned cache node
        self.reserved = 0
        self.admit_hit = 0
        self.decoded = 0
        self.first_token = math.nan
        self.finish = math.nan
        self.prefill_done_at = math.nan
        self.gpu_total = 0
        self.sticky = -1  # follow-ups: 1 when served by the session's first-turn instance


class Instance:
    def __init__(self, sim: Simulator, iid: str, pos: int, node: int, profile: Profile, block_size: int) -> None:
        self.sim = sim
        self.iid = iid
        self.pos = pos
        self.node = node
        self.profile = profile
        self.bs = block_size
        self.pd = sim.cfg.pd
        self.cache = PrefixCache(profile.local_capacity_blocks(block_size), on_removed=self._removed)
        self.waiting: deque[SimRequest] = deque()
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
        self.busy_time = 0.0
        self.iterations = 0

    def _removed(self, chain: np.ndarray, s: int, e: int) -> None:
        # One id suffices: the index drops the instance's descendants of a removed block.
        self.sim.index.gpu_removed_hashes(self.iid, (int(chain[s]),))

    # ---- arrivals ------------------------------------------------------------------------------
    def enqueue(self, r: SimRequest, now: float) -> None:
        self.waiting.append(r)
        if not self.busy:
            self._plan(now)
        elif self.seg_kind == _DECODE and self.seg_cum is not None:
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
        max_seqs = self.profile.max_num_seqs
        bs = self.bs
        while self.waiting and len(self.prefilling) + len(self.decoding) < max_seqs:
            r = self.waiting[0]
            node, h = cache.match_exact(r.blocks)
            cache.pin(node, now)
            total = -(-(r.input + (0 if self.pd else r.output)) // bs)
            need = total - h
            if self.running_blocks + total > self.gpu_blocks or not cache.reserve(need):
                cache.unpin(node, now)
                break
            self.waiting.popleft()
            # The fetched range is usable only if it continues what the instance still holds.
            g = 0
            if r.fetch_to > h >= r.fetch_from:
                g = r.fetch_to - h
            hit_tokens = min((h + g) * bs, r.input - 1)  # the engine always computes the last token
            r.local_blocks, r.global_blocks = h, g
            r.local_tokens = min(h * bs, hit_tokens)
            r.global_tokens = hit_tokens - r.local_tokens
            r.todo = r.input - hit_tokens
            r.ctx = hit_tokens
            r.node = node
            r.reserved = need
            r.admit_hit = h
            self.running_blocks += total
            r.gpu_total = total
            self.prefilling.append(r)

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
            dt = prof.iteration_time([(n, r.ctx) for r, n in chunks], n_dec, self.dec_ctx)
            self.seg_kind = _MIXED
            self.seg_chunks = chunks
            self.seg_cum = None
        elif n_dec:
            k = min(r.output - r.decoded for r in self.decoding)
            k = max(1, min(k, self.sim.cfg.decode_run_max))
            cum = prof.decode_run_times(n_dec, self.dec_ctx, k)
            dt = float(cum[-1])
            self.seg_kind = _DECODE
            self.seg_cum = cum
        else:
            self.busy = False
            self.seg_kind = 0
            if self.waiting:
                # Idle with nothing pinned: the head request must fit; if not, the model is broken.
                raise RuntimeError(f"{self.iid}: idle but cannot admit request {self.waiting[0].rid}")
            return
        self.busy = True
        self.seg_start = now
        self.seg_end = now + dt
        self.version += 1
        self.sim.push_segment(self)

    def on_segment_end(self, t: float, version: int) -> None:
        if version != self.version or not self.busy:
            return  # superseded by a cut
        self.busy_time += t - self.seg_start
        if self.seg_kind == _MIXED:
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
        self.sim.account(self.pos, t, k * n_dec)
        still: list[SimRequest] = []
        for r in self.decoding:
            r.decoded += k
            if r.decoded >= r.output:
                self.dec_ctx -= r.input + r.decoded
                self._finish(r, t)
            else:
                still.append(r)
        self.decoding = still
        self.seg_cum = None

    def _apply_mixed(self, t: float) -> None:
        self.iterations += 1
        n_dec = len(self.decoding)
        tokens = n_dec
        still: list[SimRequest] = []
        self.dec_ctx += n_dec
        for r in self.decoding:
            r.decoded += 1
            if r.decoded >= r.output:
                self.dec_ctx -= r.input + r.decoded
                self._finish(r, t)
            else:
                still.append(r)
        self.decoding = still
        finished_prefill: list[SimRequest] = []
        for r, n in self.seg_chunks:
            r.todo -= n
            r.ctx += n
            tokens += n
            if r.todo == 0:
                finished_prefill.append(r)
        self.sim.account(self.pos, t, tokens)
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
        if r.node is not None:
            self.cache.unpin(r.node, t)
            r.node = None
        self.cache.release(r.reserved)
        r.reserved = 0
        self.running_blocks -= r.gpu_total
        r.finish = t
        self.sim.on_finish(r, t)

    # ---- introspection -----------------------------------------------------------------------
    @property
    def n_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)
