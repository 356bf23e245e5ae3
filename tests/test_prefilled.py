"""Prefill progress in the load accounting: the live controller (prefilled reports over the wire)
and the simulator account the same sequence of events identically."""

from __future__ import annotations

from typing import Any

import numpy as np
from service_helpers import ServiceThread

from smetric_lmc.client import RouteClient
from smetric_lmc.config import InstanceConfig, PolicyConfig
from smetric_lmc.controller.service import RouteCore
from smetric_lmc.hashing import HashSettings
from smetric_lmc.index import TierIndex
from smetric_lmc.lab.sim.cluster import Simulator
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.workload import TraceRequest, TraceSession, Workload
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router
from smetric_lmc.wire import HashChain

BS = 64

Snapshot = list[tuple[int, int]]


class RecordingTracker(LoadTracker):
    """The simulator's tracker, logging each load event and the per-instance state after it."""

    def __init__(self, ids: list[str], **kw: Any) -> None:
        super().__init__(**kw)
        self.ids = ids
        self.log: list[tuple[Any, ...]] = []

    def snap(self) -> Snapshot:
        return [(self.in_flight(i), self.unprefilled(i)) for i in self.ids]

    def on_route(self, request_id: str, instance_id: str, prompt_tokens: int, hit_tokens: int = 0) -> None:
        super().on_route(request_id, instance_id, prompt_tokens, hit_tokens)
        self.log.append(("route", request_id, instance_id, prompt_tokens, hit_tokens, self.snap()))

    def on_prefilled(self, request_id: str) -> bool:
        applied = super().on_prefilled(request_id)
        self.log.append(("prefilled", request_id, self.snap()))
        return applied

    def on_done(self, request_id: str) -> bool:
        released = super().on_done(request_id)
        self.log.append(("done", request_id, self.snap()))
        return released


def workload() -> Workload:
    sessions = []
    for s in range(6):
        base = np.arange(400, dtype=np.uint64) + np.uint64(10_000 * (s + 1))
        reqs = [TraceRequest(arrival=3.0 * k, input_tokens=(20 + 15 * k) * BS + 7, output_tokens=40,
                             block_ids=base[: 20 + 15 * k], think_time=0.5, turn=k) for k in range(4)]
        sessions.append(TraceSession(f"s{s}", reqs))
    return Workload("prefill-check", BS, sessions)


def simulated_events() -> tuple[list[str], list[tuple[Any, ...]]]:
    sim = Simulator(workload(), load_sim_config(instances=3, rate=2.0, measure="run", seed=3),
                    PolicyConfig(name="round_robin"))
    ids = [i.iid for i in sim.instances]
    rec = RecordingTracker(ids, clock=lambda: sim.now)
    for iid in ids:
        rec.add_instance(iid)
    sim.load = sim.router.load = rec
    # The turn each request was routed with: round_robin keeps one rotation per request kind (first
    # turns, follow-ups), so the live side must route with the same turns to make the same picks.
    original = sim.router.route

    def route(request_id: str, *args: Any, turn: int | None = None, **kw: Any) -> Any:
        TURNS[request_id] = turn
        return original(request_id, *args, turn=turn, **kw)

    sim.router.route = route  # type: ignore[method-assign]
    sim.run()
    return ids, rec.log


TURNS: dict[str, int | None] = {}


def test_live_and_simulated_trackers_agree_on_the_same_events() -> None:
    ids, events = simulated_events()
    kinds = {e[0] for e in events}
    assert kinds == {"route", "prefilled", "done"} and len(events) == 3 * 24
    # Prefill ends while other requests still queue: the sequence exercises the difference.
    assert any(e[0] == "prefilled" and sum(u for _, u in e[-1]) > 0 for e in events)
    index = TierIndex(BS, 256)
    load = LoadTracker()
    for iid in ids:
        index.register_instance(iid)
        load.add_instance(iid)
    insts = [InstanceConfig(id=i, http=f"http://127.0.0.1:{8000 + k}") for k, i in enumerate(ids)]
    core = RouteCore(index, load, Router(index, load, PolicyConfig(name="round_robin")), insts,
                     HashSettings(block_size=BS, fast_root=index.fast_root))
    index.gpu_stored_hashes(ids[0], [1])  # the index has data: no start-up fallback policy
    with ServiceThread(core) as st, RouteClient(st.endpoint, timeout_s=3.0) as c:
        for n, ev in enumerate(events):
            if ev[0] == "route":
                _, rid, inst, prompt, hit, want = ev
                # A chain of which exactly the simulated hit is cached on the simulated instance.
                chain = [(n << 20) + j + 2 for j in range(prompt // BS)]
                index.gpu_stored_hashes(inst, chain[: hit // BS])
                d = c.route(rid, hashes=[HashChain("fast", BS, chain)], prompt_tokens=prompt, turn=TURNS[rid])
                assert (d.instance_id, d.local_hit_tokens) == (inst, hit)
            elif ev[0] == "prefilled":
                _, rid, want = ev
                assert c.prefilled(rid).applied
            else:
                _, rid, want = ev
                assert c.done(rid).released
            live = [(load.in_flight(i), load.unprefilled(i)) for i in ids]
            assert live == want, (n, ev[:2])
    assert len(load) == 0 and load.stats["prefilled"] == 24


def test_engine_waiting_count_is_the_fallback_for_missing_prefilled_reports() -> None:
    now = [100.0]
    t = LoadTracker(clock=lambda: now[0])
    for k in range(4):
        t.on_route(f"r{k}", "a", 1000, 200)
        now[0] += 1.0
    assert t.unprefilled("a") == 4 * 800
    # The engine says one request still waits: the three oldest routed >= 1 s ago were prefilled.
    t.reconcile("a", 4, engine_waiting=1, prefill_grace_s=0.5)
    assert t.unprefilled("a") == 800 and t.stats["prefilled_inferred"] == 3
    assert not t.on_prefilled("r0") and t.on_prefilled("r3")  # a late report changes nothing twice
    assert t.unprefilled("a") == 0 and t.stats["prefilled"] == 1
