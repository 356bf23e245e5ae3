"""The controller's price estimator (smetric_lmc.prices): built from the policy's configured prices
as the cold-start prior, fed by every done report (RouteCore), exposed in the ``stats`` reply
(``prices``) and to Prometheus as ``smetric_price_*``."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from smetric_lmc.config import PolicyConfig
from smetric_lmc.policy.smetric_ect import ECTParams
from smetric_lmc.prices import PRICE_NAMES, EstimatorConfig, PriceBook, PriceFeed

log = logging.getLogger(__name__)


def make_feed(policy: PolicyConfig) -> PriceFeed:
    """A feed whose prior is the configured variant's prices (its defaults for any other policy)."""
    params = policy.params if policy.name.startswith("smetric_ect") else {}
    return PriceFeed(PriceBook(EstimatorConfig(**ECTParams.from_params(params).estimator_settings())))  # type: ignore[arg-type]


class PriceCollector(Collector):
    """``smetric_price_<name>{backend}`` (µs; ``backend="cluster"``: the pooled fit),
    ``smetric_price_rel_std{backend,price}`` (its relative standard error),
    ``smetric_price_ttft_noise{backend}`` (the TTFT fit's relative residual scale: ``smetric_ect`` moves a
    follow-up off its holder only for a saving above ``move_z`` times it) and
    ``smetric_price_observations{backend}``, and from LMCache's retrieve metrics
    ``smetric_price_retrieve{backend,price}`` (µs: the retrieve fit, which decides nothing) and
    ``smetric_price_retrieve_observations{backend}`` (the polls it learned from), read at scrape time (``backend`` as in controller/metrics.py)."""

    def __init__(self, feed: PriceFeed) -> None:
        self._feed = feed

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        try:
            book = self._feed.book
            rows = [("cluster", book.pooled)] + [(iid, book._by[iid]) for iid in book.instances()]
        except Exception:  # a scrape must never take the controller down
            log.exception("metrics: price snapshot failed")
            return
        fams = {k: GaugeMetricFamily(f"smetric_price_{k}", f"learned price {k} (µs)", labels=["backend"])
                for k in PRICE_NAMES}
        rel = GaugeMetricFamily("smetric_price_rel_std", "relative standard error of a learned price",
                                labels=["backend", "price"])
        obs = GaugeMetricFamily("smetric_price_observations", "done reports a price fit has learned from",
                                labels=["backend"])
        rprice = GaugeMetricFamily("smetric_price_retrieve", "retrieve price measured by LMCache's metrics (µs)",
                                   labels=["backend", "price"])
        retr = GaugeMetricFamily("smetric_price_retrieve_observations",
                                 "engine metrics polls of LMCache retrieves a price fit has learned from",
                                 labels=["backend"])
        noise = GaugeMetricFamily("smetric_price_ttft_noise", "relative residual scale of the learned TTFT fit",
                                  labels=["backend"])
        for iid, est in rows:
            p = est.prices()
            for k in PRICE_NAMES:
                fams[k].add_metric([iid], getattr(p, k))
            for k, v in est.confidence().items():
                rel.add_metric([iid, k], v)
            obs.add_metric([iid], p.observations)
            retr.add_metric([iid], est.retrieve.n if est.retrieve is not None else 0)
            for k, v in (est.retrieve_prices() or {}).items():
                rprice.add_metric([iid, k], v)
            noise.add_metric([iid], p.ttft_rel_noise)
        yield from fams.values()
        yield rel
        yield obs
        yield rprice
        yield retr
        yield noise
