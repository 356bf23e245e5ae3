"""The simulator's price estimator: the router learns each instance's prices from the simulated done
reports alone (TTFT, e2e, output and cached tokens, the decision's predicted hits and the queue it
joined), exactly as the controller does from the gateway's, and never reads the profile's constants.
Attached only when the policy decides with prices (``needs={"prices"}``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

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
    prior = ECTParams.from_params(policy.params).prior_prices() if policy.name.startswith("smetric_ect") else {}
    router.prices = PriceFeed(PriceBook(EstimatorConfig(priors=prior)))
    return router.prices


def report_done(feed: PriceFeed | None, r: SimRequest, done_t: float) -> None:
    """The done report a gateway would send for ``r``, finished at ``done_t``."""
    if feed is None:
        return
    ttft = r.first_token - r.arrival
    feed.on_done(r.rid, ttft_s=ttft if math.isfinite(ttft) else None, e2e_s=done_t - r.arrival,
                 output_tokens=r.output, cached_tokens=r.local_tokens + r.global_tokens, prompt_tokens=r.input)
