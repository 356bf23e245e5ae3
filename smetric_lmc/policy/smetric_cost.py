"""``smetric_cost``: SMetric with a fetch-vs-queue cost test on follow-ups (our variant; ``smetric``
stays the paper's rule).

What the simulator's decision traces showed (docs/results.md, "Why the paper's rule loses"): the
rule's two fallbacks are blind to what moving a session costs, and its stickiness is blind to what
staying costs.
- Without a global tier, a follow-up shed from an "overloaded" holder, or one whose KV was partly
  evicted, lands on the least-loaded instance by request count and recomputes its whole context
  there (50-60 k tokens each on trace1): those fallbacks were ~3-9% of the requests but 12-28% of all
  recomputed tokens, and LMetric, which weighs the lost hit against the load, beat the rule.
- With a global tier the opposite: moving costs a fetch that barely stalls the GPU (< 1% of busy
  time), yet the rule keeps a session on its holder until that holder carries twice the mean load,
  so the balancing baselines (load-balance-only, LMetric, Dynamo) beat it.
- Without a global tier a first request recomputes its agent framework's prompt on an instance
  that lacks it; with prompts as large as the KV (the map's right columns) that matters.

The variant keeps the rule's first-request balancing (a session's first request goes to the
least-loaded instance by request count: the placement that balances the cluster; when the global
tier lacks its prefix, to the least-loaded instance holding it, unless all such are overloaded) and
decides every follow-up by one cost that prices both effects:

    f[i] = (L - c[i] - discount * max(0, g - c[i])) * (l[i] + offset)

the tokens the request must still compute on instance i (a token the global tier holds counts as
``1 - discount`` of a computed one: a fetch instead of a recompute) times the instance's load. It
stays on its holder s (the longest local hit) when s is among the cheapest, else goes to argmin f.
With no global tier (g = 0) it weighs the lost local hit against the queue; with a fully
provisioned one most of the context is fetchable anywhere and load decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from smetric_lmc.policy.registry import register
from smetric_lmc.policy.view import NO_INSTANCE, Choice, ClusterView, rr_argmin
from smetric_lmc.wire import Reason


@dataclass(frozen=True, slots=True)
class SMetricCostParams:
    hit_ratio: float = 0.5  # labels a move EVICTED when the best hit < hit_ratio x est_hit (as SMetric)
    fetch_discount: float = 0.9  # share of a computed token's cost a global-tier fetch saves
    load_offset: float = 1.0  # (l + offset): idle instances do not all tie at 0
    overload: float = 2.0  # a first request goes to a holder of its prefix only below overload x mean load


def cost_scores(view: ClusterView, p: SMetricCostParams) -> list[float]:
    """f[i]: tokens left to compute on instance i (fetches discounted) x (load + offset)."""
    L, g, d = view.prompt_tokens, view.global_hit, p.fetch_discount
    return [(L - ci - d * max(0, g - ci)) * (li + p.load_offset) for ci, li in zip(view.local_hit, view.load)]


@register("smetric_cost", params=lambda cfg: {
    "p": SMetricCostParams(cfg.hit_ratio, cfg.cost_fetch_discount, cfg.lmetric_load_offset, cfg.overload)})
def smetric_cost(view: ClusterView, p: SMetricCostParams = SMetricCostParams()) -> Choice:
    if not view.instances:
        return NO_INSTANCE
    best = view.best_hit()[0]
    if view.turn == 0:
        if best > view.global_hit:
            # the shared prefix is not fetchable: the least loaded of its holders, unless all are overloaded
            limit = p.overload * view.mean_load()
            holders = view.best_hit()[1]
            held = [i for i in (range(len(view.instances)) if holders is None else holders) if view.load_of(i) <= limit]
            if held:
                return Choice(view.least_loaded(held), Reason.FIRST_TURN)
        return Choice(view.least_loaded(), Reason.FIRST_TURN)
    f = cost_scores(view, p)
    s = view.holder()
    k = rr_argmin(f, view.rr)
    if f[s] <= f[k]:
        return Choice(s, Reason.STICKY)
    return Choice(k, Reason.OVERLOADED if best > p.hit_ratio * view.est_hit else Reason.EVICTED)
