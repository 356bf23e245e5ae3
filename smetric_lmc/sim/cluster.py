"""The discrete-event cluster simulator: arrivals, routing, global tier, engines, metrics.

Routing goes through the project's own ``Router`` (index lookup -> policy -> load accounting), fed
by the events the simulated engines emit: ``gpu_stored_hashes`` when a prompt's blocks are
computed, ``gpu_removed_hashes`` when the engine evicts them, ``global_stored``/``global_removed``
for the global tier. The workload's block ids serve as both the GPU-space hashes and the global
tier's chunk hashes (index block size = chunk size = the workload's block size).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from smetric_lmc.config import PolicyConfig
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router
from smetric_lmc.sim.cache import PrefixCache
from smetric_lmc.sim.config import SimConfig, global_capacity_factor
from smetric_lmc.sim.engine import Instance, SimRequest
from smetric_lmc.sim.metrics import Recorder, SimResult, summarize
from smetric_lmc.sim.profile import Profile, load_profile
from smetric_lmc.workload.model import TraceSession, Workload

log = logging.getLogger(__name__)

_ARRIVE = 0
_READY = 1
_SEGMENT = 2


def chained_lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Common prefix length of two prefix-chained id arrays (equality is monotone: bisection)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[n - 1] == b[n - 1]:
        return n
    lo, hi = 0, n - 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if a[mid] == b[mid]:
            lo = mid
        else:
            hi = mid
    return hi


class _Session:
    __slots__ = ("trace", "idx", "start", "first_inst", "prev_blocks")

    def __init__(self, trace: TraceSession, idx: int, start: float) -> None:
        self.trace = trace
        self.idx = idx
        self.start = start
        self.first_inst = -1  # instance of the session's latest first-turn request
        self.prev_blocks: np.ndarray | None = None


@dataclass(slots=True)
class _Link:
    free_at: float = 0.0
    busy_s: float = 0.0
    bytes: float = 0.0


@dataclass(slots=True)
class Placement:
    """Root session starts, and for every parent the sub-agents it spawns: (parent request index
    after whose completion the child starts, child, recorded offset from the parent's start)."""

    roots: list[tuple[TraceSession, float]]
    children: dict[str, list[tuple[int, TraceSession, float]]]


def place_sessions(workload: Workload, rate: float, seed: int, max_sessions: int | None) -> Placement:
    """Root sessions start as a Poisson process, in a seeded random order. A sub-agent starts when
    the parent request that was in progress at its recorded start completes (the tool call that
    spawned it), so it keeps its place in the parent's timeline however fast the replay runs."""
    rng = np.random.default_rng(seed)
    roots_of = workload.root_of()
    roots = [s for s in workload.sessions if roots_of[s.session_id] == s.session_id]
    order = rng.permutation(len(roots))
    if max_sessions is not None:
        order = order[:max_sessions]
    starts = np.cumsum(rng.exponential(1.0 / rate, size=len(order)))
    placed = [(roots[int(k)], float(t)) for k, t in zip(order, starts)]
    chosen = {s.session_id for s, _ in placed}
    rel = workload.absolute_start()
    by_id = {s.session_id: s for s in workload.sessions}
    children: dict[str, list[tuple[int, TraceSession, float]]] = {}
    for s in workload.sessions:
        pid = s.parent_id
        if pid is None or pid not in by_id or roots_of[s.session_id] not in chosen:
            continue
        parent = by_id[pid]
        offset = rel[s.session_id] - rel[pid]
        arrivals = [r.arrival for r in parent.requests]
        j = max(0, int(np.searchsorted(arrivals, offset, side="right")) - 1) if arrivals else 0
        children.setdefault(pid, []).append((j, s, offset))
    return Placement(placed, children)


class Simulator:
    def __init__(
        self,
        workload: Workload,
        cfg: SimConfig,
        policy: PolicyConfig,
        profile: Profile | None = None,
    ) -> None:
        self.workload = workload
        self.cfg = cfg
        self.policy = policy
        self.profile = profile or load_profile(cfg.profile)
        self.bs = workload.block_size
        self.now = 0.0
        self.index = TierIndex(self.bs, self.bs)
        self.load = LoadTracker(clock=lambda: self.now)
        self.router = Router(self.index, self.load, policy, disaggregated=cfg.pd)
        prof = self.profile
        self.instances: list[Instance] = []
        self.by_id: dict[str, Instance] = {}
        per_node = prof.instances_per_node
        for k in range(cfg.instances):
            iid = f"i{k:03d}"
            self.index.register_instance(iid)
            self.load.add_instance(iid)
            inst = Instance(self, iid, k, k // per_node, prof, self.bs)
            self.instances.append(inst)
            self.by_id[iid] = inst
        self.links = [_Link() for _ in range(math.ceil(cfg.instances / per_node))]
        factor = global_capacity_factor(cfg.global_tier)
        self.gcache: PrefixCache | None = None
        if factor is not None:
            cap = factor * prof.local_capacity_blocks(self.bs) * cfg.instances
            self.gcache = PrefixCache(cap, on_removed=self._global_removed)
        self.max_context = prof.max_context(self.bs)
        self.rec = Recorder()
        self.win_tokens: list[np.ndarray] = []
        # the policy's load (in flight / unprefilled tokens) per instance, sampled at every routing
        # decision and summed per window: what the paper's max/mean load compares
        self.win_load: list[np.ndarray] = []
        self.win_samples: list[int] = []
        self._ids = [i.iid for i in self.instances]
        self._heap: list[tuple[float, int, int, object, object]] = []
        self._seq = itertools.count()
        self.events = 0
        self._n_sessions = 0
        self._children: dict[tuple[str, int], list[TraceSession]] = {}
        self.first_root_start = 0.0
        self.last_root_start = 0.0

    # ---- event plumbing ------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj: object, extra: object = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj, extra))

    def push_segment(self, inst: Instance) -> None:
        self._push(inst.seg_end, _SEGMENT, inst, inst.version)

    def account(self, pos: int, t: float, tokens: int) -> None:
        w = int(t // self.cfg.window_s)
        wt = self.win_tokens
        while len(wt) <= w:
            wt.append(np.zeros(len(self.instances), dtype=np.int64))
        wt[w][pos] += tokens

    def _sample_load(self, t: float) -> None:
        w = int(t // self.cfg.window_s)
        wl, ws = self.win_load, self.win_samples
        while len(wl) <= w:
            wl.append(np.zeros(len(self.instances)))
            ws.append(0)
        wl[w] += self.load.loads(self._ids, self.cfg.pd)
        ws[w] += 1

    def _global_removed(self, chain: np.ndarray, s: int, e: int) -> None:
        self.index.global_removed(chain[s:e].tolist())

    # ---- run -----------------------------------------------------------------------------------
    def run(self, progress: Callable[[int], None] | None = None) -> SimResult:
        # The run allocates millions of short-lived index/cache nodes; the cyclic collector would
        # rescan every live object (the whole workload) again and again. Refcounting frees them.
        was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            return self._run(progress)
        finally:
            gc.unfreeze()
            if was_enabled:
                gc.enable()

    def _run(self, progress: Callable[[int], None] | None) -> SimResult:
        pl = place_sessions(self.workload, self.cfg.rate, self.cfg.seed, self.cfg.max_sessions)
        self._children = {}
        for pid, kids in pl.children.items():
            for j, child, _ in kids:
                self._children.setdefault((pid, j), []).append(child)
        self.last_root_start = max((t for _, t in pl.roots), default=0.0)
        self.first_root_start = min((t for _, t in pl.roots), default=0.0)
        for s, start in pl.roots:
            self._start_session(s, start)
        if self.cfg.arrival == "open":
            # Recorded timeline: every sub-agent at its recorded offset from its root's start.
            root_start = {s.session_id: t for s, t in pl.roots}
            roots_of = self.workload.root_of()
            rel = self.workload.absolute_start()
            for kids in pl.children.values():
                for _, child, _ in kids:
                    root = roots_of[child.session_id]
                    self._start_session(child, root_start[root] + max(0.0, rel[child.session_id] - rel[root]))
        heap = self._heap
        pop = heapq.heappop
        n = 0
        while heap:
            t, _, kind, obj, extra = pop(heap)
            self.now = t
            n += 1
            if kind == _SEGMENT:
                obj.on_segment_end(t, extra)  # type: ignore[attr-defined]
            elif kind == _ARRIVE:
                self._arrive(obj, extra, t)  # type: ignore[arg-type]
                if progress is not None:
                    progress(1)
            else:
                r: SimRequest = obj  # type: ignore[assignment]
                assert r.inst is not None
                r.inst.enqueue(r, t)
        self.events = n
        leftover = sum(i.n_running + len(i.waiting) for i in self.instances)
        if leftover:
            log.warning("%d requests never finished", leftover)
        return summarize(self)

    # ---- requests ------------------------------------------------------------------------------
    def _start_session(self, trace: TraceSession, start: float) -> None:
        if not trace.requests:
            return
        sess = _Session(trace, self._n_sessions, start)
        self._n_sessions += 1
        first = start + (trace.requests[0].arrival if self.cfg.arrival == "open" else 0.0)
        self._push(first, _ARRIVE, sess, 0)

    def _arrive(self, sess: _Session, k: int, t: float) -> None:
        trace = sess.trace
        tr = trace.requests[k]
        if self.cfg.arrival == "open" and k + 1 < len(trace.requests):
            nxt = sess.start + trace.requests[k + 1].arrival
            self._push(max(t, nxt), _ARRIVE, sess, k + 1)
        rid = f"{sess.idx}:{k}"
        r = SimRequest(rid, k, sess, tr.turn, tr.block_ids, tr.input_tokens, tr.output_tokens, t)
        need = r.input if self.cfg.pd else r.input + r.output
        if need > self.max_context:
            r.reason = "rejected"
            r.finish = t
            self.rec.add(r, -1, rejected=True)
            self._next(sess, k, t)
            return
        blist = r.blocks.tolist()
        est = 0
        if tr.turn > 0 and sess.prev_blocks is not None:
            est = chained_lcp(sess.prev_blocks, r.blocks) * self.bs
        sess.prev_blocks = r.blocks
        routed = self.router.route(
            rid, blist, blist if self.gcache is not None else None, r.input, turn=tr.turn, est_hit=est
        )
        if routed.instance_id is None:
            raise RuntimeError("no instance to route to")
        inst = self.by_id[routed.instance_id]
        r.inst = inst
        self._sample_load(t)
        r.reason = routed.reason.value
        if tr.turn == 0:
            sess.first_inst = inst.pos
        if tr.turn > 0:
            r.sticky = int(inst.pos == sess.first_inst)
        ready = t
        if self.gcache is not None:
            h = routed.local_hit_tokens // self.bs
            g = routed.global_hit_tokens // self.bs
            if g > h:
                ready = self._fetch(r, inst, h, g, t)
        if ready > t:
            self._push(ready, _READY, r)
        else:
            inst.enqueue(r, t)

    def _fetch(self, r: SimRequest, inst: Instance, h: int, g: int, t: float) -> float:
        """Pull blocks [h, g) over the instance's node link (FIFO: transfers queue for the link)."""
        assert self.gcache is not None
        node, got = self.gcache.match(r.blocks[:g])
        self.gcache.touch(node, t)
        g = min(g, got)
        if g <= h:
            return t
        link = self.links[inst.node]
        start = max(t, link.free_at)
        nbytes = (g - h) * self.bs * self.profile.kv_bytes_per_token
        dur = nbytes / self.profile.link_bytes_per_s
        link.free_at = start + dur
        link.busy_s += dur
        link.bytes += nbytes
        r.fetch_from, r.fetch_to = h, g
        return start + dur

    def on_prefill_done(self, r: SimRequest, t: float) -> None:
        self.load.on_prefilled(r.rid)
        gc = self.gcache
        if gc is None or r.n_blocks == 0:
            return
        # Write-through: the prompt's blocks the global tier lacks are copied there.
        node, p = gc.match(r.blocks)
        end = r.n_blocks
        if p < end:
            gc.pin(node, t)
            if not gc.make_room(end - p):
                end = p + max(0, int(gc.free))
            gc.unpin(node, t)
            if end > p:
                gc.insert(r.blocks, end, t)
                self.index.global_stored(r.blocks[p:end].tolist())
        else:
            gc.touch(node, t)

    def on_finish(self, r: SimRequest, t: float) -> None:
        self.load.on_done(r.rid)
        assert r.inst is not None
        self.rec.add(r, r.inst.pos)
        done = t
        if self.cfg.pd:
            # Decode runs on the separate decode pool at a fixed pace.
            done = t + (r.output - 1) * self.cfg.pd_decode_tpot_s
        self._next(r.session, r.idx, done)

    def _next(self, sess: _Session, k: int, t: float) -> None:
        if self.cfg.arrival != "closed":
            return
        for child in self._children.get((sess.trace.session_id, k), ()):
            self._start_session(child, t)
        reqs = sess.trace.requests
        if k + 1 < len(reqs):
            think = min(max(0.0, reqs[k + 1].think_time), self.cfg.max_think_s)
            self._push(t + think, _ARRIVE, sess, k + 1)


def simulate(
    workload: Workload,
    cfg: SimConfig,
    policy: PolicyConfig | str = "smetric",
    profile: Profile | None = None,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Run one simulation and return its metrics."""
    pol = PolicyConfig(name=policy) if isinstance(policy, str) else policy  # type: ignore[arg-type]
    return Simulator(workload, cfg, pol, profile).run(progress)
