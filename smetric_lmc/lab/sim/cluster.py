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
from smetric_lmc.lab.sim import prices_hook
from smetric_lmc.lab.sim.cache import PrefixCache, first_mismatch
from smetric_lmc.lab.sim.config import SimConfig, global_capacity_blocks
from smetric_lmc.lab.sim.engine import Instance
from smetric_lmc.lab.sim.global_tier import GlobalTier, Links
from smetric_lmc.lab.sim.load_signal import BatchLoadTracker, ScrapedLoadTracker
from smetric_lmc.lab.sim.metrics import Recorder, RunStats, SimResult, summarize
from smetric_lmc.lab.sim.profile import Profile, load_profile
from smetric_lmc.lab.sim.request import SimRequest
from smetric_lmc.lab.sim.token_load import InflightTokens
from smetric_lmc.lab.sim.transfer import Network
from smetric_lmc.lab.workload.model import TraceSession, Workload
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router

log = logging.getLogger(__name__)

_ARRIVE = 0
_READY = 1
_SEGMENT = 2
_XFER = 3
_CALL = 4


def chained_lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Common prefix length of two prefix-chained id arrays (equality is monotone: bisection)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[n - 1] == b[n - 1]:
        return n
    return first_mismatch(a, b, 0, n - 1)


def shared_depths(workload: Workload) -> dict[str, int]:
    """Per session: how many leading blocks its first prompt shares with any other session's (a
    framework/system prompt). Sorting the prompts puts each one's best match next to it."""
    firsts = [(s.requests[0].block_ids, s.session_id) for s in workload.sessions if s.requests]
    firsts.sort(key=lambda x: tuple(x[0].tolist()))
    out = {sid: 0 for _, sid in firsts}
    for (a, ia), (b, ib) in itertools.pairwise(firsts):
        n = chained_lcp(a, b)
        out[ia] = max(out[ia], n)
        out[ib] = max(out[ib], n)
    return out


# Copies of a session (sampling with replacement) get distinct content past the prefix it shares
# with other sessions: its ids there are XORed with a per-copy salt (ids stay prefix-chained).
_SALT_STEP = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1


class _Session:
    __slots__ = ("trace", "idx", "start", "first_inst", "prev_blocks", "salt", "depth", "_memo")

    def __init__(self, trace: TraceSession, idx: int, start: float, salt: int = 0, depth: int = 0) -> None:
        self.trace = trace
        self.idx = idx
        self.start = start
        self.first_inst = -1  # instance of the session's latest first-turn request
        self.prev_blocks: np.ndarray | None = None
        self.salt = salt
        self.depth = depth
        self._memo: tuple[int, np.ndarray] | None = None

    def blocks_of(self, k: int) -> np.ndarray:
        ids = self.trace.requests[k].block_ids
        if not self.salt:
            return ids
        memo = self._memo
        if memo is not None and memo[0] == k:
            return memo[1]
        out = ids.copy()
        out[self.depth :] ^= np.uint64((self.salt * _SALT_STEP) & _U64)
        self._memo = (k, out)
        return out


@dataclass(slots=True)
class Placement:
    """Root session starts (trace, start, copy number), and for every parent the sub-agents it
    spawns: (parent request index after whose completion the child starts, child, recorded offset
    from the parent's start)."""

    roots: list[tuple[TraceSession, float, int]]
    children: dict[str, list[tuple[int, TraceSession, float]]]


def place_sessions(
    workload: Workload,
    rate: float,
    seed: int,
    max_sessions: int | None,
    sampling: str = "once",
    window_s: float | None = None,
) -> Placement:
    """Root sessions start as a Poisson process. ``once``: every root (or the first
    ``max_sessions``) once, in a seeded random order. ``replace``: roots drawn uniformly with
    replacement until ``window_s``, so the offered load is ``rate`` however small the pool; the
    k-th draw of the same root is copy k. A sub-agent starts when the parent request that was in
    progress at its recorded start completes (the tool call that spawned it), so it keeps its place
    in the parent's timeline however fast the replay runs."""
    rng = np.random.default_rng(seed)
    roots_of = workload.root_of()
    roots = [s for s in workload.sessions if roots_of[s.session_id] == s.session_id]
    placed: list[tuple[TraceSession, float, int]] = []
    if sampling == "replace":
        if window_s is None or window_s <= 0:
            raise ValueError("sampling 'replace' needs arrival_window_s > 0")
        if not roots:
            return Placement([], {})
        # enough exponential gaps to cover the window with overwhelming probability
        n = int(rate * window_s + 10 * math.sqrt(rate * window_s) + 10)
        starts = np.cumsum(rng.exponential(1.0 / rate, size=n))
        starts = starts[starts <= window_s]
        if max_sessions is not None:
            starts = starts[:max_sessions]
        picks = rng.integers(len(roots), size=len(starts))
        seen: dict[int, int] = {}
        for k, t in zip(picks.tolist(), starts.tolist()):
            c = seen.get(k, 0)
            seen[k] = c + 1
            placed.append((roots[k], float(t), c))
    elif sampling == "once":
        order = rng.permutation(len(roots))
        if max_sessions is not None:
            order = order[:max_sessions]
        starts = np.cumsum(rng.exponential(1.0 / rate, size=len(order)))
        placed = [(roots[int(k)], float(t), 0) for k, t in zip(order, starts)]
    else:
        raise ValueError(f"sampling must be once or replace, got {sampling!r}")
    chosen = {s.session_id for s, _, _ in placed}
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


