"""The global tier's retrieve path as LMCache runs it: lookup + per-chunk costs, the per-request
throughput cap, staging through host memory, and puts visible only once they complete.

RDMA NICs and GPUs cannot run here; the links are the simulator's modelled resources, and each
expected time below is computed from the named profile's sourced constants, not from the model."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest

from smetric_lmc.index import TierIndex
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.fetch_path import FetchPath, fetch_path_names, load_fetch_path
from smetric_lmc.lab.sim.global_tier import GlobalTier, Links
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.sim.transfer import Network

BS = 256  # one block = one LMCache chunk
PCIE = 50e9
NIC = 20e9


class Loop:
    """A minimal event loop: the network's wake-ups and delayed calls on one virtual clock."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.net = Network(lambda t, v: self.call_at(t, lambda tt: self.net.on_wake(tt, v)))

    def call_at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn))

    def run(self, until: float = math.inf) -> None:
        while self.heap and self.heap[0][0] <= until:
            t, _, fn = heapq.heappop(self.heap)
            self.now = t
            fn(t)


def tier(loop: Loop, fp: FetchPath, nodes: int = 1, bpb: float = BS * 98304.0) -> GlobalTier:
    index = TierIndex(BS, BS, clock=lambda: loop.now)
    links = Links(8 * nodes, nodes, PCIE, NIC)
    return GlobalTier(math.inf, index, loop.net, links, bpb, fetch_path=fp, call_at=loop.call_at, block_tokens=BS)


def fetch_time(gt: GlobalTier, loop: Loop, blocks: np.ndarray, gpu: int = 0, node: int = 0) -> float:
    out: list[float] = []
    gt.fetch(gpu, node, blocks, loop.now, out.append)
    loop.run()
    assert len(out) == 1
    return out[0]


@pytest.mark.parametrize("name", ["lmcache-mooncake-rdma", "lmcache-redis", "lmcache-local-cpu", "line-rate"])
def test_a_20k_token_fetch_takes_what_the_profile_implies(name: str) -> None:
    fp = load_fetch_path(name)
    loop = Loop()
    gt = tier(loop, fp)
    blocks = np.arange(80, dtype=np.uint64)  # 80 chunks = 20,480 tokens, all homed on this node
    nbytes = 80 * gt.bpb
    expected = fp.lookup_s + 80 * fp.per_chunk_s + nbytes / min(fp.request_bps, PCIE)
    assert fetch_time(gt, loop, blocks) == pytest.approx(expected, rel=1e-9)


def test_the_sourced_profiles_are_slower_than_line_rate() -> None:
    """The issue's figures: LMCache + Mooncake ~6.4 GB/s, LMCache remote (Redis) ~1.1 GB/s."""
    nbytes = 20_000 * 98304.0
    line = load_fetch_path("line-rate").unloaded_fetch_s(nbytes, 79, 21.75e9)
    moon = load_fetch_path("lmcache-mooncake-rdma").unloaded_fetch_s(nbytes, 79, 21.75e9)
    redis = load_fetch_path("lmcache-redis").unloaded_fetch_s(nbytes, 79, 21.75e9)
    assert moon > 3 * line and redis > 5 * moon
    # 64k tokens on the paper's model: the public 0.97 s remote hit the Mooncake profile is sourced from
    big = load_fetch_path("lmcache-mooncake-rdma").unloaded_fetch_s(65536 * 98304.0, 256)
    assert big == pytest.approx(0.97, abs=0.01)


def two_fetches(fp: FetchPath, gpus: tuple[int, int]) -> tuple[list[float], float]:
    """Two 40-chunk fetches started together on ``gpus`` of one node: their end times and bytes."""
    loop = Loop()
    gt = tier(loop, fp)
    done: list[float] = []
    for g in gpus:
        gt.fetch(g, 0, np.arange(40, dtype=np.uint64), 0.0, done.append)
    loop.run()
    return done, 40 * gt.bpb


def test_the_per_request_cap_is_per_request_not_shared() -> None:
    fp = FetchPath("t", lookup_s=0.0, per_chunk_s=0.0, request_gbs=10.0, store_gbs=math.inf, staged=False)
    # two GPUs of one node: each fetch capped at 10 GB/s, their PCIe links are separate
    done, nbytes = two_fetches(fp, (0, 1))
    assert done == pytest.approx([nbytes / 10e9] * 2)
    # the SAME GPU: 2 x 10 GB/s < 50 GB/s PCIe, so the caps bind, not the link
    done, nbytes = two_fetches(fp, (0, 0))
    assert done == pytest.approx([nbytes / 10e9] * 2)
    # with a cap above half the link, two fetches on one GPU share its PCIe instead
    fast = FetchPath("t2", lookup_s=0.0, per_chunk_s=0.0, request_gbs=40.0, store_gbs=math.inf, staged=False)
    done, nbytes = two_fetches(fast, (0, 0))
    assert done == pytest.approx([nbytes / (PCIE / 2)] * 2)


