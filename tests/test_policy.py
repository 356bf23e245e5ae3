"""Every SMetric branch and every baseline's formula on hand-computed cases, plus invariants."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smetric_lmc.config import POLICY_NAMES, PolicyConfig
from smetric_lmc.policy import Choice, ClusterView, make_policy, rr_argmin
from smetric_lmc.policy.baselines import (
    bailian,
    bailian_scores,
    cache_first,
    dynamo,
    dynamo_scores,
    lmetric,
    lmetric_scores,
    load_balance,
    round_robin,
)
from smetric_lmc.policy.smetric import SMetricParams, smetric
from smetric_lmc.wire import Reason

IDS = ("a", "b", "c", "d")


def view(hit, load, *, L=1000, turn=1, est=512, rr=0, unpre=None):
    return ClusterView(IDS[: len(hit)], hit, load, L, turn=turn, est_hit=est, rr=rr, unprefilled=unpre)


# ---- SMetric branches -------------------------------------------------------------------------
def test_first_turn_goes_to_least_loaded_even_with_a_hit():
    d = smetric(view([800, 0, 0], [1, 3, 0], turn=0))
    assert (d.index, d.reason) == (2, Reason.FIRST_TURN)


def test_follow_up_sticks_to_the_kv_holder():
    d = smetric(view([0, 768, 0], [1, 3, 2]))  # mean 2, l[s]=3 <= 4, 768 > 256
    assert (d.index, d.reason) == (1, Reason.STICKY)


def test_overloaded_holder_falls_back_to_least_loaded():
    d = smetric(view([0, 768, 0], [1, 9, 2]))  # mean 4, 9 > 8
    assert (d.index, d.reason) == (0, Reason.OVERLOADED)


def test_overload_threshold_is_inclusive():
    d = smetric(view([0, 768, 0], [1, 8, 3]))  # mean 4, 8 <= 8
    assert d.reason == Reason.STICKY


def test_evicted_session_is_rebalanced():
    d = smetric(view([100, 256, 0], [0, 0, 0], est=512))  # 256 is not > 0.5 * 512
    assert d.reason == Reason.EVICTED
    d = smetric(view([100, 272, 0], [1, 0, 0], est=512))
    assert (d.index, d.reason) == (1, Reason.STICKY)


def test_all_overloaded_balances():
    # OVERLOAD < 1: every instance is above OVERLOAD x mean, so the holder never qualifies.
    p = SMetricParams(overload=0.5, hit_ratio=0.5)
    d = smetric(view([900, 900, 900], [4, 4, 4]), p)
    assert d.reason == Reason.OVERLOADED


def test_mean_load_zero_sticks():
    d = smetric(view([0, 0, 900], [0, 0, 0]))
    assert (d.index, d.reason) == (2, Reason.STICKY)


def test_infinite_overload_never_sheds():
    p = SMetricParams(overload=math.inf)
    assert smetric(view([0, 900], [0, 1000]), p).reason == Reason.STICKY


def test_hit_ties_go_to_the_least_loaded_holder():
    d = smetric(view([900, 900, 0], [5, 2, 0]))
    assert (d.index, d.reason) == (1, Reason.STICKY)


def test_load_ties_rotate_round_robin():
    picks = {smetric(view([0, 0, 0], [0, 0, 0], turn=0, rr=r)).index for r in range(3)}
    assert picks == {0, 1, 2}
    holders = {smetric(view([900, 900, 0], [1, 1, 0], rr=r)).index for r in range(4)}
    assert holders == {0, 1}


def test_no_instances():
    d = smetric(ClusterView((), (), (), 100, turn=1))
    assert (d.index, d.reason) == (-1, Reason.NO_INSTANCES)
    for name in POLICY_NAMES:
        assert make_policy(PolicyConfig(name=name))(ClusterView((), (), (), 100)).index == -1


# ---- baselines ----------------------------------------------------------------------------------
def test_load_balance_is_join_shortest_queue():
    assert load_balance(view([900, 0, 0], [3, 1, 2])).index == 1


def test_bailian_formula():
    v = view([600, 0, 300], [4, 0, 2], L=1000)
    # l̂ = l/4 = [1, 0, .5]; ĉ = [.6, 0, .3]; λ = 0.9
    expect = [0.1 * 1 + 0.9 * 0.4, 0.1 * 0 + 0.9 * 1.0, 0.1 * 0.5 + 0.9 * 0.7]
    assert bailian_scores(v, 0.9) == pytest.approx(expect)
    assert bailian(v, 0.9).index == 0
    assert bailian(v, 0.0).index == 1  # λ = 0 is pure load balance


def test_lmetric_formula_uses_load_plus_offset():
    v = view([600, 0, 300], [4, 0, 2], L=1000)
    assert lmetric_scores(v, 1.0) == [400 * 5, 1000 * 1, 700 * 3]
    assert lmetric(v).index == 1
    # Without the offset idle instances tie at 0 whatever their hit.
    assert lmetric_scores(v, 0.0)[1] == 0


def test_dynamo_formula_uses_queued_prefill_tokens():
    v = view([600, 0, 300], [1, 1, 1], L=1000, unpre=[900, 100, 0])
    assert dynamo_scores(v) == [900 + 400, 100 + 1000, 0 + 700]
    assert dynamo(v).index == 2


def test_round_robin_and_cache_first():
    assert [round_robin(view([0, 0, 0], [0, 0, 0], rr=r)).index for r in range(4)] == [0, 1, 2, 0]
    d = cache_first(view([100, 700, 700], [9, 5, 1]))
    assert (d.index, d.reason) == (2, Reason.CACHE_FIRST)


def test_rr_argmin_restricted_to_candidates():
    # rr is a position pointer: the first tie at or after it, wrapping
    assert [rr_argmin([0, 5, 5, 1], r, among=[1, 2]) for r in range(5)] == [1, 1, 2, 1, 1]
    assert [rr_argmin([3, 1, 7, 1], r) for r in range(5)] == [1, 1, 3, 3, 1]


# ---- invariants ---------------------------------------------------------------------------------
cluster = st.integers(1, 8).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 4096), min_size=n, max_size=n),
        st.lists(st.integers(0, 50).map(float), min_size=n, max_size=n),
        st.integers(0, 5),
        st.integers(0, 4096),
        st.integers(0, 1000),
    )
)


@given(cluster)
def test_every_policy_returns_a_valid_index(args):
    hit, load, turn, est, rr = args
    v = ClusterView(tuple(f"i{k}" for k in range(len(hit))), hit, load, 4096, turn=turn, est_hit=est, rr=rr)
    for name in POLICY_NAMES:
        d = make_policy(PolicyConfig(name=name))(v)
        assert 0 <= d.index < len(hit)


@given(cluster)
def test_smetric_sticky_only_under_its_conditions(args):
    hit, load, turn, est, rr = args
    v = ClusterView(tuple(f"i{k}" for k in range(len(hit))), hit, load, 4096, turn=turn, est_hit=est, rr=rr)
    d = smetric(v)
    if d.reason == Reason.STICKY:
        assert turn > 0
        assert hit[d.index] == max(hit) and hit[d.index] > 0.5 * est
        assert load[d.index] <= 2.0 * sum(load) / len(load)
    else:  # every fallback lands on a least-loaded instance
        assert load[d.index] == min(load)


def test_a_policy_declares_what_it_needs_and_registering_it_is_all_it_takes(monkeypatch):
    from smetric_lmc.hashing import fast_chain
    from smetric_lmc.index import TierIndex
    from smetric_lmc.load import LoadTracker
    from smetric_lmc.policy import registry
    from smetric_lmc.router import Router

    assert make_policy(PolicyConfig(name="dynamo")).needs == {"unprefilled"}
    assert make_policy(PolicyConfig(name="smetric")).needs == frozenset()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    seen = []

    @registry.register("least_queued_prefill", needs={"unprefilled"})
    def least_queued_prefill(v: ClusterView):
        seen.append(v.unprefilled)
        return Choice(rr_argmin(list(v.unprefilled), v.rr), Reason.SCORED)

    ix = TierIndex(16, 64)
    for k in range(2):
        ix.register_instance(f"i{k}")
    load = LoadTracker()
    load.on_route("big", "i0", 5000)
    r = Router(ix, load, PolicyConfig(name="least_queued_prefill"))
    assert r.route("q", fast_chain(list(range(64)), 16), None, 64).instance_id == "i1"
    assert seen == [[5000.0, 0.0]]
    # A policy that does not ask for unprefilled tokens gets none computed.
    r.set_policy(PolicyConfig(name="load_balance"))
    assert r.route("q2", [], None, 10).policy == "load_balance"
