"""The global KV tier: host memory pooled across nodes (LMCache + Mooncake Store), with its links.

Blocks are spread over the nodes' pools as Mooncake's default allocator spreads objects: a block's
home node is its id modulo the node count (ids are hashes, so this is a uniform, deterministic
placement per chunk). A fetch moves each block from its home: from the fetching GPU's own node it
crosses that GPU's host link (PCIe) only; from another node it also crosses the home node's NIC
(send side) and the fetching node's NIC (receive side). A store copies the new blocks device→host
over the GPU's host link on the engine step (LMCache's ``wait_for_save``), then puts the remote
share to the home nodes over the NICs in the background.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from smetric_lmc.index import TierIndex
from smetric_lmc.sim.cache import Node, PrefixCache
from smetric_lmc.sim.transfer import DoneFn, Network, Resource


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
    ) -> None:
        self.index = index
        self.net = net
        self.links = links
        self.n_nodes = len(links.rx)
        self.bpb = bytes_per_block
        self.cache = PrefixCache(capacity_blocks, on_removed=self._removed)
        self.fetched_bytes = 0.0
        self.fetched_remote_bytes = 0.0
        self.stored_bytes = 0.0

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
        if got <= after:
            if got:
                self.cache.touch(node, now)
            return got, None
        self.cache.pin(node, now)
        return got, node

    def unpin(self, node: Node, now: float) -> None:
        self.cache.unpin(node, now)

    def fetch(self, gpu: int, node: int, blocks: np.ndarray, now: float, done: DoneFn) -> float:
        """Move ``blocks`` (the range to load) to ``gpu`` on ``node``; returns the bytes."""
        per_home = self.homes(blocks)
        L = self.links
        parts: list[tuple[float, tuple[Resource, ...]]] = []
        total = 0.0
        for home, nb in enumerate(per_home.tolist()):
            if not nb:
                continue
            nbytes = nb * self.bpb
            total += nbytes
            if home == node:
                parts.append((nbytes, (L.h2d[gpu],)))
            else:
                self.fetched_remote_bytes += nbytes
                parts.append((nbytes, (L.h2d[gpu], L.rx[node], L.tx[home])))
        self.fetched_bytes += total
        self.net.start(now, parts, done)
        return total

    # ---- store ---------------------------------------------------------------------------------
    def store(self, blocks: np.ndarray, start: int, end: int, now: float) -> tuple[int, int]:
        """Hold ``blocks[:end]`` (the caller computed ``[start, end)``); returns the range that was
        new to the tier (what LMCache writes: chunks it already holds are skipped), possibly cut
        short when the tier cannot make room."""
        cache = self.cache
        node, p = cache.match(blocks[:end])
        if p >= end:
            cache.touch(node, now)
            return end, end
        cache.pin(node, now)
        if not cache.make_room(end - p):
            end = p + max(0, int(cache.free))
        cache.unpin(node, now)
        if end > p:
            cache.insert(blocks, end, now)
            self.index.global_stored(blocks[p:end].tolist())
        return p, end

    def copy_out(
        self, gpu: int, node: int, new: list[np.ndarray], now: float, done: Callable[[float], None]
    ) -> float:
        """Device→host copy of the stored blocks (on the step: ``done`` ends it) and the background
        put of their remote share to the home nodes. Returns the bytes."""
        L = self.links
        nblocks = sum(len(b) for b in new)
        nbytes = nblocks * self.bpb
        self.stored_bytes += nbytes
        if self.n_nodes > 1:
            per_home = sum(self.homes(b) for b in new)
            bg = [
                (nb * self.bpb, (L.tx[node], L.rx[home]))
                for home, nb in enumerate(per_home.tolist())
                if nb and home != node
            ]
            if bg:
                self.net.start(now, bg, None)
        self.net.start(now, [(nbytes, (L.d2h[gpu],))], done)
        return nbytes