def test_lookup_and_per_chunk_costs_come_first() -> None:
    fp = FetchPath("t", lookup_s=0.003, per_chunk_s=0.0005, request_gbs=math.inf, store_gbs=math.inf, staged=False)
    loop = Loop()
    gt = tier(loop, fp)
    blocks = np.arange(10, dtype=np.uint64)
    assert fetch_time(gt, loop, blocks) == pytest.approx(0.003 + 10 * 0.0005 + 10 * gt.bpb / PCIE)


def test_a_staged_fetch_crosses_nic_then_pcie() -> None:
    """Two nodes, every block homed on the other one: staged = NIC then PCIe one after the other;
    unstaged = both at once (the slower link sets the time)."""
    blocks = np.arange(1, 40, 2, dtype=np.uint64)  # odd ids: home node 1; the fetch runs on node 0
    nbytes = len(blocks) * BS * 98304.0
    for staged, expected in ((True, nbytes / NIC + nbytes / PCIE), (False, nbytes / NIC)):
        fp = FetchPath("t", lookup_s=0.0, per_chunk_s=0.0, request_gbs=math.inf, store_gbs=math.inf, staged=staged)
        loop = Loop()
        gt = tier(loop, fp, nodes=2)
        assert fetch_time(gt, loop, blocks) == pytest.approx(expected, rel=1e-9)


def test_a_put_is_visible_only_when_it_completes() -> None:
    fp = FetchPath("t", lookup_s=0.0, per_chunk_s=0.0, request_gbs=math.inf, store_gbs=1.0, staged=False)
    loop = Loop()
    gt = tier(loop, fp, nodes=2)
    blocks = np.arange(20, dtype=np.uint64) + np.uint64(1000)  # half homed on each node
    assert gt.plan_store(blocks, 20) == 0
    step_end: list[float] = []
    gt.copy_out(0, 0, [(blocks, 0, 20)], 0.0, step_end.append)
    copy = 20 * gt.bpb / PCIE
    put = 10 * gt.bpb / 1e9  # the remote half at the 1 GB/s put cap
    loop.run(until=copy + put / 2)
    assert step_end == pytest.approx([copy])  # the step waited for the device->host copy only
    assert gt.cache.match(blocks)[1] == 0  # ... but nobody sees the chunks yet
    assert not gt.index.global_contains(int(blocks[0]))  # nor does the router's index
    loop.run()
    assert gt.cache.match(blocks)[1] == 20 and gt.index.global_contains(int(blocks[19]))
    assert loop.now == pytest.approx(copy + put)


def test_hits_and_stores_are_whole_chunks() -> None:
    loop = Loop()
    index = TierIndex(64, 64, clock=lambda: loop.now)
    gt = GlobalTier(math.inf, index, loop.net, Links(8, 1, PCIE, NIC), 64 * 98304.0,
                    fetch_path=load_fetch_path("line-rate"), call_at=loop.call_at, block_tokens=64)  # fmt: skip
    assert gt.chunk_blocks == 4
    blocks = np.arange(10, dtype=np.uint64)
    gt.cache.insert(blocks, 10, 0.0)
    got, node = gt.lookup_pin(blocks, 0, 0.0)
    assert got == 8 and node is not None  # 10 blocks of 64 tokens hold two whole 256-token chunks
    assert gt.chunk_floor(11) == 8


def test_unknown_fetch_path_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="known: " + ", ".join(fetch_path_names())):
        load_fetch_path("nvme-of")
    with pytest.raises(ValueError, match="unknown fetch_path"):
        load_sim_config(fetch_path="nvme-of")
    c = load_sim_config(fetch_gbs=0.5)
    assert c.fetch().request_gbs == 0.5 and c.fetch().lookup_s == load_fetch_path(c.fetch_path).lookup_s


def test_h20_prefill_matches_the_public_measurement() -> None:
    """64k tokens recomputed on H20 / Qwen3-Coder-30B-A3B: 15.2 s in the public agentic-KV benchmark."""
    prof = load_profile()
    t, ctx = 0.0, 0
    while ctx < 65536:
        n = min(prof.max_num_batched_tokens, 65536 - ctx)
        t += prof.iteration_time([(n, ctx)], 0, 0)
        ctx += n
    assert t == pytest.approx(15.2, rel=0.02)
