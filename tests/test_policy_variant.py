"""smetric_cost, our variant: each branch on hand-computed cases, its registration and YAML params."""

from __future__ import annotations

import pytest

from smetric_lmc.config import POLICY_NAMES, PolicyConfig, parse_config
from smetric_lmc.policy import ClusterView, make_policy
from smetric_lmc.policy.smetric import smetric
from smetric_lmc.policy.smetric_cost import SMetricCostParams, cost_scores, smetric_cost
from smetric_lmc.wire import Reason

IDS = ("a", "b", "c", "d")


def view(hit, load, *, L=1000, turn=1, est=512, g=0, rr=0):
    return ClusterView(IDS[: len(hit)], hit, load, L, turn=turn, est_hit=est, global_hit=g, rr=rr)


def test_cost_scores_formula() -> None:
    # f = (L - c - d * max(0, g - c)) * (l + 1), d = 0.9
    v = view([600, 0, 200], [2, 0, 1], g=800)
    assert cost_scores(v, SMetricCostParams()) == pytest.approx(
        [(1000 - 600 - 0.9 * 200) * 3, (1000 - 0 - 0.9 * 800) * 1, (1000 - 200 - 0.9 * 600) * 2]
    )


def test_first_turn_balances_when_the_global_tier_holds_its_prefix() -> None:
    d = smetric_cost(view([512, 0, 0], [1, 3, 0], turn=0, g=512))
    assert (d.index, d.reason) == (2, Reason.FIRST_TURN)


def test_first_turn_without_a_global_copy_goes_to_the_least_loaded_holder() -> None:
    # no global tier: instance 2 is idle but would recompute the 512-token prompt; 0 holds it, not overloaded
    d = smetric_cost(view([512, 512, 0], [2, 1, 0], turn=0))
    assert (d.index, d.reason) == (1, Reason.FIRST_TURN)
    # every holder overloaded (load > 2 x mean): balance like the paper's rule
    d = smetric_cost(view([512, 0, 0, 0], [9, 1, 0, 1], turn=0))
    assert d.index == 2


def test_follow_up_sticks_when_its_holder_is_cheapest() -> None:
    d = smetric_cost(view([768, 0, 0], [3, 1, 0]))  # f: 232*4=928 vs 1000*2, 1000*1
    assert (d.index, d.reason) == (0, Reason.STICKY)


def test_follow_up_moves_when_a_fetch_elsewhere_is_cheaper_than_the_queue() -> None:
    # the global tier holds the context: elsewhere it costs (1000 - 0.9*768) * 1 = 308.8 < 232 * 3 = 696
    d = smetric_cost(view([768, 0, 0], [2, 1, 0], g=768))
    assert (d.index, d.reason) == (2, Reason.OVERLOADED)
    # the paper's rule keeps it there (2 <= 2 x mean 1)
    assert smetric(view([768, 0, 0], [2, 1, 0], g=768)).reason == Reason.STICKY


def test_without_a_global_tier_a_loaded_holder_keeps_the_session_the_rule_would_shed() -> None:
    # load 5 > 2 x mean (5+0+0+0)/4: SMetric sheds it and the 960-token context is recomputed
    v = view([960, 0, 0, 0], [5, 0, 0, 0], est=960)
    assert smetric(v).reason == Reason.OVERLOADED
    d = smetric_cost(v)  # f: 40 * 6 = 240 < 1000 * 1
    assert (d.index, d.reason) == (0, Reason.STICKY)


def test_evicted_session_goes_to_the_cheapest_instance() -> None:
    d = smetric_cost(view([64, 0, 0], [4, 2, 0], est=900, g=0))
    assert (d.index, d.reason) == (2, Reason.EVICTED)


def test_registered_with_its_yaml_parameters() -> None:
    assert "smetric_cost" in POLICY_NAMES
    cfg = parse_config({"policy": {"name": "smetric_cost", "cost_fetch_discount": 0.0, "overload": 1.5}})
    pol = make_policy(cfg.policy)
    # discount 0: a global copy is worth nothing, so the holder stays (232*4 vs 1000*2)
    assert pol(view([768, 0, 0], [3, 1, 0], g=768)).index == 0
    with pytest.raises(ValueError):
        PolicyConfig(name="smetric_cost", cost_fetch_discount=1.5)
    # `smetric` stays the paper's rule whatever the variant's parameters say
    assert (
        make_policy(PolicyConfig(name="smetric", cost_fetch_discount=0.0))(
            view([768, 0, 0], [2, 1, 0], g=768)
        ).reason
        == Reason.STICKY
    )


def test_no_instances() -> None:
    assert smetric_cost(ClusterView((), [], [], 100)).index == -1
