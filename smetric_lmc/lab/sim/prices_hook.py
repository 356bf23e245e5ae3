"""The simulator's price estimator: the router learns each instance's prices from the simulated done
reports (TTFT, e2e, output and cached tokens, the decision's predicted hits and the queue it
joined), exactly as the controller does from the gateway's, and from what the engines' /metrics
would show of LMCache's retrieves (their time and size, summed per instance over each poll period
of the controller's), and never reads the profile's constants. Attached only when the policy
decides with prices (``needs={"prices"}``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from smetric_lmc.config import LoadConfig
from smetric_lmc.policy.smetric_ect import ECTParams
from smetric_lmc.prices import EstimatorConfig, PriceBook, PriceFeed

if TYPE_CHECKING:
    from smetric_lmc.config import PolicyConfig
    from smetric_lmc.lab.sim.request import SimRequest
    from smetric_lmc.router import Router


def attach(router: Router, policy: PolicyConfig) -> PriceFeed | None:
    """Give ``router`` a price feed when its policy prices with what it learns; the cold-start prior is
    the policy's configured prices (as in the controller)."""
    if "prices" not in router.policy.needs:
        return None
    settings = ECTParams.from_params(policy.params).estimator_settings() if policy.name.startswith("smetric_ect") else {}
    router.prices = PriceFeed(PriceBook(EstimatorConfig(**settings)))  # type: ignore[arg-type]
    return router.prices


def report_done(feed: PriceFeed | None, r: SimRequest, done_t: float) -> None:
    """The done report a gateway would send for ``r``, finished at ``done_t``."""
    if feed is None:
        return
    ttft = r.first_token - r.arrival
    feed.on_done(r.rid, ttft_s=ttft if math.isfinite(ttft) else None, e2e_s=done_t - r.arrival,
                 output_tokens=r.output, cached_tokens=r.local_tokens + r.global_tokens, prompt_tokens=r.input)


class RetrievePolls:
    """Per instance, the retrieves of the requests reported done, summed over each period of the
    controller's engine-metrics poll (``load.metrics_poll_s``) and fed as one observation a period,
    as the poller feeds the growth of LMCache's retrieve histogram. A request's retrieve is counted
    when it is reported done (the engine counts it when it ends; the prices it teaches differ little)."""

    def __init__(self, feed: PriceFeed, poll_s: float = LoadConfig().metrics_poll_s) -> None:
        self.feed = feed
        self.poll_s = poll_s
        self._open: dict[str, list[float]] = {}  # instance -> [period end, retrieves, seconds, tokens]

    def add(self, instance_id: str, load_s: float, tokens: int, t: float) -> None:
        w = self._open.get(instance_id)
        if w is None:
            w = self._open[instance_id] = [(t // self.poll_s + 1) * self.poll_s, 0.0, 0.0, 0.0]
        elif t >= w[0]:
            if w[1] > 0:
                self.feed.on_retrieve(instance_id, w[1], w[2] / w[1], w[3] / w[1])
            w[:] = [(t // self.poll_s + 1) * self.poll_s, 0.0, 0.0, 0.0]
        w[1] += 1
        w[2] += load_s
        w[3] += tokens


def report_retrieve(polls: RetrievePolls | None, r: SimRequest, done_t: float) -> None:
    """What the engine's retrieve metrics count of ``r``: its load past the GPU hit, if any."""
    if polls is not None and r.global_tokens > 0 and r.load_s > 0:
        polls.add(r.inst.iid, r.load_s, r.global_tokens, done_t)