def _make_index(bs: int, clock: Callable[[], float]) -> TierIndex:
    # Pending-block and stale deadlines run on the simulation's virtual time, not the wall clock.
    return TierIndex(bs, bs, clock=clock)


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
        self.index = _make_index(self.bs, lambda: self.now)
        self.load = (
            BatchLoadTracker(lambda: self.now, lambda iid: self.by_id[iid].n_running)
            if policy.name in cfg.batch_load_policies
            else ScrapedLoadTracker(lambda: self.now, cfg.scrape_s) if cfg.load_signal == "scrape"
            else LoadTracker(clock=lambda: self.now)
        )  # fmt: skip
        self.router = Router(self.index, self.load, policy, disaggregated=cfg.pd)
        self.price_feed = prices_hook.attach(self.router, policy)  # learns prices from done reports
        # ... and from the retrieves the engines' metrics would show
        self.retrieve_polls = prices_hook.RetrievePolls(self.price_feed) if self.price_feed is not None else None
        prof = self.profile
        self.instances: list[Instance] = []
        self.by_id: dict[str, Instance] = {}
        per_node = prof.instances_per_node
        self.n_nodes = math.ceil(cfg.instances / per_node)
        self._heap: list[tuple[float, int, int, object, object]] = []
        self._seq = itertools.count()
        self.net = Network(self._schedule_net)
        self.links = Links(cfg.instances, self.n_nodes, prof.host_link_bytes_per_s, prof.link_bytes_per_s)
        cap = global_capacity_blocks(cfg.global_tier, prof, self.bs, cfg.instances, self.n_nodes)
        self.gtier: GlobalTier | None = None
        if cap is not None:
            self.gtier = GlobalTier(
                cap, self.index, self.net, self.links, self.bs * prof.kv_bytes_per_token,
                fetch_path=cfg.fetch(), call_at=self.push_call, block_tokens=self.bs,
            )  # fmt: skip
        for k in range(cfg.instances):
            iid = f"i{k:03d}"
            self.index.register_instance(iid)
            self.load.add_instance(iid)
            inst = Instance(self, iid, k, k // per_node, prof, self.bs)
            self.instances.append(inst)
            self.by_id[iid] = inst
        self.max_context = prof.max_context(self.bs)
        self.rec = Recorder()
        self.win_tokens: list[np.ndarray] = []
        self.busy_in_window = 0.0  # engine-busy seconds inside [measure_from, last root start]
        self.busy_in_window_by: list[float] = []  # the same per instance
        # the policy's load (in flight / unprefilled tokens) per instance, sampled at every routing
        # decision and summed per window: the secondary, routing-time imbalance figure
        self.win_load: list[np.ndarray] = []
        self.win_samples: list[int] = []
        # the paper's load: in-flight tokens per instance, time-averaged per window (sim/token_load.py)
        self.tok_load = InflightTokens(cfg.instances, cfg.window_s)
        self._ids = [i.iid for i in self.instances]
        self.events = 0
        self._n_sessions = 0
        self._children: dict[tuple[str, int], list[TraceSession]] = {}
        self._depth: dict[str, int] = {}
        self.first_root_start = 0.0
        self.last_root_start = 0.0
        self.measure_from = 0.0  # the measured window: [measure_from, last_root_start]

    @property
    def gcache(self) -> PrefixCache | None:
        """The global tier's block cache (None without a global tier)."""
        return self.gtier.cache if self.gtier is not None else None

    # ---- event plumbing ------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj: object, extra: object = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj, extra))

    def push_segment(self, inst: Instance) -> None:
        self._push(inst.seg_end, _SEGMENT, inst, inst.version)

    def push_call(self, t: float, fn: Callable[[float], None]) -> None:
        self._push(t, _CALL, fn)

    def _schedule_net(self, t: float, version: int) -> None:
        self._push(t, _XFER, None, version)

    def _windows(self, store: list[np.ndarray], w: int, dtype: type) -> list[np.ndarray]:
        while len(store) <= w:
            store.append(np.zeros(len(self.instances), dtype=dtype))
        return store

    def account(self, pos: int, t: float, tokens: int, decoded: int = 0) -> None:
        w = int(t // self.cfg.window_s)
        self._windows(self.win_tokens, w, np.int64)[w][pos] += tokens
        if decoded:
            self.tok_load.add(pos, t, decoded)

    def account_busy(self, pos: int, t0: float, t1: float) -> None:
        # the measurement window is known before the run: clip to it exactly
        span = min(t1, self.last_root_start) - max(t0, self.measure_from)
        if span > 0:
            self.busy_in_window += span
            self.busy_in_window_by[pos] += span

    def _sample_load(self, t: float) -> None:
        w = int(t // self.cfg.window_s)
        wl, ws = self.win_load, self.win_samples
        while len(wl) <= w:
            wl.append(np.zeros(len(self.instances)))
            ws.append(0)
        wl[w] += LoadTracker.loads(self.load, self._ids, self.cfg.pd)  # the true load, whatever the policy sees
        ws[w] += 1

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
        cfg = self.cfg
        pl = place_sessions(self.workload, cfg.rate, cfg.seed, cfg.max_sessions, cfg.sampling, cfg.arrival_window_s)
        if cfg.sampling == "replace":
            self._depth = shared_depths(self.workload)
        self._children = {}
        for pid, kids in pl.children.items():
            for j, child, _ in kids:
                self._children.setdefault((pid, j), []).append(child)
        self.last_root_start = max((t for _, t, _ in pl.roots), default=0.0)
        self.first_root_start = min((t for _, t, _ in pl.roots), default=0.0)
        self.measure_from = self.first_root_start + cfg.warmup_share * (self.last_root_start - self.first_root_start)
        self.busy_in_window_by = [0.0] * len(self.instances)
        for s, start, copy in pl.roots:
            self._start_session(s, start, copy)
        if cfg.arrival == "open":
            # Recorded timeline: every sub-agent at its recorded offset from its root's start.
            roots_of = self.workload.root_of()
            rel = self.workload.absolute_start()
            kids_of_root: dict[str, list[TraceSession]] = {}
            for kids in pl.children.values():
                for _, child, _ in kids:
                    kids_of_root.setdefault(roots_of[child.session_id], []).append(child)
            for s, start, copy in pl.roots:
                for child in kids_of_root.get(s.session_id, ()):
                    off = max(0.0, rel[child.session_id] - rel[s.session_id])
                    self._start_session(child, start + off, copy)
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
            elif kind == _XFER:
                self.net.on_wake(t, extra)  # type: ignore[arg-type]
            elif kind == _CALL:
                obj(t)  # type: ignore[operator]
            else:
                r: SimRequest = obj  # type: ignore[assignment]
                r.inst.enqueue(r, t)
        self.events = n
        self.net.close(self.now)
        leftover = sum(i.n_running + len(i.waiting) for i in self.instances)
        if leftover:
            log.warning("%d requests never finished", leftover)
        return summarize(self._stats())

    def _stats(self) -> RunStats:
        gt = self.gtier
        L = self.links
        return RunStats(
            cfg=self.cfg,
            policy=self.policy.name,
            rec=self.rec,
            win_tokens=self.win_tokens,
            busy_in_window=self.busy_in_window,
            busy_in_window_by=self.busy_in_window_by,
            win_load=self.win_load,
            win_samples=self.win_samples,
            win_inflight_tokens=self.tok_load.windows(self.now),
            first_root_start=self.first_root_start,
            last_root_start=self.last_root_start,
            measure_from=self.measure_from,
            events=self.events,
            busy_s=[i.busy_time for i in self.instances],
            stall_s=[i.stall_time for i in self.instances],
            evicted_local_blocks=sum(i.cache.evicted for i in self.instances),
            evicted_global_blocks=gt.cache.evicted if gt is not None else 0,
            link_busy_s={
                "nic_rx": [r.busy_s for r in L.rx], "nic_tx": [r.busy_s for r in L.tx],
                "pcie_h2d": [r.busy_s for r in L.h2d], "pcie_d2h": [r.busy_s for r in L.d2h],
            },  # fmt: skip
            fetched_bytes=gt.fetched_bytes if gt is not None else 0.0,
            fetched_remote_bytes=gt.fetched_remote_bytes if gt is not None else 0.0,
            stored_bytes=gt.stored_bytes if gt is not None else 0.0,
        )

    # ---- requests ------------------------------------------------------------------------------
    def _start_session(self, trace: TraceSession, start: float, copy: int = 0) -> None:
        if not trace.requests:
            return
        depth = self._depth.get(trace.session_id, 0) if copy else 0
        sess = _Session(trace, self._n_sessions, start, copy, depth)
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
        blocks = sess.blocks_of(k)
        r = SimRequest(rid, k, sess, tr.turn, blocks, tr.input_tokens, tr.output_tokens, t)
        need = r.input if self.cfg.pd else r.input + r.output
        if need > self.max_context:
            r.reason = "rejected"
            r.finish = t
            self.rec.add(r, -1, rejected=True)
            self._next(sess, k, t)
            return
        blist = blocks.tolist()
        est = 0
        if tr.turn > 0 and sess.prev_blocks is not None:
            est = chained_lcp(sess.prev_blocks, blocks) * self.bs
        sess.prev_blocks = blocks
        routed = self.router.route(
            rid, blist, blist if self.gtier is not None else None, r.input, turn=tr.turn, est_hit=est
        )
        if routed.instance_id is None:
            raise RuntimeError("no instance to route to")
        inst = self.by_id[routed.instance_id]
        r.inst = inst
        self._sample_load(t)
        self.tok_load.add(inst.pos, t, r.input)
        r.reason = routed.reason.value
        if tr.turn == 0 or sess.first_inst < 0:
            # a fork or sub-agent starts at turn > 0 (it carries its parent's turns): its own first
            # request places it, and is not one of its follow-ups
            sess.first_inst = inst.pos
        else:
            r.sticky = int(inst.pos == sess.first_inst)
        # What to load from the global tier is decided when the engine admits the request.
        inst.enqueue(r, t)

    def generated_blocks(self, r: SimRequest) -> np.ndarray | None:
        """The next prompt's ids when it continues ``r``'s prompt (its answer's blocks follow)."""
        sess: _Session = r.session
        k = r.idx + 1
        if k >= len(sess.trace.requests):
            return None
        nxt = sess.blocks_of(k)
        n = r.n_blocks
        if len(nxt) <= n or (n and nxt[n - 1] != r.blocks[n - 1]):
            return None
        return nxt

    def on_prefill_done(self, r: SimRequest, t: float) -> None:
        self.load.on_prefilled(r.rid)
        if self.cfg.pd:  # the prefill token load: the prompt leaves it once prefilled
            assert r.inst is not None
            self.tok_load.add(r.inst.pos, t, -r.input)

    def on_finish(self, r: SimRequest, t: float) -> None:
        self.load.on_done(r.rid)
        assert r.inst is not None
        self.rec.add(r, r.inst.pos)
        if not self.cfg.pd:  # the prompt and every decoded token after the first were added
            self.tok_load.add(r.inst.pos, t, -(r.input + max(0, r.decoded - 1)))
        done = t
        if self.cfg.pd:
            # Decode runs on the separate decode pool at a fixed pace.
            done = t + (r.output - 1) * self.cfg.pd_decode_tpot_s
        prices_hook.report_done(self.price_feed, r, done)
        prices_hook.report_retrieve(self.retrieve_polls, r, done)
        self._next(r.session, r.idx, done)

    def _next(self, sess: _Session, k: int, t: float) -> None:
        if self.cfg.arrival != "closed":
            return
        stop = not self.cfg.drain and self.cfg.measure == "arrivals"  # nothing after the window counts
        if stop and t > self.last_root_start:
            return
        for child in self._children.get((sess.trace.session_id, k), ()):
            self._start_session(child, t, sess.salt)
        reqs = sess.trace.requests
        if k + 1 < len(reqs):
            think = min(max(0.0, reqs[k + 1].think_time), self.cfg.max_think_s)
            if stop and t + think > self.last_root_start:
                return
            self._push(t + think, _ARRIVE, sess, k + 1)


def simulate(
    workload: Workload,
    cfg: SimConfig,
    policy: PolicyConfig | str = "smetric",
    profile: Profile | None = None,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Run one simulation and return its metrics (the simulator's public entry point)."""
    pol = PolicyConfig(name=policy) if isinstance(policy, str) else policy  # type: ignore[arg-type]
    return Simulator(workload, cfg, pol, profile).run(progress)
