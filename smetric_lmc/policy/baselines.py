"""The baselines users compare SMetric against (DESIGN.md §1). Lower score is better."""

from __future__ import annotations

from collections.abc import Sequence

from smetric_lmc.policy.registry import register
from smetric_lmc.policy.view import NO_INSTANCE, Choice, ClusterView, rr_argmin
from smetric_lmc.wire import Reason


def _by_score(view: ClusterView, scores: Sequence[float]) -> Choice:
    if not view.instances:
        return NO_INSTANCE
    return Choice(rr_argmin(scores, view.rr), Reason.SCORED)


@register("load_balance")
def load_balance(view: ClusterView) -> Choice:
    """Join-shortest-queue: f = l[i] (vLLM production-stack's default)."""
    if not view.instances:
        return NO_INSTANCE
    return Choice(view.least_loaded(), Reason.SCORED)


def bailian_scores(view: ClusterView, lam: float) -> list[float]:
    """f = (1-λ)·l̂ + λ·(1-ĉ): l̂ = l / max(l) in [0, 1], ĉ = c / L."""
    top = max(view.load, default=0.0)
    L = view.prompt_tokens
    return [
        (1 - lam) * (li / top if top > 0 else 0.0) + lam * (1 - (ci / L if L > 0 else 0.0))
        for li, ci in zip(view.load, view.local_hit)
    ]


@register("bailian", params=lambda cfg: {"lam": cfg.bailian_lambda})
def bailian(view: ClusterView, lam: float = 0.9) -> Choice:
    return _by_score(view, bailian_scores(view, lam))


def lmetric_scores(view: ClusterView, offset: float) -> list[float]:
    """f = (L - c) × (l + offset). The offset (1 by default, as published ports do) keeps idle
    instances from all tying at 0 regardless of their hit."""
    L = view.prompt_tokens
    return [(L - ci) * (li + offset) for li, ci in zip(view.load, view.local_hit)]


@register("lmetric", params=lambda cfg: {"offset": cfg.lmetric_load_offset})
def lmetric(view: ClusterView, offset: float = 1.0) -> Choice:
    return _by_score(view, lmetric_scores(view, offset))


def dynamo_scores(view: ClusterView) -> list[float]:
    """f = queued unprefilled tokens + (L - c): the prefill work the request would wait behind."""
    queued = view.unprefilled if view.unprefilled is not None else view.load  # a view built by hand
    L = view.prompt_tokens
    return [q + (L - ci) for q, ci in zip(queued, view.local_hit)]


@register("dynamo", needs={"unprefilled"})
def dynamo(view: ClusterView) -> Choice:
    return _by_score(view, dynamo_scores(view))


@register("round_robin")
def round_robin(view: ClusterView) -> Choice:
    if not view.instances:
        return NO_INSTANCE
    return Choice(view.rr % len(view.instances), Reason.ROUND_ROBIN)


@register("cache_first")
def cache_first(view: ClusterView) -> Choice:
    """Pure argmax c; ties to the least loaded."""
    if not view.instances:
        return NO_INSTANCE
    return Choice(view.holder(), Reason.CACHE_FIRST)
