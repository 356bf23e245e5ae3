"""Online price estimator: what prefill, fetches and queueing cost on each instance, learned from
what the cluster reports (issue 23). Pure: no I/O, no clock, no per-session state.

Per instance it fits one linear model of a request's time to first token (µs)::

    ttft = fixed_us                                        scheduling, tokenising, first decode step
         + n_comp * (prefill_us + prefill_us_per_ktok * L / 1000)   compute (attention: long contexts dearer)
         + n_glob * fetch_global_us + [n_glob > 0] * fetch_global_fixed_us   retrieve from the global tier
         + n_cpu * fetch_local_us  + [n_cpu > 0] * fetch_local_fixed_us     retrieve from the local CPU tier
         + queued * queue_us_per_tok                       prefill queued ahead of it at decision time
         + in_flight * inflight_us                         batched requests slowing its prefill

Where the engines export LMCache's retrieve metrics, each poll's retrieves (their mean time and
size) feed a separate fit of the retrieve itself (``observe_retrieve``)::

    retrieve = n_glob * fetch_global_us + fetch_global_fixed_us   (or the local CPU tier's prices)

It is reported beside the TTFT model's fetch prices and decides nothing: those say what a fetch
costs the request's TTFT, waits on the other loads of its step and on shared links included, which
is what a decision weighs; fed into the TTFT fit, the bare retrieve time pulled its fetch prices
down and the variant's decisions with them (docs/prices.md).

and one of the time per output token after the first (µs)::

    tpot = decode_us + in_flight * decode_us_per_req

by recursive least squares with exponential forgetting (``forget``: an observation's weight halves
after ``ln 2 / -ln forget`` later ones; 0.995 -> ~140 per instance), Huber weights on residuals
scaled by a robust running noise estimate (one outlier moves a price by at most ``huber_k`` noise
widths' worth), equations divided by the observed time (noise grows with the request), and a prior
for a cold start (the configured policy's prices, each with a prior standard deviation of
``prior_rel_std`` of its value). After forgetting, each price's variance is capped at
``prior_rel_std`` of the larger of its prior and its estimate, so an unexcited price drifts back to
no more uncertainty than the prior had (no wind-up).

A step change in a price (the fetch path slowing 4x) is followed by a fast shadow fit
(``fast_forget``, no Huber weights): when its running prediction error (each error clipped at 3
noise widths, so lone outliers barely move it) has stayed below ``switch_ratio`` of the slow fit's,
the slow one adopts its state. Synthetic data (tests/test_prices.py) and the simulator
(bench/prices.py) follow a 4x step within ~100-150 of that instance's requests.

Each instance's fit is shadowed the same way by the cluster's (pooled) fit, which learns from every
instance's reports: when the cluster's fit has predicted this instance's own requests clearly better
for a while (same ``switch_ratio`` and ``switch_after``), the instance's fit adopts its state. From a
prior far off (a fetch path 30x slower than the prior's) an instance, seeing an eighth of the reports,
otherwise lagged the cluster's fit for the whole of a simulated run, with a standard error that did
not show the lag (issue 23's traces, docs/prices.md).

Confidence of a price: its relative standard error ``sqrt(P_ii) / |price|`` (``rel_std``);
a price the data has not yet constrained keeps ``prior_rel_std``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

#: The TTFT model's coefficients, in µs per unit of each feature (see the module docstring).
TTFT_PRICES: tuple[str, ...] = (
    "fixed_us", "prefill_us", "prefill_us_per_ktok", "fetch_global_us", "fetch_global_fixed_us",
    "fetch_local_us", "fetch_local_fixed_us", "queue_us_per_tok", "inflight_us",
)  # fmt: skip
#: The retrieve fit's coefficients (LMCache's retrieve metrics): a subset of the TTFT model's names.
RETRIEVE_PRICES: tuple[str, ...] = ("fetch_global_us", "fetch_global_fixed_us", "fetch_local_us", "fetch_local_fixed_us")
#: The decode model's coefficients.
TPOT_PRICES: tuple[str, ...] = ("decode_us", "decode_us_per_req")
PRICE_NAMES: tuple[str, ...] = TTFT_PRICES + TPOT_PRICES

#: Cold-start prices: read off the default `qwen3-30b-a3b-h20` profile (prefill iteration times at
#: 4 k / 45 k / 120 k tokens of context; 98 KiB per token over the node's 25 GB/s NIC; PCIe ~25 GB/s
#: for the local CPU tier). The fixed parts, the queue and the in-flight slopes are guesses the
#: data replaces (their prior uncertainty is as wide as the value).
DEFAULT_PRIORS: dict[str, float] = {
    "fixed_us": 20_000.0, "prefill_us": 110.0, "prefill_us_per_ktok": 8.8, "fetch_global_us": 4.0,
    "fetch_global_fixed_us": 2_000.0, "fetch_local_us": 4.0, "fetch_local_fixed_us": 500.0,
    "queue_us_per_tok": 150.0, "inflight_us": 1_000.0, "decode_us": 20_000.0, "decode_us_per_req": 200.0,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class EstimatorConfig:
    forget: float = 0.995  # per observation of that instance; 1 = never forget
    prior_rel_std: float = 1.0  # prior standard deviation of each price, relative to its value
    huber_k: float = 2.0  # residuals beyond k noise widths get weight k / |r|
    noise0: float = 0.2  # initial relative noise (residual / predicted time)
    noise_rate: float = 0.02  # running update rate of the noise estimate
    fast_forget: float = 0.97  # the shadow fit that finds step changes (~23 observations' half-life)
    switch_rate: float = 0.05  # running update rate of each fit's prediction error
    switch_ratio: float = 0.8  # the slow fit adopts the fast one's state when its error is this much lower
    switch_after: int = 20  # observations at least between two adoptions
    # an instance's own price counts in decisions only as far as it differs from the cluster's by more
    # than z standard errors (2: the usual 95% test; 0 = each instance's own fit, unshrunk)
    shrink_z: float = 2.0
    priors: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_PRIORS))

    def __post_init__(self) -> None:
        if not 0.5 <= self.forget <= 1.0:
            raise ValueError("forget must be within [0.5, 1]")
        if not self.shrink_z >= 0:
            raise ValueError("shrink_z must be >= 0")
        if self.prior_rel_std <= 0 or self.huber_k <= 0 or self.noise0 <= 0 or not 0 < self.noise_rate < 1:
            raise ValueError("prior_rel_std, huber_k, noise0 must be > 0 and noise_rate within (0, 1)")
        unknown = set(self.priors) - set(PRICE_NAMES)
        if unknown:
            raise ValueError(f"unknown prices in priors: {', '.join(sorted(unknown))}")


@dataclass(frozen=True, slots=True)
class Observation:
    """One finished request as a done report and its routing decision describe it."""

    prompt_tokens: int  # L
    local_hit: int  # c: the decision's predicted local (GPU) hit on the chosen instance
    global_hit: int  # g: the decision's predicted global-tier hit
    ttft_s: float
    queued_tokens: float = 0.0  # prefill queued on the instance at decision time
    in_flight: float = 0.0  # requests in flight there at decision time
    cached_tokens: int | None = None  # what the engine reported reused (GPU + connector), when known
    e2e_s: float | None = None
    output_tokens: int = 0
    # where connector reuse the decision did not predict came from: the local CPU tier (the global
    # tier's contents are indexed, so its hits were predicted), or the global tier (a store the
    # router cannot see, and no local CPU tier)
    unpredicted: Literal["local_cpu", "global"] = "local_cpu"

    def split(self) -> tuple[int, int, int]:
        """(computed, fetched from the global tier, fetched from the local CPU tier) tokens.

        With the engine's cached count, reuse past the predicted GPU hit came through the connector:
        from the global tier up to what it was predicted to hold, the rest from the local CPU tier.
        Without it, the prediction stands. Reuse past both predictions comes from ``unpredicted``."""
        L, c, g = self.prompt_tokens, min(self.local_hit, self.prompt_tokens), min(self.global_hit, self.prompt_tokens)
        if self.cached_tokens is None:
            n_g = max(0, g - c)
            return L - max(c, g), n_g, 0
        cached = max(0, min(self.cached_tokens, L))
        gpu = min(c, cached)
        ext = cached - gpu
        n_g = min(ext, max(0, g - gpu))
        if self.unpredicted == "global":
            return L - cached, ext, 0
        return L - cached, n_g, ext - n_g


def ttft_features(o: Observation) -> np.ndarray:
    comp, n_g, n_cpu = o.split()
    return np.array([
        1.0, comp, comp * o.prompt_tokens / 1000.0, n_g, float(n_g > 0), n_cpu, float(n_cpu > 0),
        o.queued_tokens, o.in_flight,
    ])  # fmt: skip


class RobustRLS:
    """Huber-weighted recursive least squares with forgetting and a covariance capped at the prior.

    It fits each price relative to its prior (``theta = prior * t``, t starting at 1): the prices span
    five orders of magnitude, and unit-free parameters keep the covariance update well conditioned."""

    __slots__ = ("t", "unit", "P", "info", "noise", "n", "err", "_forget", "_k", "_cap", "_cfg")

    def __init__(self, prior: Sequence[float], cfg: EstimatorConfig, forget: float, huber_k: float) -> None:
        self._cfg = cfg
        self._forget = forget
        self._k = huber_k
        self.unit = np.maximum(np.abs(np.asarray(prior, dtype=np.float64)), 1e-9)
        self.t = np.asarray(prior, dtype=np.float64) / self.unit
        self._cap = cfg.prior_rel_std**2
        self.P = np.eye(len(self.t)) * self._cap
        # what the observations alone say about each price: the diagonal of their (forgotten,
        # Huber-weighted) information, without the prior's; 0 along a direction never excited
        self.info = np.zeros(len(self.t))
        self.noise = cfg.noise0
        self.err = cfg.noise0  # running mean |prediction error| (clipped at 3 noise widths), relative
        self.n = 0

    @property
    def theta(self) -> np.ndarray:
        return self.t * self.unit

    def update(self, x: np.ndarray, y: float) -> float:
        """Fold in y ~ theta . x; returns the Huber weight the observation got."""
        cfg = self._cfg
        scale = max(abs(y), 1e-9)  # relative equations (noise grows with the request), linear in t
        xs = x * self.unit / scale
        r = 1.0 - float(self.t @ xs) if y > 0 else -float(self.t @ xs)
        k = self._k * self.noise
        w = 1.0 if abs(r) <= k else k / abs(r)
        Px = self.P @ xs
        sig = min(self.noise, cfg.noise0)  # capped: a fit far off at first still learns
        gain = Px / (xs @ Px + sig * sig / w)
        self.t = self.t + gain * r
        P = (self.P - gain[:, None] * Px) / self._forget  # np.outer's products, without its wrapper
        self.info = self.info * self._forget + xs * xs * (w / (sig * sig))
        P = 0.5 * (P + P.T)
        # cap at the prior's relative uncertainty, of the prior or of the estimate whichever is larger
        # (no wind-up along directions the data does not excite; a price 40x its prior is not held to
        # the prior's absolute width); scaling rows and columns keeps P symmetric PSD
        cap = self._cap * np.maximum(1.0, self.t * self.t)
        sc = np.minimum(1.0, np.sqrt(cap / np.maximum(P.diagonal(), 1e-30)))
        self.P = P * (sc[:, None] * sc)
        # robust noise scale: an outlier moves it by at most its clipped size
        clipped = min(abs(r), 3.0 * self.noise)
        self.noise += cfg.noise_rate * (clipped * 1.2533 - self.noise)
        self.noise = max(self.noise, 1e-4)
        self.err += cfg.switch_rate * (clipped - self.err)
        self.n += 1
        return w

    def adopt(self, other: RobustRLS) -> None:
        self.t = other.t.copy()
        self.P = other.P.copy()
        self.info = other.info.copy()
        self.err = other.err

    def rel_std(self) -> np.ndarray:
        return np.sqrt(np.maximum(self.P.diagonal(), 0.0)) / np.maximum(np.abs(self.t), 1e-9)

    def data_std(self) -> np.ndarray:
        """Each price's standard error (µs units) as its observations alone determine it: never below
        the fit's own, infinite along a direction no observation excited (there the estimate is the
        prior's, whatever the prior's width)."""
        with np.errstate(divide="ignore"):
            data_var = np.where(self.info > 0, 1.0 / np.maximum(self.info, 1e-300), np.inf)
        return np.sqrt(np.maximum(data_var, np.maximum(self.P.diagonal(), 0.0))) * self.unit


class RetrieveFit:
    """The retrieve's own price from the engines' retrieve metrics: each poll's mean retrieve time
    against its mean size, by exponentially weighted least squares on relative equations (noise
    grows with the retrieve), Huber-weighted, with a weak ridge to the prior (a price no retrieve
    exercised, the local CPU tier's where every fetch is global, stays at the prior). Each equation
    is weighted by its predicted time (not its observed one, which would weigh a retrieve that
    slowed down less than the ones before it). A direct
    measurement of two numbers per tier needs none of the TTFT fit's caution: from a prior 30x off
    it finds the price in a handful of polls, and ``forget`` (the TTFT fit's ``fast_forget``) follows
    a step within a few dozen."""

    __slots__ = ("prior", "A", "b", "n", "noise", "_forget", "_ridge", "_theta")

    RIDGE = 1e-6  # the prior's weight: only a price no retrieve exercised keeps it

    def __init__(self, prior: Sequence[float], forget: float, noise0: float) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)
        d = len(self.prior)
        self._ridge = self.RIDGE / np.maximum(self.prior, 1e-9) ** 2
        self.A = np.zeros((d, d))
        self.b = np.zeros(d)
        self.n = 0
        self.noise = noise0
        self._forget = forget
        self._theta: np.ndarray | None = None

    @property
    def theta(self) -> np.ndarray:
        if self._theta is None:
            try:
                self._theta = np.linalg.solve(self.A + np.diag(self._ridge), self.b + self._ridge * self.prior)
            except np.linalg.LinAlgError:  # numerically singular: the least-squares solution instead
                self._theta = np.linalg.lstsq(self.A + np.diag(self._ridge), self.b + self._ridge * self.prior,
                                              rcond=None)[0]
        return self._theta

    def update(self, x: np.ndarray, y: float) -> None:
        pred = float(self.theta @ x) if self.n else y
        r = 1.0 - pred / y if self.n else 0.0
        k = 3.0 * self.noise
        # a prediction near zero (or below: a fit still far off) must not weigh one poll a millionfold
        w = (1.0 if abs(r) <= k else k / abs(r)) / max(pred, 0.1 * y) ** 2
        self.A = self.A * self._forget + w * (x[:, None] * x)
        self.b = self.b * self._forget + w * y * x
        self._theta = None
        if self.n:
            self.noise += 0.05 * (min(abs(r), k) * 1.2533 - self.noise)
            self.noise = max(self.noise, 1e-3)
        self.n += 1

    def rel_std(self) -> np.ndarray:
        cov = np.linalg.inv(self.A + np.diag(self._ridge)) * self.noise**2
        return np.sqrt(np.maximum(cov.diagonal(), 0.0)) / np.maximum(np.abs(self.theta), 1e-9)


class TwoRateRLS:
    """A slow robust fit (reported) shadowed by a fast one: when the fast one has predicted clearly
    better for a while (a price stepped: the fetch path slowed), the slow one adopts its state.
    Outliers do not trigger it: both fits see them, Huber-weighted and clipped alike.

    An instance's fit is also shadowed by the cluster's (pooled) fit, passed as ``ref``: when the
    cluster's has predicted this instance's own requests clearly better for a while, the instance's
    adopts its state (same rule, same thresholds). An instance sees a fraction of the cluster's
    reports, so from a prior far off (a slow fetch path: 30x the prior) its fit lags the cluster's
    for hundreds of requests, and its standard error does not show that lag."""

    __slots__ = ("slow", "fast", "switches", "ref_err", "ref_adoptions", "_since", "_ref_since", "_cfg")

    def __init__(self, prior: Sequence[float], cfg: EstimatorConfig) -> None:
        self._cfg = cfg
        self.slow = RobustRLS(prior, cfg, cfg.forget, cfg.huber_k)
        self.fast = RobustRLS(prior, cfg, cfg.fast_forget, 1e9)
        self.switches = 0
        self.ref_err = cfg.noise0  # running mean |prediction error| of ``ref`` on these observations
        self.ref_adoptions = 0
        self._since = 0
        self._ref_since = 0

    def update(self, x: np.ndarray, y: float, ref: RobustRLS | None = None) -> None:
        """Fold in y ~ theta . x; ``ref`` (not yet updated with it) is the fit this one may adopt."""
        cfg = self._cfg
        if ref is not None:
            # the reference's relative prediction error, clipped as this fit clips its own
            r = 1.0 - float(ref.theta @ x) / y if y > 0 else 1.0
            self.ref_err += cfg.switch_rate * (min(abs(r), 3.0 * self.slow.noise) - self.ref_err)
            self._ref_since += 1
        self.slow.update(x, y)
        self.fast.update(x, y)
        self._since += 1
        if self._since >= cfg.switch_after and self.fast.err < cfg.switch_ratio * self.slow.err:
            self.slow.adopt(self.fast)
            self.switches += 1
            self._since = 0
        if ref is not None and self._ref_since >= cfg.switch_after and self.ref_err < cfg.switch_ratio * self.slow.err:
            self.slow.adopt(ref)
            self.ref_adoptions += 1
            self._ref_since = 0

    def rel_std(self) -> np.ndarray:
        return self.slow.rel_std()

    def data_std(self) -> np.ndarray:
        return self.slow.data_std()


@dataclass(frozen=True, slots=True)
class InstancePrices:
    """What one instance's requests cost, as learned (µs; see the module docstring)."""

    fixed_us: float
    prefill_us: float
    prefill_us_per_ktok: float
    fetch_global_us: float
    fetch_global_fixed_us: float
    fetch_local_us: float
    fetch_local_fixed_us: float
    queue_us_per_tok: float
    inflight_us: float
    decode_us: float
    decode_us_per_req: float
    observations: int = 0
    mean_output: float = 0.0  # output tokens of a mean answer (0: none reported yet)
    ttft_rel_noise: float = 0.0  # the TTFT fit's robust relative residual scale (0: none yet)

    def prefill_token_us(self, context: int) -> float:
        """µs to compute one token of a request with ``context`` tokens."""
        return self.prefill_us + self.prefill_us_per_ktok * context / 1000.0

    def fetch_us(self, tokens: int) -> float:
        """µs to bring ``tokens`` back from the global tier (0 tokens: nothing)."""
        return self.fetch_global_us * tokens + self.fetch_global_fixed_us if tokens > 0 else 0.0


def _nonneg(v: float) -> float:
    return v if v > 0 else 0.0


class InstanceEstimator:
    __slots__ = ("ttft", "tpot", "mean_output", "global_share", "retrieve", "version", "_cfg", "_priors",
                 "_cache", "_vals", "_rel", "_data_se")

    def __init__(self, cfg: EstimatorConfig) -> None:
        pr = {**DEFAULT_PRIORS, **cfg.priors}
        self._cfg, self._priors = cfg, pr
        self.ttft = TwoRateRLS([pr[k] for k in TTFT_PRICES], cfg)
        self.tpot = TwoRateRLS([pr[k] for k in TPOT_PRICES], cfg)
        self.mean_output = 0.0
        # the global tier's share of the tokens this instance's requests fetched (the rest came from
        # the local CPU tier): how a retrieve measured on the engine splits between the two prices.
        # The paper's deployment (a GPU local tier, a CPU pool behind RDMA) fetches only globally.
        self.global_share = 1.0
        self.retrieve: RetrieveFit | None = None  # the retrieve fit (engine metrics), from the first poll on
        self.version = 0  # bumped by every observation: what a cached derivative was computed from
        self._cache: InstancePrices | None = None
        self._vals: tuple[float, ...] | None = None
        self._rel: tuple[float, ...] | None = None
        self._data_se: tuple[float, ...] | None = None

    def _changed(self) -> None:
        self.version += 1
        self._cache = self._vals = self._rel = self._data_se = None

    def observe(self, o: Observation, ref: InstanceEstimator | None = None) -> None:
        """Learn from one done report; ``ref`` (the cluster's estimator, before it learns from the same
        report) is the fit this one adopts when it predicts this instance's requests clearly better."""
        if not (o.ttft_s > 0 and math.isfinite(o.ttft_s)) or o.prompt_tokens <= 0:
            return
        x = ttft_features(o)
        self.ttft.update(x, o.ttft_s * 1e6, ref.ttft.slow if ref is not None else None)
        if x[3] + x[5] > 0:
            self.global_share += 0.02 * (x[3] / (x[3] + x[5]) - self.global_share)
        if o.output_tokens > 0:
            m = self.mean_output
            self.mean_output = float(o.output_tokens) if m == 0 else m + 0.02 * (o.output_tokens - m)
        if o.e2e_s is not None and o.output_tokens > 1 and math.isfinite(o.e2e_s) and o.e2e_s > o.ttft_s:
            self.observe_tpot((o.e2e_s - o.ttft_s) / (o.output_tokens - 1), o.in_flight, ref)
        self._changed()

    def observe_retrieve(self, mean_s: float, mean_tokens: float) -> None:
        """The engine's retrieves over an interval (LMCache's retrieve histogram): their mean time and
        size, one observation of the retrieve fit, split between the global tier and the local CPU tier
        by this instance's ``global_share``."""
        # an engine's nonsense (a retrieve of an hour, a billion tokens) teaches nothing
        if not (0 < mean_s <= 3600.0 and 0 <= mean_tokens <= 1e9):
            return
        if self.retrieve is None:
            pr = self._priors
            self.retrieve = RetrieveFit([pr[k] for k in RETRIEVE_PRICES], self._cfg.fast_forget, self._cfg.noise0)
        sg = self.global_share
        self.retrieve.update(np.array([mean_tokens * sg, sg, mean_tokens * (1.0 - sg), 1.0 - sg]), mean_s * 1e6)

    def retrieve_prices(self) -> dict[str, float] | None:
        """The retrieve fit's prices (µs; RETRIEVE_PRICES), None before any retrieve was observed."""
        r = self.retrieve
        return None if r is None else {k: _nonneg(float(v)) for k, v in zip(RETRIEVE_PRICES, r.theta)}

    def observe_tpot(self, tpot_s: float, running: float, ref: InstanceEstimator | None = None) -> None:
        """A time per output token at a batch of ``running`` requests (a done report or /metrics)."""
        if tpot_s > 0 and math.isfinite(tpot_s) and running >= 0:
            self.tpot.update(np.array([1.0, running]), tpot_s * 1e6, ref.tpot.slow if ref is not None else None)
            self._changed()

    def prices(self) -> InstancePrices:
        if self._cache is None:
            self._cache = InstancePrices(*self.values(), observations=self.ttft.slow.n, mean_output=self.mean_output,
                                         ttft_rel_noise=self.ttft.slow.noise if self.ttft.slow.n else 0.0)
        return self._cache

    def values(self) -> tuple[float, ...]:
        """The prices in PRICE_NAMES order. Negative fits (a price the data cannot separate from noise
        yet) count as free, never as a gain."""
        if self._vals is None:
            self._vals = tuple(_nonneg(float(v)) for v in (*self.ttft.slow.theta, *self.tpot.slow.theta))
        return self._vals

    def rel_std_vector(self) -> tuple[float, ...]:
        """Each price's relative standard error, in PRICE_NAMES order."""
        if self._rel is None:
            self._rel = tuple(float(v) for v in np.concatenate([self.ttft.rel_std(), self.tpot.rel_std()]))
        return self._rel

    def distinct(self, ratio: float) -> tuple[bool, bool]:
        """Whether this instance's own TTFT fit, and its decode fit, have predicted its requests
        clearly better than the cluster's fit has (running error below ``ratio`` of the cluster's):
        the evidence that it differs from the rest, by the same rule that makes a fit adopt the
        cluster's the other way round."""
        return (self.ttft.slow.err < ratio * self.ttft.ref_err, self.tpot.slow.err < ratio * self.tpot.ref_err)

    def data_std_vector(self) -> tuple[float, ...]:
        """Each price's standard error from this instance's own observations alone
        (``RobustRLS.data_std``; inf where none excited it), in PRICE_NAMES order."""
        if self._data_se is None:
            self._data_se = tuple(float(v) for v in np.concatenate([self.ttft.data_std(), self.tpot.data_std()]))
        return self._data_se

    def confidence(self) -> dict[str, float]:
        rs = self.rel_std_vector()
        return {k: round(float(v), 4) for k, v in zip(PRICE_NAMES, rs)}


class PriceBook:
    """Per-instance estimators, plus a pooled one over every instance (the cluster's price)."""

    def __init__(self, cfg: EstimatorConfig | None = None) -> None:
        self.cfg = cfg or EstimatorConfig()
        self._by: dict[str, InstanceEstimator] = {}
        self.pooled = InstanceEstimator(self.cfg)
        self._prior = InstanceEstimator(self.cfg).prices()
        # instance -> (its estimator's version, the pooled one's, the decision prices they gave): a
        # decision prices every candidate, and most of them learned nothing since the last one
        self._decided: dict[str, tuple[int, int, InstancePrices]] = {}

    def observe(self, instance_id: str, o: Observation) -> None:
        est = self._est(instance_id)
        est.observe(o, self.pooled)  # before the pooled fit learns from it: a prediction, not a fit
        self.pooled.observe(o)

    def _est(self, instance_id: str) -> InstanceEstimator:
        est = self._by.get(instance_id)
        if est is None:
            est = self._by[instance_id] = InstanceEstimator(self.cfg)
        return est

    def observe_tpot(self, instance_id: str, tpot_s: float, running: float) -> None:
        self._est(instance_id).observe_tpot(tpot_s, running, self.pooled)
        self.pooled.observe_tpot(tpot_s, running)

    def observe_retrieve(self, instance_id: str, mean_s: float, mean_tokens: float) -> None:
        """An interval's retrieves on one engine (``InstanceEstimator.observe_retrieve``)."""
        est = self._est(instance_id)
        est.observe_retrieve(mean_s, mean_tokens)
        self.pooled.observe_retrieve(mean_s, mean_tokens)

    def prices(self, instance_id: str) -> InstancePrices:
        est = self._by.get(instance_id)
        return est.prices() if est is not None else self._prior

    def decision_prices(self, instance_id: str) -> InstancePrices:
        """The prices a decision compares instances by: the cluster's (pooled) price, moved towards
        the instance's own only as far as their difference is significant (positive-part shrinkage:
        weight ``max(0, 1 - (z se / d)^2)``, ``z`` = ``self.cfg.shrink_z``, ``se`` the two estimates'
        combined standard error). A router that takes the argmin over instances priced with
        independent noisy fits sends the traffic to whichever fit happens to be low (the winner's
        curse); identical instances then differ by noise only, and get the same price. Only an
        instance whose own fit has predicted its requests clearly better than the cluster's (it has
        shown it differs) keeps any of its own prices, and of those only the ones its own
        observations constrain."""
        est = self._by.get(instance_id)
        if est is None:
            return self.pooled.prices()
        if self.cfg.shrink_z <= 0:
            return est.prices()
        pooled = self.pooled
        hit = self._decided.get(instance_id)
        if hit is not None and hit[0] == est.version and hit[1] == pooled.version:
            return hit[2]
        own, pool = est.prices(), pooled.prices()
        # An instance's own price counts only where the instance has shown it differs: its own fit
        # predicted its requests clearly better than the cluster's did. An instance fit starts at the
        # configured prior, and a price its few requests barely exercise stays near it (a fit that saw
        # a few fetches at 30x the prior's price still said 0.2-0.6x the cluster's, with a standard
        # error too small to reveal the prior's pull: issue 23's traces at 16 instances).
        ttft_own, tpot_own = est.distinct(self.cfg.switch_ratio)
        vals: Sequence[float] = pooled.values()
        if ttft_own or tpot_own:  # most instances most of the time have not: the cluster's prices as they are
            vals = self._shrunk(est, ttft_own, tpot_own)
        out = InstancePrices(*vals, observations=own.observations, mean_output=pool.mean_output or own.mean_output,
                             ttft_rel_noise=pool.ttft_rel_noise)
        self._decided[instance_id] = (est.version, pooled.version, out)
        return out

    def _shrunk(self, est: InstanceEstimator, ttft_own: bool, tpot_own: bool) -> list[float]:
        """The cluster's prices, each moved towards ``est``'s own where the gate is open, as far as
        the two differ significantly (``decision_prices``)."""
        pooled = self.pooled
        z2 = self.cfg.shrink_z**2
        gate = (ttft_own,) * len(TTFT_PRICES) + (tpot_own,) * len(TPOT_PRICES)
        vals = []
        # an instance's error is its data's alone: a price its requests never exercised (an instance
        # whose sessions never fetched) sits at the prior, which says nothing about this cluster
        for a, b, sa, rb, g in zip(est.values(), pooled.values(), est.data_std_vector(), pooled.rel_std_vector(), gate):
            if not g:
                vals.append(b)
                continue
            d2 = (a - b) ** 2
            se2 = sa * sa + (rb * b) ** 2
            w = max(0.0, 1.0 - z2 * se2 / d2) if d2 > 0 and se2 < math.inf else 0.0
            vals.append(b + w * (a - b))
        return vals

    def forget_instance(self, instance_id: str) -> None:
        self._by.pop(instance_id, None)
        self._decided.pop(instance_id, None)

    def instances(self) -> list[str]:
        return list(self._by)

    def snapshot(self) -> dict[str, object]:
        """Estimates and their confidence (relative standard errors), per instance and pooled."""

        def one_retrieve(e: InstanceEstimator) -> dict[str, object] | None:
            r = e.retrieve
            if r is None:
                return None
            return {"prices": {k: round(v, 3) for k, v in (e.retrieve_prices() or {}).items()},
                    "rel_std": {k: round(float(v), 4) for k, v in zip(RETRIEVE_PRICES, r.rel_std())},
                    "observations": r.n, "global_share": round(e.global_share, 4)}

        def one(e: InstanceEstimator) -> dict[str, object]:
            p = e.prices()
            return {
                "prices": {k: round(getattr(p, k), 3) for k in PRICE_NAMES},
                "rel_std": e.confidence(),
                "observations": p.observations,
                "mean_output": round(p.mean_output, 1),
                "switches": e.ttft.switches,
                "adopted_cluster": e.ttft.ref_adoptions,
                "retrieve": one_retrieve(e),
                "noise": round(float(e.ttft.slow.noise), 4),
            }

        return {
            "forget": self.cfg.forget,
            "cluster": one(self.pooled),
            "instances": {iid: one(e) for iid, e in self._by.items()},
        }


@dataclass(frozen=True, slots=True)
class _Routed:
    instance_id: str
    prompt_tokens: int
    local_hit: int
    global_hit: int
    queued_tokens: float
    in_flight: float


class PriceFeed:
    """Joins each request's routing decision (what was predicted, the queue it joined) to its done
    report and feeds the result to a :class:`PriceBook`. Holds one small record per request in flight
    (at most ``max_pending``: the oldest are dropped first when done reports go missing)."""

    def __init__(self, book: PriceBook | None = None, max_pending: int = 200_000,
                 unpredicted: Literal["local_cpu", "global"] = "local_cpu") -> None:
        self.book = book or PriceBook()
        self.unpredicted: Literal["local_cpu", "global"] = unpredicted  # see Observation.unpredicted
        self.max_pending = max_pending
        self._pending: dict[str, _Routed] = {}
        self.stats = {"routed": 0, "observed": 0, "unmatched_done": 0, "dropped_pending": 0, "no_ttft": 0,
                      "retrieve_polls": 0}

    def on_routed(self, request_id: str, instance_id: str, prompt_tokens: int, local_hit: int, global_hit: int,
                  queued_tokens: float, in_flight: float) -> None:
        pend = self._pending
        pend.pop(request_id, None)  # a re-route replaces the earlier decision
        pend[request_id] = _Routed(instance_id, prompt_tokens, local_hit, global_hit, queued_tokens, in_flight)
        self.stats["routed"] += 1
        if len(pend) > self.max_pending:
            del pend[next(iter(pend))]
            self.stats["dropped_pending"] += 1

    def on_done(self, request_id: str, *, ok: bool = True, ttft_s: float | None = None, e2e_s: float | None = None,
                output_tokens: int = 0, cached_tokens: int | None = None, prompt_tokens: int | None = None) -> bool:
        """Learn from one done report; False when it taught nothing (unknown id, failed, no TTFT)."""
        r = self._pending.pop(request_id, None)
        if r is None:
            self.stats["unmatched_done"] += 1
            return False
        if not ok or ttft_s is None:
            self.stats["no_ttft"] += 1
            return False
        L = prompt_tokens if prompt_tokens else r.prompt_tokens
        self.book.observe(r.instance_id, Observation(
            L, r.local_hit, r.global_hit, ttft_s, r.queued_tokens, r.in_flight, cached_tokens, e2e_s, output_tokens,
            self.unpredicted))
        self.stats["observed"] += 1
        return True

    def on_retrieve(self, instance_id: str, count: float, mean_s: float, mean_tokens: float) -> None:
        """``count`` retrieves on one engine since its last poll, their mean seconds and tokens."""
        if count > 0:
            self.book.observe_retrieve(instance_id, mean_s, mean_tokens)
            self.stats["retrieve_polls"] += 1

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def snapshot(self) -> dict[str, object]:
        return {**self.book.snapshot(), "feed": {**self.stats, "pending": len(self._pending)}}
