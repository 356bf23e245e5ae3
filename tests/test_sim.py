"""Trace-driven cluster simulator: conservation, SLO accounting, routing scenarios, determinism."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.cluster import Simulator, simulate
from smetric_lmc.lab.sim.config import SLO, load_sim_config
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.workload import TraceRequest, TraceSession, Workload, synthetic

BS = 64


def ids(n: int, key: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) + np.uint64(key) * np.uint64(10_000_000) + np.uint64(7)).astype(np.uint64)


def agent_session(name: str, key: int, turns: int, first: int = 40, grow: int = 20, out: int = 50,
                  think: float = 1.0, gap: float = 10.0) -> TraceSession:  # fmt: skip
    base = ids(first + grow * turns, key)
    reqs = []
    for k in range(turns):
        n = first + grow * k
        reqs.append(TraceRequest(arrival=k * gap, input_tokens=n * BS + 17, output_tokens=out,
                                 block_ids=base[:n], think_time=think, turn=k))  # fmt: skip
    return TraceSession(name, reqs)


def toy(n_sessions: int = 12, turns: int = 6) -> Workload:
    return Workload("toy", BS, [agent_session(f"s{k}", k + 1, turns) for k in range(n_sessions)])


def cfg(**kw: object):  # noqa: ANN201 - test helper
    base = dict(instances=4, rate=0.5, measure="run", seed=1)
    base.update(kw)
    return load_sim_config(**base)


def check_conservation(sim: Simulator, res) -> None:  # noqa: ANN001
    c = res.cols
    served = ~c["rejected"].astype(bool)
    # every request of every placed session is recorded exactly once
    keys = list(zip(c["session"].tolist(), c["turn"].tolist(), c["arrival"].tolist()))
    assert len(keys) == len(set(keys))
    # per request: local + global + recomputed = input tokens, with at least one token computed
    miss = c["input"] - c["local_tokens"] - c["global_tokens"]
    assert (miss[served] >= 1).all()
    assert (c["local_tokens"] >= 0).all() and (c["global_tokens"] >= 0).all()
    # the engines processed exactly the recomputed prompt tokens plus the decode tokens
    decode = 0 if sim.cfg.pd else int((c["output"][served] - 1).sum())
    assert int(res.win_tokens.sum()) == int(miss[served].sum()) + decode
    # nothing is left in flight, pinned or reserved, and the index agrees with every cache
    assert len(sim.load) == 0
    for inst in sim.instances:
        assert not inst.waiting and inst.n_running == 0
        assert inst.cache.reserved == 0 and inst.running_blocks == 0
        assert all(n.ref == 0 for n in inst.cache.nodes())
        assert inst.cache.used == inst.cache.held_blocks() <= inst.cache.capacity
        assert sim.index.gpu_blocks_of(inst.iid) == inst.cache.used
    if sim.gtier is not None:
        assert sim.index.sizes()["global_chunks"] == sim.gtier.cache.used
        assert all(n.ref == 0 for n in sim.gtier.cache.nodes())  # no fetch left its source pinned


@pytest.mark.parametrize("policy", ["smetric", "load_balance", "round_robin", "dynamo"])
@pytest.mark.parametrize("tier", ["none", "0.4", "full"])
def test_conservation(policy: str, tier: str) -> None:
    prof = load_profile().with_overrides(hbm_gib=72.0)  # small KV: evictions happen
    wl = toy()
    sim = Simulator(wl, cfg(global_tier=tier), PolicyConfig(name=policy), prof)
    res = sim.run()
    assert res.summary["requests"] == wl.n_requests
    check_conservation(sim, res)


@pytest.mark.parametrize("mode", ["async", "layerwise"])
@pytest.mark.parametrize("policy", ["smetric", "load_balance"])
def test_conservation_other_load_modes(policy: str, mode: str) -> None:
    prof = load_profile().with_overrides(hbm_gib=72.0, gpus_per_node=2)  # evictions, 2 nodes
    wl = toy()
    # rate 2: busy enough that smetric's sessions move (an idle toy cluster with first turns spread
    # evenly keeps every session sticky, and nothing is fetched from the global tier)
    sim = Simulator(wl, cfg(global_tier="0.4", kv_load_mode=mode, rate=2.0), PolicyConfig(name=policy), prof)
    res = sim.run()
    assert res.summary["requests"] == wl.n_requests
    assert res.summary["hit_global"] > 0 and res.summary["stored_gb"] > 0
    check_conservation(sim, res)
    assert all(not i.loading for i in sim.instances) and sim.net.active == 0


def test_pd_mode_runs_and_conserves() -> None:
    wl = toy()
    sim = Simulator(wl, cfg(pd=True, global_tier="full"), PolicyConfig(name="smetric"))
    res = sim.run()
    check_conservation(sim, res)
    s = res.summary
    assert s["pd"] and s["prefill_tps_slo"] > 0
    assert all(i.iterations > 0 for i in sim.instances if i.busy_time > 0)


def one_request(input_tokens: int, output_tokens: int) -> Workload:
    r = TraceRequest(arrival=0.0, input_tokens=input_tokens, output_tokens=output_tokens,
                     block_ids=ids(input_tokens // BS, 1), turn=0)  # fmt: skip
    return Workload("one", BS, [TraceSession("a", [r])])


def test_slo_accounting_single_request() -> None:
    prof = load_profile()
    wl = one_request(5000, 11)
    ttft = prof.iteration_time([(5000, 0)], 0, 0)
    decode = float(prof.decode_run_times(1, 5001, 10)[-1])
    tpot = decode / 10
    # TTFT within a + b*L and TPOT within the limit: all 5011 tokens count
    ok = simulate(wl, cfg(instances=1, slo=SLO(ttft_base_s=ttft * 1.01, ttft_per_token_s=0.0, tpot_s=tpot * 1.01)))
    s = ok.summary
    assert s["ttft_p50"] == pytest.approx(ttft)
    assert s["tpot_p50"] == pytest.approx(tpot)
    assert s["duration_s"] == pytest.approx(ttft + decode)
    assert s["tps_slo"] == pytest.approx(5011 / (ttft + decode))
    # TTFT just over its limit (through the per-token term): nothing counts
    late = simulate(wl, cfg(instances=1, slo=SLO(ttft_base_s=0.0, ttft_per_token_s=ttft / 5000 * 0.99, tpot_s=1.0)))
    assert late.summary["tps_slo"] == 0 and late.summary["tps"] > 0
    # TPOT over its limit: nothing counts either, but the prefill still meets TTFT
    slow = simulate(wl, cfg(instances=1, slo=SLO(ttft_base_s=100.0, ttft_per_token_s=0.0, tpot_s=tpot * 0.99)))
    assert slow.summary["tps_slo"] == 0 and slow.summary["ttft_attainment"] == 1.0


def test_too_long_request_is_rejected_and_session_goes_on() -> None:
    prof = load_profile()
    big = prof.max_context(BS) + BS
    reqs = [
        TraceRequest(0.0, big, 10, ids(big // BS, 1), turn=0),
        TraceRequest(5.0, 1000, 10, ids(15, 2), think_time=1.0, turn=0),
    ]
    res = simulate(Workload("w", BS, [TraceSession("a", reqs)]), cfg(instances=1))
    assert res.summary["rejected"] == 1 and res.summary["requests"] == 2
    assert res.summary["tps"] > 0


def routed_reasons(sim: Simulator) -> dict[tuple[int, int], tuple[str, int, int]]:
    c = sim.rec.columns()
    return {
        (int(s), int(t)): (reason, int(inst), int(loc))
        for s, t, reason, inst, loc in zip(c["session"], c["turn"], sim.rec.reasons, c["instance"], c["local_tokens"])
    }


def test_follow_up_sticks() -> None:
    wl = Workload("w", BS, [agent_session("a", 1, 3), agent_session("b", 2, 3)])
    sim = Simulator(wl, cfg(instances=4, rate=10.0), PolicyConfig(name="smetric"))
    sim.run()
    got = routed_reasons(sim)
    for s in (0, 1):
        first_inst = got[(s, 0)][1]
        for t in (1, 2):
            reason, inst, local = got[(s, t)]
            assert reason == "sticky" and inst == first_inst
            # the previous prompt's blocks plus the full blocks of its answer, which vLLM's
            # prefix cache keeps (the next prompt resends the answer)
            prev_input = (40 + 20 * (t - 1)) * BS + 17
            assert local == (prev_input + 50) // BS * BS


def test_overloaded_instance_sheds_the_session() -> None:
    # Open loop: the follow-up arrives while the first request still decodes on its instance, whose
    # load (1) is above OVERLOAD x mean (2 x 1/4).
    s = agent_session("a", 1, 2, out=3000, gap=1.0)
    wl = Workload("w", BS, [s])
    sim = Simulator(wl, cfg(instances=4, arrival="open"), PolicyConfig(name="smetric"))
    sim.run()
    got = routed_reasons(sim)
    assert got[(0, 1)][0] == "overloaded_fallback"
    assert got[(0, 1)][1] != got[(0, 0)][1]
    # never shedding: it sticks instead
    sim = Simulator(wl, cfg(instances=4, arrival="open"), PolicyConfig(name="smetric", overload=float("inf")))
    sim.run()
    got = routed_reasons(sim)
    assert got[(0, 1)][0] == "sticky" and got[(0, 1)][1] == got[(0, 0)][1]


def evicting_workload(prof) -> Workload:  # noqa: ANN001
    cap = prof.gpu_capacity_blocks(BS)
    a = agent_session("a", 1, 2, first=40, grow=10, out=5, think=200.0)
    # b runs while a thinks and needs (almost) the whole KV: a's blocks are evicted
    b_len = cap - 1
    b = TraceSession("b", [TraceRequest(0.0, b_len * BS, 5, ids(b_len, 2), turn=0)])
    return Workload("w", BS, [a, b])


def small_kv_profile():  # noqa: ANN201
    prof = load_profile().with_overrides(hbm_gib=72.0)
    assert 200 < prof.gpu_capacity_blocks(BS) < 2000
    return prof


def test_evicted_session_is_rebalanced_and_recomputed_without_global_tier() -> None:
    prof = small_kv_profile()
    wl = evicting_workload(prof)
    # one instance: where it goes is forced, why it goes there is the policy's evicted path
    sim = Simulator(wl, cfg(instances=1, rate=1e3), PolicyConfig(name="smetric"), prof)
    res = sim.run()
    got = routed_reasons(sim)
    reason, _, local = got[(0, 1)]
    assert reason == "evicted_fallback" and local == 0
    c = res.cols
    k = int(np.flatnonzero((c["session"] == 0) & (c["turn"] == 1))[0])
    assert c["global_tokens"][k] == 0  # no global tier: the whole prompt is recomputed
    check_conservation(sim, res)
    # with a global tier the evicted prefix is fetched instead of recomputed
    sim = Simulator(wl, cfg(instances=1, rate=1e3, global_tier="full"), PolicyConfig(name="smetric"), prof)
    res = sim.run()
    c = res.cols
    k = int(np.flatnonzero((c["session"] == 0) & (c["turn"] == 1))[0])
    assert c["global_tokens"][k] == 40 * BS and c["local_tokens"][k] == 0
    assert res.summary["fetched_gb"] > 0
    check_conservation(sim, res)


def test_seed_determinism() -> None:
    wl = toy()
    a = simulate(wl, cfg(rate=0.3, seed=5), "smetric")
    b = simulate(wl, cfg(rate=0.3, seed=5), "smetric")
    c = simulate(wl, cfg(rate=0.3, seed=6), "smetric")
    for k in a.cols:
        np.testing.assert_array_equal(a.cols[k], b.cols[k])
    assert a.summary == b.summary
    assert not np.array_equal(a.cols["arrival"], c.cols["arrival"])


def test_synthetic_all_policies_run() -> None:
    wl = synthetic(30, seed=3, scale=0.1)
    tps, imb = {}, {}
    for p in ("smetric", "cache_first", "bailian", "lmetric", "load_balance"):
        sim = Simulator(wl, cfg(instances=4, rate=0.2, global_tier="0.8"), PolicyConfig(name=p))
        res = sim.run()
        check_conservation(sim, res)
        tps[p] = res.summary["tps"]
        imb[p] = res.summary["inflight_imbalance_mean"]
    assert all(v > 0 for v in tps.values())
    # every synthetic session starts with the same framework prompt: pure cache affinity herds
    # them onto its holder, join-shortest-queue does not
    assert imb["cache_first"] > 2.0 > imb["load_balance"]


def shared_dir() -> Path:
    return Path(os.environ.get("SMETRIC_SHARED", Path(__file__).resolve().parents[1] / ".." / "shared"))


def test_weka_subset_replay() -> None:
    archive = shared_dir() / "traces" / "weka-claude-code.tar.xz"
    if not archive.exists():
        pytest.skip(f"WEKA trace not found at {archive} (set SMETRIC_SHARED)")
    from smetric_lmc.lab.workload import load_weka

    wl = load_weka(archive, limit=6, progress=False)
    sim = Simulator(wl, cfg(instances=4, rate=0.01, global_tier="0.8"), PolicyConfig(name="smetric"))
    res = sim.run()
    check_conservation(sim, res)
    s = res.summary
    assert s["requests"] == wl.n_requests
    assert s["hit_local"] + s["hit_global"] > 0.5  # agent sessions resend their history


def test_subagent_starts_when_the_spawning_parent_request_completes() -> None:
    parent = agent_session("p", 1, 3, gap=100.0)
    child = agent_session("p/c", 2, 2)
    child.parent_id = "p"
    child.start_offset = 150.0  # recorded while the parent's request 1 (t=100) was in progress
    sim = Simulator(Workload("w", BS, [parent, child]), cfg(instances=2), PolicyConfig(name="smetric"))
    res = sim.run()
    c = res.cols
    by = {(int(s), int(t)): k for k, (s, t) in enumerate(zip(c["session"], c["turn"]))}
    # the parent is session 0 (placed first); the child is created later as session 1
    assert c["arrival"][by[(1, 0)]] == pytest.approx(c["finish"][by[(0, 1)]])
    # open loop: at its recorded offset from the root's start
    sim = Simulator(Workload("w", BS, [parent, child]), cfg(instances=2, arrival="open"), PolicyConfig(name="smetric"))
    res = sim.run()
    c = res.cols
    starts = sorted(set(c["arrival"].tolist()))
    root_start = float(c["arrival"][(c["turn"] == 0)].min())
    assert root_start + 150.0 in [pytest.approx(x) for x in starts]


def test_sim_modules_import_without_cycles() -> None:
    # every import between smetric_lmc.lab.sim modules, TYPE_CHECKING ones included, absolute only
    import ast

    import smetric_lmc.lab.sim as pkg

    root = Path(pkg.__file__).parent
    graph: dict[str, set[str]] = {}
    for f in root.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{f.name}: relative import"
                mod = node.module or ""
                if mod.startswith("smetric_lmc.lab.sim."):
                    deps.add(mod.split(".")[2])
        graph[f.stem] = deps
    assert {"engine", "cluster", "metrics"} <= set(graph)
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import cycle: {' -> '.join(path + (m,))}"
        if m in done:
            return
        for d in graph.get(m, ()):
            visit(d, path + (m,))
        done.add(m)

    for m in graph:
        visit(m, ())
