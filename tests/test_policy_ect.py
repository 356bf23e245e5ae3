"""smetric_ect, the expected-completion-cost variant: its cost on hand-computed cases, the two limits
it reduces to (load balance when fetches are cheap, cache affinity when they are not), its labels,
its registration and YAML parameters."""

from __future__ import annotations

import pytest

from smetric_lmc.config import POLICY_NAMES, PolicyConfig, parse_config
from smetric_lmc.policy import ClusterView, make_policy
from smetric_lmc.policy.smetric_ect import ECTParams, ect_scores, smetric_ect
from smetric_lmc.wire import Reason

IDS = ("a", "b", "c", "d")
FULL_COST = {"drag_no_global": 1.0, "queue_no_global": 1.0}  # the defaults, spelt out
HAND = {"fetch_fixed_us": 0.0, "decode_us_per_req": 0.0}  # no fixed fetch part, the drag is inflight_us alone
FULL_YAML = {"drag_no_global": 1.0, "queue_no_global": 1.0, **HAND}


def ect(prefill_us: float, prefill_us_per_ktok: float, fetch_us: float, inflight_us: float, slack_s: float = 0.0,
        slack_s_per_tok: float = 0.0, **kw: float) -> ECTParams:
    """The hand-computed cases' prices: a queued token priced as a computed one at no context, no
    fixed fetch part, the drag inflight_us alone, slack = half the SLO."""
    kw.setdefault("queue_us_per_tok", prefill_us)
    return ECTParams(prefill_us=prefill_us, prefill_us_per_ktok=prefill_us_per_ktok, fetch_us=fetch_us,
                     inflight_us=inflight_us, slo_ttft_s=2 * slack_s, slo_ttft_s_per_tok=2 * slack_s_per_tok,
                     **HAND, **kw)  # fmt: skip

# flat per-token prefill cost so the cases can be computed by hand
# (no queue slack: every queued token counts; the slack has its own test)
P = ect(100.0, 0.0, 1.0, 1000.0, **FULL_COST)  # fmt: skip


def view(hit, load, unpre=None, *, L=1000, turn=1, est=512, g=0, rr=0):
    return ClusterView(IDS[: len(hit)], hit, load, L, turn=turn, est_hit=est, global_hit=g,
                       unprefilled=unpre if unpre is not None else [0.0] * len(hit), rr=rr)  # fmt: skip


def test_cost_formula_by_hand() -> None:
    p = ect(100.0, 50.0, 2.0, 1000.0, queue_us_per_tok=200.0, **FULL_COST)
    # t_tok = 100 + 50 * 2000 / 1000 = 200 µs
    v = view([1500, 0], [2, 0], [100.0, 300.0], L=2000, g=1000)
    assert ect_scores(v, p) == pytest.approx([
        200 * 100 + (200 * 500 + 2 * 0) * (1 + 2) + 1000 * 2,  # holder: its queue; 500 tokens stall a batch of 3
        200 * 300 + (200 * 1000 + 2 * 1000) * (1 + 0) + 0,  # fetches 1,000 and computes 1,000 on an idle GPU
    ])  # fmt: skip


def test_without_a_global_tier_the_holder_keeps_its_session_despite_load() -> None:
    # 100*200*4 + 1000*3 = 83,000 vs 100*1000*2 + 1000 = 201,000 and 100,000: moving costs the context
    d = smetric_ect(view([800, 0, 0], [3, 1, 0]), P)
    assert (d.index, d.reason) == (0, Reason.STICKY)


def test_with_the_prefix_in_the_global_tier_it_balances() -> None:
    # g = 800: 83,000 vs (20,000 + 800)*2 + 1,000 vs 20,800 -> the idle instance
    d = smetric_ect(view([800, 0, 0], [3, 1, 0], g=800), P)
    assert (d.index, d.reason) == (2, Reason.OVERLOADED)


def test_an_expensive_fetch_keeps_affinity() -> None:
    slow = ect(100.0, 0.0, 100.0, 1000.0, **FULL_COST)
    # fetching at compute speed: 83,000 vs 201,000 and 100,000 -> stay
    assert smetric_ect(view([800, 0, 0], [3, 1, 0], g=800), slow).index == 0


def test_a_long_prefill_queue_on_the_holder_moves_the_session() -> None:
    # holder: 100*2000 + 100*200*2 + 1000 = 241,000; others 100*1000*2 + 1000 = 201,000 (tie: round-robin)
    d = smetric_ect(view([800, 0, 0], [1, 1, 1], [2000.0, 0.0, 0.0]), P)
    assert (d.index, d.reason) == (1, Reason.OVERLOADED)
    assert smetric_ect(view([800, 0, 0], [1, 1, 1], [2000.0, 0.0, 0.0], rr=2), P).index == 2
    # a shorter queue (1,500: 191,000) is not worth recomputing the context
    assert smetric_ect(view([800, 0, 0], [1, 1, 1], [1500.0, 0.0, 0.0]), P).index == 0


