"""The global KV tier: host memory pooled across nodes (LMCache + Mooncake Store), with its links.

Blocks are spread over the nodes' pools as Mooncake's default allocator spreads objects: a block's
home node is its id modulo the node count (ids are hashes, so this is a uniform, deterministic
placement per chunk). A fetch moves each block from its home: from the fetching GPU's own node it
crosses that GPU's host link (PCIe) only; from another node it also crosses the home node's NIC
(send side) and the fetching node's NIC (receive side). A store copies the new blocks device→host
over the GPU's host link on the engine step (LMCache's ``wait_for_save``), then puts the remote
share to the home nodes over the NICs in the background, once the copy is in the host buffer.

A fetch follows the fetch-path profile (``fetch_path.FetchPath``): a lookup round trip and a cost
per LMCache chunk before any byte moves, then the bytes at no more than the path's per-request
throughput (a private resource shared by the fetch's parts), staged through host memory when the
path stages. LMCache retrieves and saves whole chunks of 256 tokens: a hit is rounded down to a
chunk boundary. Stored chunks become visible (tier and index) when their put completes, not before:
a request routed meanwhile misses them, as it would on a real store.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from smetric_lmc.index import TierIndex
from smetric_lmc.lab.sim.cache import Node, PrefixCache
from smetric_lmc.lab.sim.fetch_path import LMCACHE_CHUNK_TOKENS, FetchPath, load_fetch_path
from smetric_lmc.lab.sim.transfer import DoneFn, Network, Resource

CallAt = Callable[[float, Callable[[float], None]], None]
# (request's block ids, first block new to the tier, end): one request's share of a step's store
Put = tuple[np.ndarray, int, int]


class Links:
    """The resources of the cluster: PCIe per GPU (h2d, d2h) and NIC per node (rx, tx)."""

    def __init__(self, n_gpus: int, n_nodes: int, host_link_bps: float, nic_bps: float) -> None:
        self.h2d = [Resource(f"pcie{g}.h2d", host_link_bps) for g in range(n_gpus)]
        self.d2h = [Resource(f"pcie{g}.d2h", host_link_bps) for g in range(n_gpus)]
        self.rx = [Resource(f"nic{k}.rx", nic_bps) for k in range(n_nodes)]
        self.tx = [Resource(f"nic{k}.tx", nic_bps) for k in range(n_nodes)]


class GlobalTier:
    def __init__(
        self,
        capacity_blocks: float,
        index: TierIndex,
        net: Network,
        links: Links,
        bytes_per_block: float,
        fetch_path: FetchPath | None = None,
        call_at: CallAt | None = None,
        block_tokens: int = LMCACHE_CHUNK_TOKENS,
    ) -> None:
        self.index = index
        self.net = net
        self.links = links
        self.n_nodes = len(links.rx)
        self.bpb = bytes_per_block
        self.fp = fetch_path or load_fetch_path("line-rate")
        if call_at is None and (self.fp.lookup_s > 0 or self.fp.per_chunk_s > 0):
            raise ValueError("a fetch path with a lookup or per-chunk cost needs call_at")
        self.call_at = call_at
        # blocks per LMCache chunk: the workload's block may be smaller than the 256-token chunk
        self.chunk_blocks = max(1, LMCACHE_CHUNK_TOKENS // max(1, block_tokens))
        self.cache = PrefixCache(capacity_blocks, on_removed=self._removed)
        self.fetched_bytes = 0.0
        self.fetched_remote_bytes = 0.0
        self.stored_bytes = 0.0
        self.fetches = 0
        self.fetch_wait_s = 0.0  # summed over fetches: lookup to last byte

    def _removed(self, chain: np.ndarray, s: int, e: int) -> None:
        self.index.global_removed(chain[s:e].tolist())

    def homes(self, blocks: np.ndarray) -> np.ndarray:
        """Blocks per home node."""
        if self.n_nodes == 1:
            return np.array([len(blocks)])
        return np.bincount((blocks % np.uint64(self.n_nodes)).astype(np.int64), minlength=self.n_nodes)

    # ---- fetch ---------------------------------------------------------------------------------
    def lookup_pin(self, blocks: np.ndarray, after: int, now: float) -> tuple[int, Node | None]:
        """Leading blocks the tier holds; when that reaches past ``after``, the path is pinned (the
        fetch must not lose its source to eviction) and returned for ``unpin``."""
        node, got = self.cache.match(blocks)
        got -= got % self.chunk_blocks  # LMCache hits whole chunks only
        if got <= after:
            if got:
                self.cache.touch(node, now)
            return got, None
        self.cache.pin(node, now)
        return got, node

    def unpin(self, node: Node, now: float) -> None:
        self.cache.unpin(node, now)

    def chunk_floor(self, n: int) -> int:
        """``n`` blocks rounded down to whole LMCache chunks."""
        return n - n % self.chunk_blocks

    def fetch(self, gpu: int, node: int, blocks: np.ndarray, now: float, done: DoneFn) -> float:
        """Move ``blocks`` (the range to load) to ``gpu`` on ``node`` along the fetch path; returns
        the bytes. ``done(t)`` when the last byte is on the GPU."""
        per_home = self.homes(blocks)
        L = self.links
        fp = self.fp
        cap: tuple[Resource, ...] = ()
        if math.isfinite(fp.request_bps):
            cap = (Resource("fetch", fp.request_bps),)  # this request's retrieve pipe
        remote: list[tuple[float, tuple[Resource, ...]]] = []
        direct: list[tuple[float, tuple[Resource, ...]]] = []
        total = 0.0
        for home, nb in enumerate(per_home.tolist()):
            if not nb:
                continue
            nbytes = nb * self.bpb
            total += nbytes
            if home == node:
                direct.append((nbytes, (L.h2d[gpu], *cap)))
            else:
                self.fetched_remote_bytes += nbytes
                if fp.staged:
                    remote.append((nbytes, (L.rx[node], L.tx[home], *cap)))
                else:
                    direct.append((nbytes, (L.h2d[gpu], L.rx[node], L.tx[home], *cap)))
        self.fetched_bytes += total
        self.fetches += 1
        t0 = now

        def finished(t: float) -> None:
            self.fetch_wait_s += t - t0
            done(t)

        def transfer(t: float) -> None:
            if remote:  # staged: remote -> host buffer first, then everything host -> GPU
                self.net.start(t, remote, lambda t2: self.net.start(t2, [(total, (L.h2d[gpu], *cap))], finished))
            else:
                self.net.start(t, direct, finished)

        fixed = fp.fixed_s(-(-len(blocks) // self.chunk_blocks))
        if fixed > 0:
            assert self.call_at is not None
            self.call_at(now + fixed, transfer)
        else:
            transfer(now)
        return total

    # ---- store ---------------------------------------------------------------------------------
    def plan_store(self, blocks: np.ndarray, end: int) -> int:
        """First block of ``blocks[:end]`` the tier lacks now (LMCache skips chunks it holds): the
        put covers ``[p, end)``. Nothing changes until the put completes (``copy_out``)."""
        _, p = self.cache.match(blocks[:end])
        return min(p, end)

    def _commit(self, blocks: np.ndarray, end: int, now: float) -> None:
        """The put of ``blocks[:end]`` completed: hold it, visible to every instance from now on.
        Cut short when the tier cannot make room."""
        cache = self.cache
        node, p = cache.match(blocks[:end])
        if p >= end:
            cache.touch(node, now)
            return
        cache.pin(node, now)
        if not cache.make_room(end - p):
            end = p + max(0, int(cache.free))
        cache.unpin(node, now)
        if end > p:
            cache.insert(blocks, end, now)
            self.index.global_stored(blocks[p:end].tolist())

    def copy_out(self, gpu: int, node: int, puts: list[Put], now: float, done: Callable[[float], None]) -> float:
        """Device->host copy of the stored chunks (on the step: ``done`` ends it), then the put of
        their remote share to the home nodes in the background at no more than the path's put
        throughput. The chunks become visible when both are done. Returns the bytes."""
        L = self.links
        nblocks = sum(e - p for _, p, e in puts)
        nbytes = nblocks * self.bpb
        self.stored_bytes += nbytes
        bg: list[tuple[float, tuple[Resource, ...]]] = []
        if self.n_nodes > 1:
            per_home = sum(self.homes(b[p:e]) for b, p, e in puts)
            cap: tuple[Resource, ...] = ()
            if math.isfinite(self.fp.store_bps):
                cap = (Resource("put", self.fp.store_bps),)
            bg = [
                (nb * self.bpb, (L.tx[node], L.rx[home], *cap))
                for home, nb in enumerate(per_home.tolist())
                if nb and home != node
            ]

        def visible(t: float) -> None:
            for b, _, e in puts:
                self._commit(b, e, t)

        def copied(t: float) -> None:
            done(t)
            if bg:
                self.net.start(t, bg, visible)
            else:
                visible(t)

        self.net.start(now, [(nbytes, (L.d2h[gpu],))], copied)
        return nbytes
