"""Routing policies: small pure functions of a ``ClusterView`` returning a ``Decision``.

The controller and the simulator both build policies through ``make_policy``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from smetric_lmc.config import POLICY_NAMES, PolicyConfig
from smetric_lmc.policy.baselines import bailian, cache_first, dynamo, lmetric, load_balance, round_robin
from smetric_lmc.policy.smetric import SMetricParams, smetric
from smetric_lmc.policy.smetric_cost import SMetricCostParams, smetric_cost
from smetric_lmc.policy.view import ClusterView, Decision, rr_argmin

Policy = Callable[[ClusterView], Decision]

__all__ = ["ClusterView", "Decision", "Policy", "POLICY_NAMES", "make_policy", "rr_argmin"]


def make_policy(cfg: PolicyConfig) -> Policy:
    """The policy function a config names, with its parameters bound."""
    table: dict[str, Policy] = {
        "smetric": partial(smetric, p=SMetricParams(cfg.overload, cfg.hit_ratio)),
        "load_balance": load_balance,
        "bailian": partial(bailian, lam=cfg.bailian_lambda),
        "lmetric": partial(lmetric, offset=cfg.lmetric_load_offset),
        "dynamo": dynamo,
        "round_robin": round_robin,
        "cache_first": cache_first,
        "smetric_cost": partial(
            smetric_cost,
            p=SMetricCostParams(cfg.hit_ratio, cfg.cost_fetch_discount, cfg.lmetric_load_offset, cfg.overload),
        ),
    }
    return table[cfg.name]