def test_first_turn_and_evicted_labels() -> None:
    # first turn: a shared system prompt found locally on b counts as a hit (100*200*3 + 2000 < 100*1000)
    d = smetric_ect(view([0, 800, 0], [0, 2, 0], turn=0), P)
    assert (d.index, d.reason) == (1, Reason.FIRST_TURN)
    # follow-up whose KV is mostly gone (64 of 900 expected): 93,600*2 + 1,000 vs 302,000 and 100,000
    d = smetric_ect(view([64, 0, 0], [1, 2, 0], est=900), P)
    assert (d.index, d.reason) == (2, Reason.EVICTED)


def test_a_view_without_queues_prices_them_at_zero() -> None:
    v = ClusterView(IDS[:2], [800, 0], [3, 1], 1000, turn=1, est_hit=512)
    assert ect_scores(v, P) == pytest.approx([100 * 200 * 4 + 3000, 100 * 1000 * 2 + 1000])


def test_registered_with_its_yaml_parameters() -> None:
    assert "smetric_ect" in POLICY_NAMES
    cfg = parse_config({"policy": {"name": "smetric_ect", "params": {
        "fetch_us": 100.0, "prefill_us": 100.0, "prefill_us_per_ktok": 0.0, "inflight_us": 1000.0, **FULL_YAML}}})
    pol = make_policy(cfg.policy)
    # the router fills queues, request counts and learned prices only for policies that ask
    assert pol.needs == frozenset({"unprefilled", "in_flight", "prices"})
    assert pol(view([800, 0, 0], [3, 1, 0], g=800)).index == 0  # the expensive fetch keeps affinity
    with pytest.raises(ValueError, match="inflight_us"):
        PolicyConfig(name="smetric_ect", params={"inflight_us": -1.0})
    with pytest.raises(ValueError, match="unknown smetric_ect parameter"):
        PolicyConfig(name="smetric_ect", params={"inflight": 1.0})
    with pytest.raises(ValueError, match="takes none"):
        PolicyConfig(name="smetric", params={"inflight_us": 1.0})


def test_no_instances() -> None:
    assert smetric_ect(ClusterView((), [], [], 100)).index == -1


def test_request_counts_come_from_in_flight_when_load_counts_tokens() -> None:
    # under PD `load` is unprefilled tokens; the drag and the batch factor use the request counts
    v = ClusterView(IDS[:2], [800, 0], [5000.0, 0.0], 1000, turn=1, est_hit=512, unprefilled=[5000.0, 0.0],
                    in_flight=[1.0, 0.0])  # fmt: skip
    assert ect_scores(v, P) == pytest.approx([100 * 5000 + 100 * 200 * 2 + 1000, 100 * 1000])


def test_displacement_prices_the_kv_a_move_evicts() -> None:
    d = ect(100.0, 0.0, 1.0, 1000.0, displace=0.5, **FULL_COST)
    # no global copy: every token brought to i evicts 0.5 x a recompute (50 µs) of someone else's KV
    v = view([800, 0], [1, 0], [1500.0, 0.0])
    assert ect_scores(v, d) == pytest.approx([
        100 * 1500 + 100 * 200 * 2 + 1000 + 50 * 200,  # holder: only the 200 new tokens displace
        100 * 1000 * 1 + 50 * 1000,  # a move displaces the whole context
    ])  # fmt: skip
    # without the displacement the long queue moves the session (190,000 + 1,000 > 100,000) ...
    assert smetric_ect(v, P).index == 1
    # ... with it the move costs 150,000 vs 201,000: still a move; behind a 900-token queue the holder
    # costs 131,000 (a move without it: 100,000) or 141,000 (with it: 150,000, so it stays)
    assert smetric_ect(v, d).index == 1
    assert smetric_ect(view([800, 0], [1, 0], [900.0, 0.0]), P).index == 1
    assert smetric_ect(view([800, 0], [1, 0], [900.0, 0.0]), d).index == 0
    # with the prefix in the global tier the displaced KV is refetched: 0.5 x 1 µs per token
    vg = view([800, 0], [1, 0], [1500.0, 0.0], g=800)
    assert ect_scores(vg, d)[1] == pytest.approx(100 * 200 + 1 * 800 + 0.5 * 1000)


