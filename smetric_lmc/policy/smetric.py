"""SMetric: balanced session-centric scheduling (DESIGN.md §1)."""

from __future__ import annotations

from dataclasses import dataclass

from smetric_lmc.policy.registry import register
from smetric_lmc.policy.view import NO_INSTANCE, Choice, ClusterView, rr_argmin
from smetric_lmc.wire import Reason


@dataclass(frozen=True, slots=True)
class SMetricParams:
    overload: float = 2.0
    hit_ratio: float = 0.5


@register("smetric", params=lambda cfg: {"p": SMetricParams(cfg.overload, cfg.hit_ratio)})
def smetric(view: ClusterView, p: SMetricParams = SMetricParams()) -> Choice:
    """Follow-ups stick to the instance holding the session's KV unless it is overloaded or evicted."""
    n = len(view.instances)
    if n == 0:
        return NO_INSTANCE
    c, load = view.local_hit, view.load
    if view.turn == 0:
        return Choice(rr_argmin(load, view.rr), Reason.FIRST_TURN)
    best = max(c)
    s = c.index(best) if c.count(best) == 1 else rr_argmin(load, view.rr, [i for i in range(n) if c[i] == best])
    if not best > p.hit_ratio * view.est_hit:
        return Choice(rr_argmin(load, view.rr), Reason.EVICTED)
    if load[s] > p.overload * (sum(load) / n):
        return Choice(rr_argmin(load, view.rr), Reason.OVERLOADED)
    return Choice(s, Reason.STICKY)
