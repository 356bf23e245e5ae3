"""The simulator's KV-transfer model on hand-built cases with known answers: sync vs async loads,
same-node vs remote global hits, stores on the step, refetch after a local eviction, processor
sharing on links, saturation detection and the token-window imbalance.

GPUs and RDMA NICs cannot run here: transfer times come from the profile's link constants, and the
expected values below are computed from those constants, not from the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.cluster import Simulator, place_sessions, shared_depths
from smetric_lmc.lab.sim.config import global_capacity_blocks, load_sim_config
from smetric_lmc.lab.sim.metrics import imbalance, opening_imbalance
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.sim.sweep import Outcome, Point, SweepResult, peak_rows
from smetric_lmc.lab.sim.transfer import Network, Resource
from smetric_lmc.lab.workload import TraceRequest, TraceSession, Workload

BS = 64


def ids(n: int, key: int, step: int = 1) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * np.uint64(step) + np.uint64(key * 10_000_000)).astype(np.uint64)


def cfg(**kw: object):  # noqa: ANN201 - test helper
    # link physics: the line-rate fetch path (no lookup, no per-request cap); fetch paths: test_fetch_path.py
    base = dict(instances=1, rate=1.0, measure="run", seed=1, arrival="open", global_tier="full", fetch_path="line-rate")
    base.update(kw)
    return load_sim_config(**base)


def seed_global(sim: Simulator, blocks: np.ndarray) -> None:
    """Put ``blocks`` in the global tier before the run (as if another instance had stored them)."""
    assert sim.gtier is not None
    sim.gtier.cache.insert(blocks, len(blocks), 0.0)
    sim.index.global_stored(blocks.tolist())


def record(sim: Simulator, res, session: int, turn: int, idx: int | None = None) -> dict[str, float]:  # noqa: ANN001
    c = res.cols
    mask = (c["session"] == session) & (c["turn"] == turn)
    k = int(np.flatnonzero(mask)[0 if idx is None else idx])
    return {name: float(v[k]) for name, v in c.items()}


# ---- sync vs async load -------------------------------------------------------------------------
def decode_plus_fetch() -> Workload:
    """A long decode (request 0) running when a request whose 40-block prefix sits in the global
    tier arrives (request 1, t = 1 s)."""
    d = TraceRequest(0.0, 1000, 2000, ids(15, 2), turn=0)
    f = TraceRequest(1.0, 40 * BS + 17, 5, ids(40, 1), turn=0)
    return Workload("w", BS, [TraceSession("s", [d, f])])


def run_mode(mode: str):  # noqa: ANN201
    sim = Simulator(decode_plus_fetch(), cfg(kv_load_mode=mode), PolicyConfig(name="smetric"))
    seed_global(sim, ids(40, 1))
    res = sim.run()
    c = res.cols
    order = np.argsort(c["arrival"])
    dec, fet = (int(k) for k in order)
    return sim, res, c["finish"][dec], c["first_token"][fet] - c["arrival"][fet], c["global_tokens"][fet]


def test_sync_fetch_stalls_the_batch_async_does_not() -> None:
    prof = load_profile()
    transfer = 40 * BS * prof.kv_bytes_per_token / prof.host_link_bytes_per_s  # one node: PCIe only
    sync, res_s, dec_sync, ttft_sync, glob = run_mode("sync")
    asyn, res_a, dec_async, ttft_async, glob_a = run_mode("async")
    assert glob == glob_a == 40 * BS
    # the co-batched decode finishes later by exactly the transfer time under sync, not under async
    assert dec_sync - dec_async == pytest.approx(transfer, rel=1e-3)
    # stalls: the decode request's own store (its 15 blocks: 12 in whole 256-token LMCache chunks,
    # both modes) plus, under sync, the load
    store = 12 * BS * prof.kv_bytes_per_token / prof.host_link_bytes_per_s
    assert asyn.instances[0].stall_time == pytest.approx(store, rel=1e-6)
    assert sync.instances[0].stall_time == pytest.approx(store + transfer, rel=1e-6)
    # the fetching request itself waits in both modes
    assert ttft_async >= transfer and ttft_sync >= transfer
    assert res_s.summary["fetched_gb"] == pytest.approx(40 * BS * prof.kv_bytes_per_token / 1e9)
    assert res_s.summary["stall_share"] > res_a.summary["stall_share"] > 0.0


def one_fetch(mode: str, tier_ids: np.ndarray, profile_kw: dict | None = None, instances: int = 1):  # noqa: ANN201
    prof = load_profile().with_overrides(**(profile_kw or {}))
    req = TraceRequest(0.0, len(tier_ids) * BS + 17, 1, tier_ids, turn=0)
    wl = Workload("w", BS, [TraceSession("s", [req])])
    sim = Simulator(wl, cfg(kv_load_mode=mode, instances=instances), PolicyConfig(name="round_robin"), prof)
    seed_global(sim, tier_ids)
    res = sim.run()
    r = record(sim, res, 0, 0)
    return sim, prof, r["first_token"] - r["arrival"]


def test_layerwise_overlaps_load_with_compute() -> None:
    blocks = ids(40, 1)
    sim, prof, ttft = one_fetch("layerwise", blocks)
    transfer = 40 * BS * prof.kv_bytes_per_token / prof.host_link_bytes_per_s
    compute = prof.iteration_time([(17, 40 * BS)], 0, 0)
    assert ttft == pytest.approx(max(compute, transfer + compute / prof.layers), rel=1e-6)
    _, _, ttft_sync = one_fetch("sync", blocks)
    assert ttft_sync == pytest.approx(transfer + compute, rel=1e-6)


# ---- same node vs remote --------------------------------------------------------------------------
def test_same_node_hit_crosses_pcie_only_remote_also_the_nic() -> None:
    # one GPU per node, two nodes; round robin puts the only request on i000 (node 0). A block's home
    # node is its id mod 2: even ids live on node 0, odd ids on node 1.
    kw = {"gpus_per_node": 1}
    nbytes = 40 * BS * load_profile().kv_bytes_per_token
    local_ids = ids(40, 1, step=2)  # even
    remote_ids = local_ids + np.uint64(1)  # odd
    compute = load_profile().iteration_time([(17, 40 * BS)], 0, 0)

    sim, prof, ttft = one_fetch("sync", local_ids, kw, instances=2)
    assert sim.links.h2d[0].bytes == pytest.approx(nbytes)
    assert sim.links.rx[0].bytes == 0 and sim.links.tx[1].bytes == 0
    assert ttft == pytest.approx(nbytes / prof.host_link_bytes_per_s + compute, rel=1e-6)

    sim, prof, ttft = one_fetch("sync", remote_ids, kw, instances=2)
    assert sim.links.h2d[0].bytes == pytest.approx(nbytes)
    assert sim.links.rx[0].bytes == pytest.approx(nbytes) and sim.links.tx[1].bytes == pytest.approx(nbytes)
    # the slowest resource on the path sets the pace: the NIC (200 Gb/s x eff) < PCIe
    assert prof.link_bytes_per_s < prof.host_link_bytes_per_s
    assert ttft == pytest.approx(nbytes / prof.link_bytes_per_s + compute, rel=1e-6)


# ---- stores ---------------------------------------------------------------------------------------
def test_store_is_charged_on_the_step() -> None:
    prof = load_profile()
    req = TraceRequest(0.0, 5000, 1, ids(5000 // BS, 1), turn=0)
    wl = Workload("w", BS, [TraceSession("s", [req])])
    compute = prof.iteration_time([(5000, 0)], 0, 0)
    stored_blocks = (5000 // 256) * 256 // BS  # whole 256-token LMCache chunks only
    store = stored_blocks * BS * prof.kv_bytes_per_token / prof.host_link_bytes_per_s
    ttft = {}
    for tier, mode in (("none", "sync"), ("full", "sync"), ("full", "layerwise")):
        sim = Simulator(wl, cfg(global_tier=tier, kv_load_mode=mode), PolicyConfig(name="smetric"), prof)
        res = sim.run()
        ttft[tier, mode] = res.summary["ttft_p50"]
        if tier == "full":
            assert res.summary["stored_gb"] == pytest.approx(store * prof.host_link_bytes_per_s / 1e9)
            assert sim.gtier is not None and sim.gtier.cache.used == stored_blocks
    assert ttft["none", "sync"] == pytest.approx(compute)
    assert ttft["full", "sync"] == pytest.approx(compute + store)  # wait_for_save on the step
    assert ttft["full", "layerwise"] == pytest.approx(max(compute, store + compute / prof.layers))


def test_only_blocks_new_to_the_global_tier_are_stored() -> None:
    prof = load_profile()
    blocks = ids(60, 1)
    req = TraceRequest(0.0, 60 * BS + 10, 1, blocks, turn=0)
    sim = Simulator(Workload("w", BS, [TraceSession("s", [req])]), cfg(), PolicyConfig(name="smetric"), prof)
    seed_global(sim, blocks[:40])
    res = sim.run()
    # 40 blocks loaded, 20 computed and stored
    assert res.summary["fetched_gb"] == pytest.approx(40 * BS * prof.kv_bytes_per_token / 1e9)
    assert res.summary["stored_gb"] == pytest.approx(20 * BS * prof.kv_bytes_per_token / 1e9)


# ---- refetch after a local eviction -------------------------------------------------------------------
def test_prefix_evicted_after_routing_is_refetched_not_recomputed() -> None:
    # One instance running one request at a time. a0 leaves 40 blocks (locally and, stored, in the
    # global tier). While C decodes, B and then a1 queue; a1 is routed while a0's blocks are still
    # on the GPU. B is admitted first and needs nearly all GPU KV: a0's blocks are evicted before a1
    # is admitted.
    prof = load_profile().with_overrides(hbm_gib=72.0, max_num_seqs=1)
    cap = prof.gpu_capacity_blocks(BS)
    a = ids(60, 1)
    reqs = [
        TraceRequest(0.0, 40 * BS, 1, a[:40], turn=0),
        TraceRequest(1.0, 1000, 3000, ids(15, 3), turn=0),
        TraceRequest(2.0, (cap - 2) * BS, 5, ids(cap - 2, 4), turn=0),
        TraceRequest(3.0, 50 * BS, 5, a[:50], turn=1),
    ]
    wl = Workload("w", BS, [TraceSession("s", reqs)])
    out = {}
    for tier in ("full", "none"):
        sim = Simulator(wl, cfg(global_tier=tier), PolicyConfig(name="smetric"), prof)
        routed = {}
        route = sim.router.route

        def spy(rid, *args, _route=route, _seen=routed, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            d = _route(rid, *args, **kw)
            _seen[rid] = d
            return d

        sim.router.route = spy  # type: ignore[method-assign]
        res = sim.run()
        assert routed["0:3"].local_hit_tokens == 40 * BS  # held when routed
        out[tier] = record(sim, res, 0, 1)
    assert out["full"]["local_tokens"] == 0 and out["full"]["global_tokens"] == 40 * BS
    assert out["none"]["local_tokens"] == 0 and out["none"]["global_tokens"] == 0


# ---- processor sharing ------------------------------------------------------------------------------
def test_links_are_processor_shared() -> None:
    events: list[tuple[float, int]] = []
    net = Network(lambda t, v: events.append((t, v)))
    a, b = Resource("a", 10.0), Resource("b", 100.0)
    done: dict[str, float] = {}

    def run_until_idle() -> None:
        while events:
            events.sort()
            t, v = events.pop(0)
            net.on_wake(t, v)

    net.start(0.0, [(100.0, (a,))], lambda t: done.setdefault("x", t))
    net.start(0.0, [(50.0, (a, b))], lambda t: done.setdefault("y", t))
    net.start(0.0, [(100.0, (b,))], lambda t: done.setdefault("z", t))
    run_until_idle()
    # a is shared by x and y (5 B/s each): y ends at 10; x then runs alone: 50 left at 10 B/s
    assert done["y"] == pytest.approx(10.0)
    assert done["x"] == pytest.approx(15.0)
    # z shares b with y (50 B/s) until 10 s: 500 B > 100 B, so it ends at 2 s
    assert done["z"] == pytest.approx(2.0)
    assert a.busy_s == pytest.approx(15.0) and b.busy_s == pytest.approx(10.0)


# ---- capacity, sampling ----------------------------------------------------------------------------
def test_full_global_tier_is_the_nodes_host_pools() -> None:
    prof = load_profile()
    got = global_capacity_blocks("full", prof, BS, 32, 4)
    assert got == 4 * int(prof.host_pool_gib_per_node * 1024**3 / prof.kv_bytes_per_token // BS)
    assert global_capacity_blocks("none", prof, BS, 32, 4) is None
    assert global_capacity_blocks("0.4", prof, BS, 32, 4) == pytest.approx(0.4 * 32 * prof.local_capacity_blocks(BS))


def test_sampling_with_replacement_keeps_the_rate_and_separates_copies() -> None:
    shared = ids(10, 9)
    sessions = []
    for k in range(3):
        own = np.concatenate([shared, ids(20, k + 1)])
        sessions.append(TraceSession(f"s{k}", [TraceRequest(0.0, 30 * BS, 5, own, turn=0)]))
    wl = Workload("w", BS, sessions)
    pl = place_sessions(wl, rate=2.0, seed=3, max_sessions=None, sampling="replace", window_s=500.0)
    assert 900 < len(pl.roots) < 1100  # Poisson(1000) from a pool of 3
    assert max(c for _, _, c in pl.roots) > 100
    assert shared_depths(wl) == {"s0": 10, "s1": 10, "s2": 10}
    c = load_sim_config(instances=2, rate=0.05, sampling="replace", arrival_window_s=200.0, measure="run", seed=3)
    sim = Simulator(wl, c, PolicyConfig(name="smetric"))
    res = sim.run()
    assert res.summary["requests"] > 3
    # copies share the 10 common blocks and nothing else: every request hits at most those
    assert res.cols["local_tokens"].max() <= 10 * BS


# ---- saturation and imbalance ------------------------------------------------------------------------
def test_busy_share_and_saturation_flag() -> None:
    prof = load_profile()
    # two requests 100 s apart on one instance: busy share = work / span, known from the profile
    r0 = TraceRequest(0.0, 5000, 11, ids(78, 1), turn=0)
    r1 = TraceRequest(100.0, 5000, 11, ids(78, 2), turn=0)
    wl = Workload("w", BS, [TraceSession("s", [r0, r1])])
    work = prof.iteration_time([(5000, 0)], 0, 0) + float(prof.decode_run_times(1, 5001, 10)[-1])
    res = Simulator(wl, cfg(global_tier="none"), PolicyConfig(name="smetric")).run()
    s = res.summary
    assert s["duration_s"] == pytest.approx(100.0 + work)
    assert s["gpu_busy_share"] == pytest.approx(2 * work / (100.0 + work), rel=1e-6)
    assert not s["saturated"]
    assert s["req_per_min_per_instance"] == pytest.approx(2 / ((100.0 + work) / 60))
    # back to back: the engine never idles
    r1b = TraceRequest(0.0, 5000, 11, ids(78, 2), turn=0)
    wl = Workload("w", BS, [TraceSession("s", [r0, r1b])])
    busy = Simulator(wl, cfg(global_tier="none"), PolicyConfig(name="smetric")).run()
    assert busy.summary["gpu_busy_share"] == pytest.approx(1.0)
    assert busy.summary["saturated"]
    # the sweep's peak rows flag a peak below the knee
    sr = SweepResult("load", [
        Outcome(Point("load", "x", cfg(rate=0.1), PolicyConfig(name="smetric")), res),
        Outcome(Point("load", "x", cfg(rate=0.2), PolicyConfig(name="load_balance")), busy),
    ])  # fmt: skip
    rows = {r.policy: r for r in peak_rows(sr)}
    assert rows["smetric"].below_knee and not rows["load_balance"].below_knee
    assert not rows["smetric"].knee_reached and rows["load_balance"].knee_reached
    assert rows["smetric"].gpu_busy_share == s["gpu_busy_share"]


def test_token_window_imbalance() -> None:
    # windows x instances: tokens processed; max/mean per window, averaged over steady windows
    win = np.array([[30, 10], [20, 20], [0, 0], [1, 0]])
    got = imbalance(win)
    # totals 40, 40, 0, 1: the last is ramp-down (< half of the 90th percentile), the empty one is skipped
    assert got["windows"] == 2
    assert got["mean"] == pytest.approx((30 / 20 + 1.0) / 2)
    # in a simulation: one instance does all the work of a lone request -> max/mean = instances
    req = TraceRequest(0.0, 5000, 11, ids(78, 1), turn=0)
    res = Simulator(Workload("w", BS, [TraceSession("s", [req])]), cfg(instances=4, global_tier="none"),
                    PolicyConfig(name="smetric")).run()  # fmt: skip
    assert res.summary["imbalance_mean"] == pytest.approx(4.0)
    assert res.win_tokens.sum() == 5000 + 10


def test_opening_imbalance_reads_the_first_ten_minutes_ramp_included() -> None:
    # 60 s windows: a ramp-up minute (one busy instance of two), steady minutes, an empty one, and
    # minutes past the first ten that do not count
    win = np.array([[4, 0], [30, 10], [20, 20], [0, 0]] + [[10, 10]] * 6 + [[100, 0]] * 3)
    got = opening_imbalance(win, 60.0)
    assert got == pytest.approx((2.0 + 1.5 + 1.0 + 6 * 1.0) / 9)  # the ramp-up minute counts, the empty one not
    assert opening_imbalance(win, 30.0, span_s=60.0) == pytest.approx((2.0 + 1.5) / 2)
    assert imbalance(win)["mean"] != pytest.approx(got)  # the steady-window figure leaves the ramp out


def test_inflight_token_load_integrates_over_windows() -> None:
    from smetric_lmc.lab.sim.token_load import InflightTokens

    tl = InflightTokens(2, 10.0)
    tl.add(0, 5.0, 100)  # 100 tokens on instance 0 from t=5 to t=25
    tl.add(1, 0.0, 50)  # 50 on instance 1 throughout
    tl.add(0, 25.0, -100)
    w = tl.windows(30.0)
    assert w.shape == (3, 2)
    assert w[:, 0] == pytest.approx([50.0, 100.0, 50.0])  # half, whole, half a window
    assert w[:, 1] == pytest.approx([50.0, 50.0, 50.0])


@pytest.mark.parametrize("pd", [False, True])
def test_inflight_token_load_of_a_run_drains_to_zero(pd: bool) -> None:
    # a lone request: all load on one of four instances while it is in flight -> max/mean = 4
    reqs = [TraceRequest(0.0, 5000, 11, ids(78, 1), turn=0), TraceRequest(2.0, 9000, 40, ids(140, 1), turn=1)]
    sim = Simulator(Workload("w", BS, [TraceSession("a", reqs)]), cfg(instances=4, global_tier="none", pd=pd),
                    PolicyConfig(name="smetric"))  # fmt: skip
    res = sim.run()
    assert res.summary["load_imbalance_mean"] == pytest.approx(4.0)
    assert sim.tok_load.cur == [0, 0, 0, 0]  # every token added on routing and decoding left on finishing


def test_load_sweep_extends_until_the_gpus_saturate() -> None:
    from smetric_lmc.lab.sim.sweep import sweep

    sessions = [TraceSession(f"s{k}", [TraceRequest(0.0, 5000, 11, ids(78, k + 1), turn=0)]) for k in range(3)]
    wl = Workload("w", BS, sessions)
    base = load_sim_config(instances=1, rate=0.05, sampling="replace", arrival_window_s=300.0, seed=2)
    sr = sweep(wl, "load", base, ["load_balance"], [0.05], extend_to_knee=10)
    rates = sorted(o.point.cfg.rate for o in sr.outcomes)
    busy = {o.point.cfg.rate: o.result.summary["gpu_busy_share"] for o in sr.outcomes}
    # doubled until the top run kept the GPU at least 80% busy, and not beyond
    assert rates == [0.05 * 2**k for k in range(len(rates))]
    assert busy[rates[-1]] >= 0.8 > busy[rates[-2]]
    row = peak_rows(sr)[0]
    assert row.policy == "load_balance" and row.gpu_busy_share == busy[row.rate]


def test_generated_blocks_stay_on_the_gpu_not_in_the_global_tier() -> None:
    # turn 0: 40 blocks + 17 tokens, 50 generated -> block 40 is full of prompt tail + answer; turn 1
    # resends it (its ids continue turn 0's)
    a = ids(60, 1)
    reqs = [TraceRequest(0.0, 40 * BS + 17, 50, a[:40], turn=0),
            TraceRequest(30.0, 60 * BS, 5, a, think_time=5.0, turn=1)]  # fmt: skip
    sim = Simulator(Workload("w", BS, [TraceSession("s", reqs)]), cfg(arrival="closed"), PolicyConfig(name="smetric"))
    routed = {}
    route = sim.router.route

    def spy(rid, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        routed[rid] = route(rid, *args, **kw)
        return routed[rid]

    sim.router.route = spy  # type: ignore[method-assign]
    res = sim.run()
    assert routed["0:1"].local_hit_tokens == 41 * BS  # prompt + the full answer block
    assert routed["0:1"].global_hit_tokens == 40 * BS  # LMCache saved the prompt only
    r1 = record(sim, res, 0, 1)
    assert r1["local_tokens"] == 41 * BS and r1["global_tokens"] == 0


def test_explicit_sim_config_path_must_exist(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="cannot read"):
        load_sim_config(tmp_path / "missing.yaml")
    (tmp_path / "sim.yaml").write_text("instances: 3\nkv_load_mode: layerwise\n")
    c = load_sim_config(tmp_path / "sim.yaml")
    assert c.instances == 3 and c.kv_load_mode == "layerwise"
    with pytest.raises(ValueError, match="kv_load_mode"):
        load_sim_config(kv_load_mode="eager")


def test_warmup_share_leaves_the_ramp_out_of_the_measurement() -> None:
    prof = load_profile()
    # three lone requests far apart on one instance (no overlap): busy time inside the measured window
    # [first + share x (last - first), last] is the work of the requests that start inside it
    sessions = [TraceSession(f"s{k}", [TraceRequest(0.0, 5000, 11, ids(78, k + 1), turn=0)]) for k in range(3)]
    wl = Workload("w", BS, sessions)
    work = prof.iteration_time([(5000, 0)], 0, 0) + float(prof.decode_run_times(1, 5001, 10)[-1])
    got = {}
    for share in (0.0, 0.6):
        c = load_sim_config(instances=2, rate=0.01, seed=5, global_tier="none", warmup_share=share)
        sim = Simulator(wl, c, PolicyConfig(name="load_balance"))
        res = sim.run()
        starts = sorted(t for _, t, _ in place_sessions(wl, 0.01, 5, None).roots)
        assert np.diff(starts).min() > 10 * work  # the case is what it claims: no two requests overlap
        w0 = starts[0] + share * (starts[-1] - starts[0])
        assert sim.measure_from == pytest.approx(w0)
        inside = [t for t in starts[:-1] if t >= w0]  # the last starts at the window's end
        dur = starts[-1] - w0
        s = res.summary
        assert s["gpu_busy_share"] == pytest.approx(len(inside) * work / (2 * dur), rel=1e-6)
        # two instances, one request at a time: the busiest holds at least half the busy time
        assert s["gpu_busy_max"] >= s["gpu_busy_share"]
        assert s["req_per_min_per_instance"] == pytest.approx((len(inside) + 1) / (dur / 60) / 2)
        got[share] = len(inside)
    assert got[0.0] == 2 and got[0.6] <= 1


def test_warmup_share_is_validated() -> None:
    with pytest.raises(ValueError, match="warmup_share"):
        load_sim_config(warmup_share=1.0)


def test_a_fork_starting_past_turn_zero_is_sticky_to_its_own_first_instance() -> None:
    """A sub-agent or fork carries its parent's turns (its first request has turn > 0): its first
    request places it; its follow-ups count against that instance (they used to count as moved)."""
    a = TraceRequest(0.0, 600, 5, ids(9, 1), turn=3)
    b = TraceRequest(1.0, 700, 5, ids(10, 1), turn=4)
    sim = Simulator(Workload("w", BS, [TraceSession("fork", [a, b])]), cfg(global_tier="none"),
                    PolicyConfig(name="smetric"))  # fmt: skip
    res = sim.run()
    assert res.summary["stickiness"] == 1.0
    assert sorted(res.cols["sticky"].tolist()) == [-1, 1]
