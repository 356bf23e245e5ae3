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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from smetric_lmc.lab.mock_engine.store_keys import StoreKeys
from smetric_lmc.lab.sim.cache import Node, PrefixCache
from smetric_lmc.lab.sim.fetch_path import (
    DEFAULT_FETCH_PATH,
    LMCACHE_CHUNK_TOKENS,
    FetchPath,
    load_fetch_path,
)
from smetric_lmc.lab.sim.global_tier import GlobalTier, Links, Put
from smetric_lmc.lab.sim.profile import Profile
from smetric_lmc.lab.sim.request import SimRequest
from smetric_lmc.lab.sim.transfer import Network, Resource

log = logging.getLogger(__name__)

LOCAL_CPU_PATH = "lmcache-local-cpu"  # the simulator's profile for LMCache's local CPU backend


def _path_doc(fp: FetchPath) -> dict[str, Any]:
    """One tier's path as JSON: throughputs of 0 mean no per-request cap (JSON has no infinity)."""
    def cap(x: float) -> float:
        return x if math.isfinite(x) else 0.0

    return {"profile": fp.name, "gbps": cap(fp.request_gbs), "chunk_ms": fp.per_chunk_s * 1e3,
            "lookup_ms": fp.lookup_s * 1e3, "store_gbps": cap(fp.store_gbs), "staged": fp.staged}


def _number(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v) or v < 0:
        raise ValueError(f"retrieve path: {key} must be a number >= 0, got {v!r}")
    return float(v)


def _changed(fp: FetchPath, part: Any, key: str) -> FetchPath:
    """``fp`` with the fields of one tier's JSON object changed; ``profile`` starts from a named one."""
    if not isinstance(part, dict) or set(part) - {"profile", "gbps", "chunk_ms", "lookup_ms", "store_gbps"}:
        raise ValueError(f"{key!r} takes an object with profile, gbps, chunk_ms, lookup_ms, store_gbps")
    if "profile" in part:
        fp = load_fetch_path(str(part["profile"]))
    ch: dict[str, Any] = {}
    if "gbps" in part:  # 0 or inf: no per-request cap beyond the shared links
        g = _number("gbps", part["gbps"])
        ch["request_gbs"] = g if g > 0 else math.inf
    if "store_gbps" in part:
        g = _number("store_gbps", part["store_gbps"])
        ch["store_gbs"] = g if g > 0 else math.inf
    for k, f in (("chunk_ms", "per_chunk_s"), ("lookup_ms", "lookup_s")):
        if k in part:
            v = _number(k, part[k])
            if not math.isfinite(v):
                raise ValueError(f"retrieve path: {k} must be finite")
            ch[f] = v * 1e-3
    return replace(fp, name=f"{fp.name}*", **ch) if ch else fp


@dataclass(frozen=True)
class RetrieveCosts:
    """What a fetch costs now: one fetch-path profile (``configs/fetch_paths.yaml``, the simulator's)
    per tier, and a slowdown ``scale``. Replaced whole on a change (fetches in flight keep theirs)."""

    global_: FetchPath = field(default_factory=lambda: load_fetch_path(DEFAULT_FETCH_PATH))
    local_cpu: FetchPath = field(default_factory=lambda: load_fetch_path(LOCAL_CPU_PATH))
    scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, int | float) \
                or not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError("scale must be a finite number > 0")

    def to_dict(self) -> dict[str, Any]:
        return {"global": _path_doc(self.global_), "local_cpu": _path_doc(self.local_cpu),
                "chunk_tokens": LMCACHE_CHUNK_TOKENS, "scale": self.scale}

    def updated(self, doc: Any) -> RetrieveCosts:
        """These costs with the fields ``doc`` names changed; unknown keys are an error."""
        if not isinstance(doc, dict):
            raise ValueError("retrieve costs must be a JSON object")
        unknown = set(doc) - {"global", "local_cpu", "scale"}
        if unknown:
            raise ValueError(f"unknown retrieve-cost keys: {sorted(unknown)}")
        out = self
        if "global" in doc:
            out = replace(out, global_=_changed(out.global_, doc["global"], "global"))
        if "local_cpu" in doc:
            out = replace(out, local_cpu=_changed(out.local_cpu, doc["local_cpu"], "local_cpu"))
        return replace(out, scale=doc["scale"]) if "scale" in doc else out

    def effective(self, fp: FetchPath) -> FetchPath:
        """``fp`` slowed ``scale`` times: latencies times it, throughputs divided by it."""
        if self.scale == 1:
            return fp
        k = self.scale
        return replace(fp, name=f"{fp.name}x{k:g}", lookup_s=fp.lookup_s * k, per_chunk_s=fp.per_chunk_s * k,
                       request_gbs=fp.request_gbs / k, store_gbs=fp.store_gbs / k)


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
    """Tokens each fetch got from where (the engines' own accounting, summed over the process)."""

    fetches: int = 0
    global_tokens: int = 0
    local_cpu_tokens: int = 0
    fetch_s: float = 0.0  # model seconds spent in fetches (their sum)