def test_a_queue_within_the_slo_slack_costs_nothing() -> None:
    # slack = 0.05 s + 1e-4 s x 1,000 tokens = 0.15 s = 150,000 µs of queued prefill waited for free
    p = ect(100.0, 0.0, 1.0, 1000.0, 0.05, 1e-4, **FULL_COST)
    v = view([800, 0], [1, 0], [2000.0, 0.0])
    # holder: max(0, 200,000 - 150,000) + 100*200*2 + 1,000 = 91,000; the idle one: 100,000 -> it stays
    assert ect_scores(v, p) == pytest.approx([50_000 + 40_000 + 1000, 100_000])
    assert smetric_ect(v, p).index == 0
    assert smetric_ect(v, P).index == 1  # without the slack the same queue moves it (241,000)
    # a queue inside the slack is free: holders with 0 and 1,000 queued tokens cost the same
    a, b = ect_scores(ClusterView(IDS[:2], [800, 800], [1, 1], 1000, turn=1, est_hit=512, unprefilled=[0.0, 1000.0]), p)
    assert a == b


def test_slack_parameters_come_from_yaml() -> None:
    base = {"fetch_us": 1.0, "prefill_us": 100.0, "prefill_us_per_ktok": 0.0, "inflight_us": 1000.0,
            "queue_us_per_tok": 100.0, **FULL_YAML}
    cfg = parse_config({"policy": {"name": "smetric_ect", "params": {"slack_share": 0.0, **base}}})
    v = view([800, 0], [1, 0], [2000.0, 0.0])
    assert make_policy(cfg.policy)(v).index == 1  # no slack: the queue moves it
    # half of an SLO of 0.1 s + 2e-4 s per token
    cfg = parse_config({"policy": {"name": "smetric_ect", "params": {"slo_ttft_s": 0.1, "slo_ttft_s_per_tok": 2e-4,
                                                                      **base}}})  # fmt: skip
    assert make_policy(cfg.policy)(v).index == 0


def test_the_old_ect_keys_still_work_with_a_deprecation_warning() -> None:
    old = {"name": "smetric_ect", "ect_slack_s": 0.05, "ect_slack_s_per_tok": 1e-4, "ect_fetch_us": 1.0,
           "ect_prefill_us": 100.0, "ect_prefill_us_per_ktok": 0.0, "ect_inflight_us": 1000.0,
           "ect_queue_no_global": 1.0, "ect_drag_no_global": 1.0, "params": {"queue_us_per_tok": 100.0, **HAND}}
    with pytest.warns(DeprecationWarning, match="policy.ect_slack_s is deprecated: use policy.params.slo_ttft_s"):
        cfg = parse_config({"policy": old})
    # the old slack (half the SLO outright) maps to the SLO: the same decision as the new spelling
    assert cfg.policy.params["slo_ttft_s"] == pytest.approx(0.1)
    assert cfg.policy.ect_slack_s is None
    assert make_policy(cfg.policy)(view([800, 0], [1, 0], [2000.0, 0.0])).index == 0
    with pytest.raises(ValueError, match="ect_slack_s"):
        PolicyConfig(name="smetric_ect", ect_slack_s=-1.0)
    with pytest.warns(DeprecationWarning, match="cost_fetch_discount"):
        PolicyConfig(name="smetric", cost_fetch_discount=0.9)


def test_without_a_global_copy_it_prices_a_move_as_lmetric_does() -> None:
    """With both no-global weights 0 (the former defaults, now opt-in), when the global tier holds
    none of the prefix neither the holder's queue nor the in-flight drag counts, and the cost is
    t_tok x (L - c) x (1 + l): LMetric's score times the prefill cost per token, the same choice."""
    from smetric_lmc.policy.baselines import lmetric_scores

    d = ect(100.0, 0.0, 1.0, 1000.0, drag_no_global=0.0, queue_no_global=0.0)
    v = view([800, 0, 0], [1, 1, 1], [2000.0, 0.0, 0.0])
    assert ect_scores(v, d) == pytest.approx([100 * s for s in lmetric_scores(v, 1.0)])
    # the holder's 2,000 queued tokens would move the session (241,000 vs 201,000, by hand above);
    # without a global copy the move recomputes the context and a wait burns no GPU time: it stays
    assert smetric_ect(v, P).index == 1
    assert (smetric_ect(v, d).index, smetric_ect(v, d).reason) == (0, Reason.STICKY)
    # with the prefix in the global tier the queue and the drag count again: the move only fetches
    vg = view([800, 0, 0], [1, 1, 1], [2000.0, 0.0, 0.0], g=800)
    assert ect_scores(vg, d) == pytest.approx(ect_scores(vg, P))
    assert smetric_ect(vg, d).index == 1
    # and the weights are YAML parameters
    cfg = parse_config({"policy": {"name": "smetric_ect", "params": {
        "queue_no_global": 0.0, "drag_no_global": 0.0, "slack_share": 0.0, "fetch_us": 1.0, "prefill_us": 100.0,
        "prefill_us_per_ktok": 0.0, "inflight_us": 1000.0, "queue_us_per_tok": 100.0, **HAND}}})
    assert make_policy(cfg.policy)(v).index == 0


