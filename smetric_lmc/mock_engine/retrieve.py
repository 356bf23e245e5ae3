"""The mock cluster's KV tiers beyond the GPU: a global tier shared by every instance of a mock
process (LMCache + a pooled store such as Mooncake) and an optional local CPU tier per instance
(LMCache's local CPU backend), each fetched through a settable retrieve path.

A fetch of ``n`` tokens from a tier costs, on the engine step that first schedules the request
(vLLM's ``LMCacheConnectorV1`` in its synchronous mode, as the simulator's ``sync`` load mode):

    lookup_ms + ceil(n / chunk_tokens) * chunk_ms + the transfer

where the transfer moves ``n * kv_bytes_per_token`` bytes at no more than ``gbps`` (the retrieve
path's per-request throughput) and shares the simulator's links (the GPU's PCIe, the nodes' NICs)
with every other transfer of the process. A put (the prompt blocks a step computes) becomes
visible to other instances only when its copy and its background put to the home nodes are done.

The costs are a :class:`RetrieveCosts`, changeable while the cluster runs (``POST /mock/retrieve``
on any instance of the process, or ``--retrieve-file``, a JSON file the process re-reads when it
changes): a change applies to fetches that start after it. ``scale`` multiplies every latency and
divides every throughput (``{"scale": 4}``: the fetch path 4x slower).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from smetric_lmc.sim.cache import Node, PrefixCache
from smetric_lmc.sim.global_tier import GlobalTier, Links
from smetric_lmc.sim.profile import Profile
from smetric_lmc.sim.request import SimRequest
from smetric_lmc.sim.transfer import Network, Resource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetrievePath:
    """One tier's retrieve path, per request. ``gbps`` is GB/s (1e9 bytes); 0 means no limit
    beyond the shared links."""

    gbps: float
    chunk_ms: float
    lookup_ms: float

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                raise ValueError(f"retrieve path: {k} must be a finite number >= 0, got {v!r}")


# Defaults: LMCache's retrieve path as public figures put it (sources in docs/peers.md, "The mock
# cluster"): ~6.4 GB/s per request from Mooncake Store over RDMA (LMCache PR 3018); lookups of
# 1-2 ms (LMCache issue 891 / PR 934); local CPU 64 k tokens of a 96 KiB/token model in 0.27 s
# (~23 GB/s). The per-chunk costs are guesses (0.1 ms remote, 0.02 ms local per 256-token chunk).
GLOBAL_DEFAULT = RetrievePath(gbps=6.4, chunk_ms=0.1, lookup_ms=1.5)
LOCAL_CPU_DEFAULT = RetrievePath(gbps=23.0, chunk_ms=0.02, lookup_ms=0.2)


@dataclass(frozen=True)
class RetrieveCosts:
    """What a fetch costs now; replaced whole on a change (fetches in flight keep theirs)."""

    global_: RetrievePath = GLOBAL_DEFAULT
    local_cpu: RetrievePath = LOCAL_CPU_DEFAULT
    chunk_tokens: int = 256  # LMCache's chunk size
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.chunk_tokens, int) and self.chunk_tokens >= 1):
            raise ValueError("chunk_tokens must be an integer >= 1")
        if not (isinstance(self.scale, int | float) and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError("scale must be a finite number > 0")

    def to_dict(self) -> dict[str, Any]:
        return {"global": asdict(self.global_), "local_cpu": asdict(self.local_cpu),
                "chunk_tokens": self.chunk_tokens, "scale": self.scale}

    def updated(self, doc: Any) -> RetrieveCosts:
        """These costs with the fields ``doc`` names changed; unknown keys are an error."""
        if not isinstance(doc, dict):
            raise ValueError("retrieve costs must be a JSON object")
        unknown = set(doc) - {"global", "local_cpu", "chunk_tokens", "scale"}
        if unknown:
            raise ValueError(f"unknown retrieve-cost keys: {sorted(unknown)}")
        out = self
        for key, attr in (("global", "global_"), ("local_cpu", "local_cpu")):
            if key in doc:
                part = doc[key]
                if not isinstance(part, dict) or set(part) - {"gbps", "chunk_ms", "lookup_ms"}:
                    raise ValueError(f"{key!r} takes an object with gbps, chunk_ms, lookup_ms")
                out = replace(out, **{attr: replace(getattr(out, attr), **part)})
        rest = {k: doc[k] for k in ("chunk_tokens", "scale") if k in doc}
        return replace(out, **rest) if rest else out

    def seconds(self, path: RetrievePath, tokens: int) -> float:
        """The fixed part of a fetch (lookup + per-chunk), in model seconds."""
        chunks = -(-tokens // self.chunk_tokens)
        return (path.lookup_ms + chunks * path.chunk_ms) * 1e-3 * self.scale

    def rate(self, path: RetrievePath) -> float:
        """The per-request throughput cap in bytes/s (inf: none)."""
        return path.gbps * 1e9 / self.scale if path.gbps > 0 else math.inf


class MockClock:
    """Model time of one mock process: ``speed`` model seconds per wall second, one origin for every
    instance (they share a global tier, so they must share a clock)."""

    def __init__(self, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.speed = speed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0

    def now(self) -> float:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._t0 = self._loop.time()
        return (self._loop.time() - self._t0) * self.speed

    def call_at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self.now()
        assert self._loop is not None
        self._loop.call_at(self._t0 + t / self.speed, fn, *args)


@dataclass
class TierCounters:
    """Tokens each request got from where (the engines' own accounting, summed over the process)."""

    fetches: int = 0
    global_tokens: int = 0
    local_cpu_tokens: int = 0
    fetch_s: float = 0.0  # model seconds spent in fetches (their sum)
    puts: int = 0
    put_blocks: int = 0


class _Sink:
    """What the simulator's global tier reports its contents to: nobody here (the controller learns a
    real store's contents from Redis / Mooncake, which the in-process tier is not)."""

    def global_stored(self, hashes: list[int]) -> None:
        pass

    def global_removed(self, hashes: list[int]) -> None:
        pass


@dataclass
class _Pin:
    gnode: Node | None
    cpu: int  # leading blocks the instance's CPU tier held at lookup


class SharedTiers:
    """The process's global tier (the simulator's, with the links and pool of the profile) and the
    retrieve costs every fetch pays; ``view(pos)`` is one instance's face of it."""

    def __init__(self, profile: Profile, block_size: int, n_instances: int, clock: MockClock, *,
                 global_blocks: int, local_cpu_blocks: int = 0, costs: RetrieveCosts | None = None) -> None:
        self.clock = clock
        self.bs = block_size
        self.bpb = block_size * profile.kv_bytes_per_token
        self.costs = costs or RetrieveCosts()
        self.counters = TierCounters()
        self.local_cpu_blocks = local_cpu_blocks
        n_nodes = max(1, -(-n_instances // profile.instances_per_node))
        self.net = Network(self._schedule)
        self.links = Links(n_instances, n_nodes, profile.host_link_bytes_per_s, profile.link_bytes_per_s)
        self.tier = GlobalTier(global_blocks, _Sink(), self.net, self.links, self.bpb)  # type: ignore[arg-type]
        self.per_node = profile.instances_per_node
        self.after_wake: list[Callable[[], None]] = []  # cores flush their KV events after transfers end

    def _schedule(self, t: float, version: int) -> None:
        self.clock.call_at(t, self._wake, t, version)

    def _wake(self, t: float, version: int) -> None:
        self.net.on_wake(t, version)
        for fn in self.after_wake:
            fn()

    def view(self, pos: int) -> TierView:
        return TierView(self, pos, pos // self.per_node)

    def set_costs(self, doc: Any) -> RetrieveCosts:
        self.costs = self.costs.updated(doc)
        log.info("retrieve costs now %s", self.costs.to_dict())
        return self.costs


class TierView:
    """One instance's tiers: what the simulator's engine calls ``gtier`` (lookup, fetch, store,
    copy-out), with the instance's local CPU tier in front of the shared global one."""

    def __init__(self, shared: SharedTiers, pos: int, node: int) -> None:
        self.shared = shared
        self.pos = pos
        self.node = node
        cap = shared.local_cpu_blocks
        self.cpu = PrefixCache(cap) if cap > 0 else None
        self._pending: list[tuple[np.ndarray, int]] = []  # puts of this step, visible when done

    # ---- lookup --------------------------------------------------------------------------------
    def lookup_pin(self, blocks: np.ndarray, after: int, now: float) -> tuple[int, _Pin | None]:
        cpu = 0
        if self.cpu is not None:
            node, cpu = self.cpu.match(blocks)
            if cpu:
                self.cpu.touch(node, now)
        g, gnode = self.shared.tier.lookup_pin(blocks, after, now)
        held = max(g, cpu)
        if held <= after:
            if gnode is not None:
                self.shared.tier.unpin(gnode, now)
            return held, None
        return held, _Pin(gnode, cpu)

    def unpin(self, pin: _Pin, now: float) -> None:
        if pin.gnode is not None:
            self.shared.tier.unpin(pin.gnode, now)
            pin.gnode = None

    # ---- fetch ---------------------------------------------------------------------------------
    def fetch_request(self, r: SimRequest, now: float, done: Callable[[float], None]) -> int:
        """Load ``r``'s blocks past its GPU hit: those the local CPU tier holds over the local path,
        the rest from the global tier; ``done`` when both have arrived. Returns the tokens the local
        CPU tier supplies."""
        sh = self.shared
        costs = sh.costs
        pin: _Pin = r.gnode
        h, g = r.local_blocks, r.local_blocks + r.global_blocks
        c = min(max(pin.cpu, h), g)
        bs = sh.bs
        parts = [(c - h, costs.local_cpu, False), (g - c, costs.global_, True)]
        pending = [sum(1 for n, _, _ in parts if n > 0)]
        t_end = [now]

        def one(t: float) -> None:
            t_end[0] = max(t_end[0], t)
            pending[0] -= 1
            if pending[0] == 0:
                sh.counters.fetch_s += t_end[0] - now
                done(t_end[0])

        sh.counters.fetches += 1
        for n, path, remote in parts:
            if n <= 0:
                continue
            tokens = n * bs
            if remote:
                sh.counters.global_tokens += tokens
            else:
                sh.counters.local_cpu_tokens += tokens
            start = now + costs.seconds(path, tokens)
            sh.clock.call_at(start, self._transfer, r.blocks[h:g] if remote else None, n, remote,
                             costs.rate(path), start, one)
        if pending[0] == 0:
            done(now)
        return (c - h) * bs

    def _transfer(self, blocks: np.ndarray | None, n: int, remote: bool, cap: float, t: float,
                  done: Callable[[float], None]) -> None:
        sh = self.shared
        L = sh.links
        # The request's own retrieve path is one more resource on its flows: it caps their rate.
        own = (Resource("retrieve", cap),) if math.isfinite(cap) else ()
        nbytes = n * sh.bpb
        if not remote:
            sh.net.start(t, [(nbytes, (L.h2d[self.pos], *own))], done)
            return
        assert blocks is not None
        parts: list[tuple[float, tuple[Resource, ...]]] = []
        for home, nb in enumerate(sh.tier.homes(blocks[len(blocks) - n:]).tolist()):
            if not nb:
                continue
            res = (L.h2d[self.pos], *own) if home == self.node else (L.h2d[self.pos], L.rx[self.node], L.tx[home], *own)
            parts.append((nb * sh.bpb, res))
        sh.net.start(t, parts, done)

    # ---- store ---------------------------------------------------------------------------------
    def store(self, blocks: np.ndarray, start: int, end: int, now: float) -> tuple[int, int]:
        """Which of ``blocks[:end]`` are new to the global tier (they are put); the local CPU tier
        takes them at once (LMCache's local backend is written on the save)."""
        if self.cpu is not None:
            node, p = self.cpu.match(blocks[:end])
            if p < end and self.cpu.make_room(end - p):
                self.cpu.insert(blocks, end, now)
            elif p:
                self.cpu.touch(node, now)
        tier = self.shared.tier
        node, p = tier.cache.match(blocks[:end])
        if p >= end:
            tier.cache.touch(node, now)
            return end, end
        self._pending.append((blocks, end))
        return p, end

    def copy_out(self, gpu: int, node: int, new: list[np.ndarray], now: float, done: Callable[[float], None]) -> None:
        """The device->host copy ends the step (``done``); the put's blocks become visible in the
        global tier when the copy and the background put to their home nodes have both finished."""
        sh = self.shared
        L = sh.links
        puts, self._pending = self._pending, []
        nbytes = sum(len(b) for b in new) * sh.bpb
        bg: list[tuple[float, tuple[Resource, ...]]] = []
        if sh.tier.n_nodes > 1:
            per_home = sum(sh.tier.homes(b) for b in new)
            bg = [(nb * sh.bpb, (L.tx[self.node], L.rx[home])) for home, nb in enumerate(per_home.tolist())
                  if nb and home != self.node]
        left = [2 if bg else 1]

        def landed(t: float) -> None:
            left[0] -= 1
            if left[0] == 0:
                self._publish(puts, t)

        def copied(t: float) -> None:
            landed(t)
            done(t)

        sh.net.start(now, [(nbytes, (L.d2h[self.pos],))], copied)
        if bg:
            sh.net.start(now, bg, landed)

    def _publish(self, puts: list[tuple[np.ndarray, int]], t: float) -> None:
        tier = self.shared.tier
        c = self.shared.counters
        for blocks, end in puts:
            node, p = tier.cache.match(blocks[:end])
            if p >= end:
                continue
            tier.cache.pin(node, t)
            if not tier.cache.make_room(end - p):
                end = p + max(0, int(tier.cache.free))
            tier.cache.unpin(node, t)
            if end > p:
                tier.cache.insert(blocks, end, t)
                c.puts += 1
                c.put_blocks += end - p


@dataclass
class CostsFile:
    """``--retrieve-file``: a JSON object of retrieve-cost changes, re-read when its mtime changes."""

    path: Path
    tiers: list[SharedTiers] = field(default_factory=list)
    _mtime: float = -1.0

    def poll(self) -> None:
        try:
            m = self.path.stat().st_mtime
        except FileNotFoundError:
            return
        if m == self._mtime:
            return
        self._mtime = m
        try:
            doc = json.loads(self.path.read_text() or "{}")
            for t in self.tiers:
                t.set_costs(doc)
        except (OSError, ValueError) as exc:
            log.error("%s: retrieve costs not changed: %s", self.path, exc)

    async def watch(self, period_s: float = 0.25) -> None:
        while True:
            self.poll()
            await asyncio.sleep(period_s)