class _Sink:
    """What the simulator's global tier reports its contents to without ``--global-store-keys``:
    nobody (the controller learns a real store's contents from Redis / Mooncake; with that option
    the tier names its chunks in a real Redis, ``store_keys.StoreKeys``)."""

    def global_stored(self, hashes: list[int]) -> None:
        pass

    def global_removed(self, hashes: list[int]) -> None:
        pass

    def note_prompt(self, token_ids: Sequence[int], blocks: np.ndarray) -> None:
        pass


@dataclass
class _Pin:
    gnode: Node | None
    cpu: int  # leading blocks the instance's CPU tier held at lookup


class SharedTiers:
    """The process's global tier (the simulator's ``GlobalTier``, with the profile's links and its
    fetch path) and the retrieve costs every fetch pays; ``view(pos)`` is one instance's face of it."""

    def __init__(self, profile: Profile, block_size: int, n_instances: int, clock: MockClock, *,
                 global_blocks: int, local_cpu_blocks: int = 0, costs: RetrieveCosts | None = None,
                 keys: StoreKeys | None = None) -> None:
        self.clock = clock
        self.bs = block_size
        self.bpb = block_size * profile.kv_bytes_per_token
        self.costs = costs or RetrieveCosts()
        self.counters = TierCounters()
        self.local_cpu_blocks = local_cpu_blocks
        n_nodes = max(1, -(-n_instances // profile.instances_per_node))
        self.net = Network(self._schedule)
        self.links = Links(n_instances, n_nodes, profile.host_link_bytes_per_s, profile.link_bytes_per_s)
        # where the tier's contents are announced (the chunks' LMCache keys in a Redis, or nowhere)
        self.keys: StoreKeys | _Sink = keys if keys is not None else _Sink()
        self.tier = GlobalTier(global_blocks, self.keys, self.net, self.links, self.bpb,  # type: ignore[arg-type]
                               fetch_path=self.costs.effective(self.costs.global_), call_at=self.call_at,
                               block_tokens=block_size)
        self.per_node = profile.instances_per_node
        self.after_wake: list[Callable[[], None]] = []  # cores flush their KV events after transfers end

    def _schedule(self, t: float, version: int) -> None:
        self.clock.call_at(t, self._wake, t, version)

    def _wake(self, t: float, version: int) -> None:
        self.net.on_wake(t, version)
        self._flush()

    def call_at(self, t: float, fn: Callable[[float], None]) -> None:
        self.clock.call_at(t, self._run, fn, t)

    def _run(self, fn: Callable[[float], None], t: float) -> None:
        fn(t)
        self._flush()

    def _flush(self) -> None:
        for fn in self.after_wake:
            fn()

    def view(self, pos: int) -> TierView:
        return TierView(self, pos, pos // self.per_node)

    def set_costs(self, doc: Any) -> RetrieveCosts:
        self.costs = self.costs.updated(doc)
        # The global tier fetches and puts along its fetch path: swap in the new one.
        self.tier.fp = self.costs.effective(self.costs.global_)
        log.info("retrieve costs now %s", self.costs.to_dict())
        return self.costs


class TierView:
    """One instance's tiers: what the simulator's engine calls ``gtier`` (lookup, store, copy-out:
    the shared ``GlobalTier``'s), with the instance's local CPU tier in front of the global one."""

    def __init__(self, shared: SharedTiers, pos: int, node: int) -> None:
        self.shared = shared
        self.pos = pos
        self.node = node
        cap = shared.local_cpu_blocks
        self.cpu = PrefixCache(cap) if cap > 0 else None

    # ---- lookup --------------------------------------------------------------------------------
    def lookup_pin(self, blocks: np.ndarray, after: int, now: float) -> tuple[int, _Pin | None]:
        tier = self.shared.tier
        cpu = 0
        if self.cpu is not None:
            node, cpu = self.cpu.match(blocks)
            cpu = tier.chunk_floor(cpu)  # LMCache hits whole chunks only
            if cpu:
                self.cpu.touch(node, now)
        g, gnode = tier.lookup_pin(blocks, after, now)
        held = max(g, cpu)
        if held <= after:
            if gnode is not None:
                tier.unpin(gnode, now)
            return held, None
        return held, _Pin(gnode, cpu)

    def unpin(self, pin: _Pin, now: float) -> None:
        if pin.gnode is not None:
            self.shared.tier.unpin(pin.gnode, now)
            pin.gnode = None

    # ---- fetch ---------------------------------------------------------------------------------
    def fetch_request(self, r: SimRequest, now: float, done: Callable[[float], None]) -> int:
        """Load ``r``'s blocks past its GPU hit: those the local CPU tier holds along the local path,
        the rest from the global tier along its fetch path; ``done`` when both have arrived. Returns
        the tokens the local CPU tier supplies."""
        sh = self.shared
        pin: _Pin = r.gnode
        h, g = r.local_blocks, r.local_blocks + r.global_blocks
        c = min(max(pin.cpu, h), g)
        pending = [(c > h) + (g > c)]
        t_end = [now]

        def one(t: float) -> None:
            t_end[0] = max(t_end[0], t)
            pending[0] -= 1
            if pending[0] == 0:
                sh.counters.fetch_s += t_end[0] - now
                done(t_end[0])

        sh.counters.fetches += 1
        if c > h:
            sh.counters.local_cpu_tokens += (c - h) * sh.bs
            self._local(c - h, now, one)
        if g > c:
            sh.counters.global_tokens += (g - c) * sh.bs
            sh.tier.fetch(self.pos, self.node, r.blocks[c:g], now, one)
        if pending[0] == 0:
            done(now)
        return (c - h) * sh.bs

    def _local(self, n: int, now: float, done: Callable[[float], None]) -> None:
        """``n`` blocks host -> GPU along the local CPU tier's path (its own cap on the GPU's PCIe)."""
        sh = self.shared
        fp = sh.costs.effective(sh.costs.local_cpu)
        own = (Resource("local-fetch", fp.request_bps),) if math.isfinite(fp.request_bps) else ()
        parts = [(n * sh.bpb, (sh.links.h2d[self.pos], *own))]
        fixed = fp.fixed_s(-(-n // sh.tier.chunk_blocks))
        sh.call_at(now + fixed, lambda t: sh.net.start(t, parts, done))

    # ---- store ---------------------------------------------------------------------------------
    def chunk_floor(self, n: int) -> int:
        return self.shared.tier.chunk_floor(n)

    def plan_store(self, blocks: np.ndarray, end: int) -> int:
        """Where the global tier's put of ``blocks[:end]`` starts; the local CPU tier takes the
        blocks at once (LMCache's local backend is written on the save)."""
        if self.cpu is not None:
            node, p = self.cpu.match(blocks[:end])
            t = self.shared.clock.now()
            if p < end and self.cpu.make_room(end - p):
                self.cpu.insert(blocks, end, t)
            elif p:
                self.cpu.touch(node, t)
        return self.shared.tier.plan_store(blocks, end)

    def copy_out(self, gpu: int, node: int, puts: list[Put], now: float, done: Callable[[float], None]) -> float:
        """The global tier's: the copy ends the step, the put is visible to every instance once it landed."""
        return self.shared.tier.copy_out(self.pos, self.node, puts, now, done)


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
