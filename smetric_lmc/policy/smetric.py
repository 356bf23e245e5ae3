"""SMetric: balanced session-centric scheduling (DESIGN.md §1)."""

from __future__ import annotations

from dataclasses import dataclass

from smetric_lmc.policy.registry import register
from smetric_lmc.policy.view import NO_INSTANCE, Choice, ClusterView
from smetric_lmc.wire import Reason


@dataclass(frozen=True, slots=True)
class SMetricParams:
    overload: float = 2.0
    hit_ratio: float = 0.5


@register("smetric", params=lambda cfg: {"p": SMetricParams(cfg.overload, cfg.hit_ratio)})
def smetric(view: ClusterView, p: SMetricParams = SMetricParams()) -> Choice:
    """Follow-ups stick to the instance holding the session's KV unless it is overloaded or evicted."""
    if not view.instances:
        return NO_INSTANCE
    if view.turn == 0:
        return Choice(view.least_loaded(), Reason.FIRST_TURN)
    best = view.best_hit()[0]
    s = view.holder()
    if not best > p.hit_ratio * view.est_hit:
        return Choice(view.least_loaded(), Reason.EVICTED)
    if view.load_of(s) > p.overload * view.mean_load():
        return Choice(view.least_loaded(), Reason.OVERLOADED)
    return Choice(s, Reason.STICKY)