def test_learned_prices_in_the_view_replace_the_configured_ones() -> None:
    from smetric_lmc.prices import DEFAULT_PRIORS, PRICE_NAMES, InstancePrices

    def prices(fetch_us: float) -> InstancePrices:
        vals = {**DEFAULT_PRIORS, "prefill_us": 100.0, "prefill_us_per_ktok": 0.0, "fetch_global_us": fetch_us,
                "fetch_global_fixed_us": 0.0, "queue_us_per_tok": 100.0, "inflight_us": 1000.0,
                "decode_us_per_req": 0.0}  # fmt: skip
        return InstancePrices(*(vals[k] for k in PRICE_NAMES))

    def v(fetch_us: float) -> ClusterView:
        return ClusterView(IDS[:3], [800, 0, 0], [3, 1, 0], 1000, turn=1, est_hit=512, global_hit=800,
                           unprefilled=[0.0] * 3, prices=[prices(fetch_us)] * 3)  # fmt: skip

    # the same case as test_with_the_prefix_in_the_global_tier_it_balances / _an_expensive_fetch_keeps_affinity,
    # priced by the view: a cheap learned fetch balances, a dear one keeps affinity, whatever the params say
    assert smetric_ect(v(1.0), ect(100.0, 0.0, 100.0, 1000.0)).index == 2
    assert smetric_ect(v(100.0), ect(100.0, 0.0, 1.0, 1000.0)).index == 0
    # and the router fills them only for a policy that asks
    assert "prices" in make_policy(PolicyConfig(name="smetric_ect")).needs
    assert "prices" not in make_policy(PolicyConfig(name="smetric_ect_fixed")).needs


def test_a_follow_up_leaves_its_holder_only_for_a_significant_saving() -> None:
    """With learned prices the costs are predictions of the TTFT fit's noise: a move must save more
    than move_z standard deviations of the two costs' error (noise x sqrt(a^2 + b^2))."""
    from smetric_lmc.prices import DEFAULT_PRIORS, PRICE_NAMES, InstancePrices

    def prices(noise: float) -> InstancePrices:
        vals = {**DEFAULT_PRIORS, "prefill_us": 100.0, "prefill_us_per_ktok": 0.0, "fetch_global_us": 1.0,
                "fetch_global_fixed_us": 0.0, "queue_us_per_tok": 100.0, "inflight_us": 1000.0,
                "decode_us_per_req": 0.0}  # fmt: skip
        return InstancePrices(*(vals[k] for k in PRICE_NAMES), ttft_rel_noise=noise)

    def v(load: list[float], noise: float) -> ClusterView:
        n = len(load)
        return ClusterView(IDS[:n], [800] + [0] * (n - 1), load, 1000, turn=1, est_hit=512, global_hit=800,
                           unprefilled=[0.0] * n, prices=[prices(noise)] * n)  # fmt: skip

    p = ect(100.0, 0.0, 1.0, 1000.0)
    assert p.move_z == 1.0  # the default
    # holder 100*200*2 + 1,000 = 41,000; the idle one 100*200 + 800 = 20,800: a saving of 20,200
    # 0.5 * sqrt(41,000^2 + 20,800^2) = 22,987 > 20,200: not significant, the session stays
    d = smetric_ect(v([1, 0], 0.5), p)
    assert (d.index, d.reason) == (0, Reason.STICKY)
    # a fit with less noise (0.3: 13,792), no estimate yet (0), or move_z = 0: it moves
    assert smetric_ect(v([1, 0], 0.3), p).index == 1
    assert smetric_ect(v([1, 0], 0.0), p).index == 1
    assert smetric_ect(v([1, 0], 0.5), ect(100.0, 0.0, 1.0, 1000.0, move_z=0.0)).index == 1
    # a large saving moves it whatever the noise: 83,000 vs 20,800 against 0.5 * 85,566 = 42,783
    d = smetric_ect(v([3, 1, 0], 0.5), p)
    assert (d.index, d.reason) == (2, Reason.OVERLOADED)
