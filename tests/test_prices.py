"""The price estimator (smetric_lmc.prices): convergence to known prices on synthetic done reports
(with outliers), following a 4x step in the fetch price, the done-report feed, its exposure in the
controller's stats reply and Prometheus, and the simulator's hook (it learns from simulated done
reports only)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from smetric_lmc.config import PolicyConfig
from smetric_lmc.controller.prices import PriceCollector, make_feed
from smetric_lmc.prices import (
    DEFAULT_PRIORS,
    TTFT_PRICES,
    EstimatorConfig,
    Observation,
    PriceBook,
    PriceFeed,
    ttft_features,
)
from smetric_lmc.wire import DoneReport, RouteRequest, StatsRequest

# true prices far from the priors (a 10x slower fetch path, a dearer prefill, a longer queue)
TRUE = {**DEFAULT_PRIORS, "prefill_us": 150.0, "prefill_us_per_ktok": 12.0, "fetch_global_us": 40.0,
        "fetch_global_fixed_us": 5000.0, "queue_us_per_tok": 200.0, "inflight_us": 3000.0, "fixed_us": 30000.0}  # fmt: skip


def synthetic(rng: np.random.Generator, n: int, true: dict[str, float], outliers: float = 0.05) -> list[Observation]:
    """Done reports with 5% lognormal noise and a share of 5x outliers (stalls)."""
    out = []
    theta = np.array([true[k] for k in TTFT_PRICES])
    for _ in range(n):
        L = int(rng.integers(1000, 40000))
        follow = rng.random() < 0.8
        c = int(L * rng.uniform(0.5, 0.95)) if follow and rng.random() < 0.5 else 0
        g = int(L * rng.uniform(0.5, 0.95)) if follow and c == 0 and rng.random() < 0.7 else 0
        q = float(rng.integers(0, 5000)) if rng.random() < 0.3 else 0.0
        f = float(rng.integers(0, 10))
        y = float(theta @ ttft_features(Observation(L, c, g, 1.0, q, f))) / 1e6 * float(np.exp(rng.normal(0, 0.05)))
        if rng.random() < outliers:
            y *= 5
        out.append(Observation(L, c, g, y, q, f))
    return out


def test_converges_to_known_prices_despite_outliers() -> None:
    rng = np.random.default_rng(0)
    book = PriceBook()
    for o in synthetic(rng, 2000, TRUE):
        book.observe("a", o)
    p = book.prices("a")
    assert p.fetch_global_us == pytest.approx(40.0, rel=0.15)
    assert p.prefill_token_us(20_000) == pytest.approx(150 + 12 * 20, rel=0.15)
    assert p.queue_us_per_tok == pytest.approx(200.0, rel=0.15)
    conf = book.snapshot()["instances"]["a"]["rel_std"]  # type: ignore[index]
    # constrained prices are confident; one no request exercised keeps the prior's uncertainty
    assert conf["fetch_global_us"] < 0.2 and conf["fetch_local_us"] == pytest.approx(1.0)


def test_outliers_matter_without_the_huber_weights() -> None:
    rng = np.random.default_rng(0)
    data = synthetic(rng, 2000, TRUE, outliers=0.1)
    robust, plain = PriceBook(), PriceBook(EstimatorConfig(huber_k=1e9))
    for o in data:
        robust.observe("a", o)
        plain.observe("a", o)
    err = [abs(b.prices("a").prefill_token_us(20_000) / 390 - 1) for b in (robust, plain)]
    assert err[0] < 0.15 and err[0] < err[1]


def test_follows_a_4x_step_in_the_fetch_price() -> None:
    rng = np.random.default_rng(1)
    book = PriceBook()
    for o in synthetic(rng, 1500, TRUE):
        book.observe("a", o)
    slow = {**TRUE, "fetch_global_us": 160.0}
    for o in synthetic(rng, 600, slow):
        book.observe("a", o)
    # the forgetting horizon (forget 0.995) and the fast shadow fit bring it most of the way back
    assert book.prices("a").fetch_global_us == pytest.approx(160.0, rel=0.3)


def test_without_forgetting_the_step_is_not_followed() -> None:
    rng = np.random.default_rng(1)
    book = PriceBook(EstimatorConfig(forget=1.0, fast_forget=1.0))
    for o in synthetic(rng, 1500, TRUE):
        book.observe("a", o)
    for o in synthetic(rng, 600, {**TRUE, "fetch_global_us": 160.0}):
        book.observe("a", o)
    assert book.prices("a").fetch_global_us < 100.0


def test_cached_tokens_split_reuse_between_the_tiers() -> None:
    # predicted: 1,000 on the GPU, 3,000 in the global tier; the engine reused 3,500
    o = Observation(5000, 1000, 3000, 1.0, cached_tokens=3500)
    assert o.split() == (1500, 2000, 500)  # computed, from the global tier, from the local CPU tier
    assert Observation(5000, 1000, 3000, 1.0).split() == (2000, 2000, 0)


def test_feed_joins_decisions_to_done_reports_and_bounds_its_memory() -> None:
    feed = PriceFeed(max_pending=2)
    feed.on_routed("r1", "a", 1000, 0, 0, 0.0, 0.0)
    assert feed.on_done("r1", ttft_s=0.2, e2e_s=1.0, output_tokens=10)
    assert not feed.on_done("r1", ttft_s=0.2)  # a duplicate teaches nothing
    for k in range(3):
        feed.on_routed(f"x{k}", "a", 1000, 0, 0, 0.0, 0.0)
    assert feed.stats["dropped_pending"] == 1 and not feed.on_done("x0", ttft_s=0.1)
    feed.on_routed("y", "a", 1000, 0, 0, 0.0, 0.0)
    assert not feed.on_done("y", ok=False, ttft_s=None)
    assert feed.book.prices("a").observations == 1


def test_the_controller_reports_prices_in_stats_and_prometheus() -> None:
    from tests.test_controller_service import make_core

    core = make_core(2)
    core.router.prices = core.fallback.prices = make_feed(PolicyConfig(name="smetric_ect", params={"fetch_us": 9.0}))
    assert core.router.prices.book.prices("i0").fetch_global_us == 9.0  # the configured prior
    from smetric_lmc.wire import decode_reply, encode

    for k in range(20):
        core.handle(encode(RouteRequest(request_id=f"r{k}", token_ids=list(range(64)))))
        core.handle(encode(DoneReport(request_id=f"r{k}", prompt_tokens=64, output_tokens=8, ttft_s=0.05, e2e_s=0.2)))
    stats = decode_reply(core.handle(encode(StatsRequest()))).stats  # type: ignore[union-attr]
    assert stats["prices"]["feed"]["observed"] == 20
    assert stats["prices"]["cluster"]["observations"] == 20
    reg = CollectorRegistry()
    reg.register(PriceCollector(core.router.prices))
    text = generate_latest(reg).decode()
    assert 'smetric_price_fetch_global_us{backend="cluster"} 9.0' in text
    assert 'smetric_price_observations{backend="cluster"} 20.0' in text
    assert 'smetric_price_retrieve_observations{backend="cluster"} 0.0' in text
    core.router.prices.book.observe_retrieve("i0", 0.2, 4000.0)
    stats = decode_reply(core.handle(encode(StatsRequest()))).stats  # type: ignore[union-attr]
    assert stats["prices"]["instances"]["i0"]["retrieve"]["observations"] == 1  # the stats reply carries it
    text = generate_latest(reg).decode()
    assert 'smetric_price_retrieve_observations{backend="cluster"} 1.0' in text
    assert 'smetric_price_retrieve{backend="cluster",price="fetch_global_us"}' in text
    assert 'smetric_price_rel_std{backend="cluster",price="prefill_us"}' in text
    noise = core.router.prices.book.pooled.prices().ttft_rel_noise
    assert noise > 0 and f'smetric_price_ttft_noise{{backend="cluster"}} {noise!r}' in text


def test_the_simulator_learns_prices_from_its_done_reports_only() -> None:
    from smetric_lmc.lab.sim.cluster import Simulator
    from tests.test_sim import cfg, toy

    sim = Simulator(toy(), cfg(), PolicyConfig(name="smetric_ect"))
    assert sim.price_feed is not None and sim.router.prices is sim.price_feed
    sim.run()
    # every finished request was a done report the estimator learnt from
    assert sim.price_feed.stats["observed"] == sim.price_feed.stats["routed"] > 0
    assert sim.price_feed.book.prices(sim.instances[0].iid).observations > 0
    # a baseline runs without one
    assert Simulator(toy(), cfg(), PolicyConfig(name="lmetric")).price_feed is None


def test_the_simulator_feeds_the_retrieves_its_engines_metrics_would_show() -> None:
    """With a global tier, the requests that fetched are summed per instance over each poll period,
    as the controller's poller reads LMCache's retrieve histogram, and learnt from as such."""
    from smetric_lmc.lab.sim.cluster import Simulator
    from tests.test_sim import cfg, toy

    sim = Simulator(toy(), cfg(global_tier="full", rate=2.0), PolicyConfig(name="smetric_ect"))
    assert sim.retrieve_polls is not None
    res = sim.run()
    fetched = int((res.cols["global_tokens"] > 0).sum())
    assert fetched > 0, "the toy workload must fetch from the global tier"
    polls = sim.price_feed.stats["retrieve_polls"]  # type: ignore[union-attr]
    assert 0 < polls <= fetched
    snap = sim.price_feed.book.snapshot()["instances"]  # type: ignore[union-attr]
    assert sum(v["retrieve"]["observations"] for v in snap.values() if v["retrieve"]) == polls  # type: ignore[index, union-attr]


def test_decisions_compare_instances_at_the_cluster_price_unless_one_differs_significantly() -> None:
    """Identical instances fitted on independent noisy reports differ by noise only: a decision that
    takes the argmin over their own fits sends traffic to whichever is low (the winner's curse), so
    decision_prices shrinks each to the pooled fit. An instance that is really dearer keeps its price."""
    rng = np.random.default_rng(3)
    slow = {**TRUE, "fetch_global_us": 160.0}  # instance "c": its fetch path is 4x slower
    book = PriceBook()
    for a, b, c in zip(synthetic(rng, 1500, TRUE, 0.0), synthetic(rng, 1500, TRUE, 0.0), synthetic(rng, 1500, slow, 0.0)):
        book.observe("a", a)
        book.observe("b", b)
        book.observe("c", c)
    own = [book.prices(i).queue_us_per_tok for i in "ab"]
    shrunk = [book.decision_prices(i).queue_us_per_tok for i in "ab"]
    assert own[0] != own[1]  # the two fits differ by their noise
    # shrunk towards the pool (equal where the difference is not significant), never further apart
    assert abs(shrunk[0] - shrunk[1]) <= abs(own[0] - own[1])
    assert book.decision_prices("c").fetch_global_us == pytest.approx(book.prices("c").fetch_global_us, rel=0.05)
    assert book.decision_prices("c").fetch_global_us > 2 * book.decision_prices("a").fetch_global_us
    # c may adopt the cluster's fit while every fit is still far from its prior, but its own reports
    # then bring it back to its own price: the cluster's fit (a mix) predicts c worse than c's does
    assert book.prices("c").fetch_global_us == pytest.approx(160.0, rel=0.15)
    # z = 0 turns shrinkage off; an instance with no reports yet gets the cluster's price
    raw = PriceBook(EstimatorConfig(shrink_z=0.0))
    raw.observe("a", synthetic(rng, 1, TRUE)[0])
    assert raw.decision_prices("a") == raw.prices("a")
    assert book.decision_prices("new") == book.pooled.prices()
    with pytest.raises(ValueError, match="shrink_z"):
        EstimatorConfig(shrink_z=-1.0)


def test_the_variants_shrink_z_reaches_the_controller_and_the_simulator() -> None:
    """``policy.params.shrink_z`` sets the estimator's shrinkage wherever the variant learns prices."""
    from smetric_lmc.config import PolicyConfig
    from smetric_lmc.controller.prices import make_feed
    from smetric_lmc.lab.sim.prices_hook import attach

    pol = PolicyConfig(name="smetric_ect", params={"shrink_z": 0.5})
    assert make_feed(pol).book.cfg.shrink_z == 0.5
    assert make_feed(PolicyConfig(name="smetric_ect")).book.cfg.shrink_z == EstimatorConfig().shrink_z == 2.0
    router = SimpleNamespace(policy=SimpleNamespace(needs={"prices"}), prices=None)  # what attach reads
    feed = attach(router, pol)  # type: ignore[arg-type]
    assert feed is not None and feed.book.cfg.shrink_z == 0.5
    with pytest.raises(ValueError, match="shrink_z"):
        make_feed(PolicyConfig(name="smetric_ect", params={"shrink_z": -1}))


def test_an_instance_fit_that_lags_the_cluster_adopts_the_cluster_fit() -> None:
    """Eight identical instances, a fetch path 30x the prior's price (0.8 GB/s against the 25 GB/s
    prior): each instance sees an eighth of the reports, and alone its fit is still far below the
    truth after 100 of them, while the cluster's fit (800 reports) has found it. An instance's fit
    adopts the cluster's once the cluster's predicts its own requests clearly better, so decisions
    price fetches at the learned price instead of the lagging ones (issue 23's traces)."""
    rng = np.random.default_rng(5)
    true = {**TRUE, "fetch_global_us": 30 * DEFAULT_PRIORS["fetch_global_us"]}
    book, alone = PriceBook(), PriceBook()
    ids = [f"i{k}" for k in range(8)]
    for k, o in enumerate(synthetic(rng, 800, true)):
        book.observe(ids[k % 8], o)
        if k % 8 == 0:
            alone.observe("i0", o)  # the same reports as i0 gets, with no cluster to compare to
    assert alone.prices("i0").fetch_global_us < 0.5 * true["fetch_global_us"]
    for i in ids:
        assert book.prices(i).fetch_global_us == pytest.approx(true["fetch_global_us"], rel=0.15)
        assert book.decision_prices(i).fetch_global_us == pytest.approx(true["fetch_global_us"], rel=0.1)
    assert all(book.snapshot()["instances"][i]["adopted_cluster"] >= 1 for i in ids)  # type: ignore[index]


def _body(running: float, itl: tuple[float, float] | None, name: str = "vllm:inter_token_latency_seconds") -> str:
    rows = ["# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{engine="0"}} {running}']
    if itl is not None:
        rows += [f"# TYPE {name} histogram", f'{name}_bucket{{engine="0",le="+Inf"}} {itl[1]}',
                 f'{name}_sum{{engine="0"}} {itl[0]}', f'{name}_count{{engine="0"}} {itl[1]}']
    return "\n".join(rows) + "\n"


def test_the_engines_inter_token_latency_deltas_are_tpot_observations() -> None:
    from smetric_lmc.controller.engine_metrics import ItlDeltas, parse_engine_metrics

    d = ItlDeltas()
    assert d.update("a", parse_engine_metrics(_body(4, (10.0, 100.0)))) is None  # the first poll is the baseline
    assert d.update("a", parse_engine_metrics(_body(6, (13.0, 130.0)))) == pytest.approx((0.1, 6.0))
    assert d.update("a", parse_engine_metrics(_body(6, (13.0, 130.0)))) is None  # no token since: nothing learnt
    assert d.update("a", parse_engine_metrics(_body(2, (1.0, 10.0)))) is None  # the engine restarted: a new baseline
    assert d.update("a", parse_engine_metrics(_body(2, (1.5, 20.0)))) == pytest.approx((0.05, 2.0))
    # vLLM v0's name is read too; an engine exporting neither (or half a histogram) teaches nothing
    s = parse_engine_metrics(_body(1, (2.0, 4.0), "vllm:time_per_output_token_seconds"))
    assert (s.itl_sum_s, s.itl_count, s.requests) == (2.0, 4.0, 1)
    assert parse_engine_metrics(_body(1, None)).itl_sum_s is None
    half = _body(1, None) + '# TYPE vllm:inter_token_latency_seconds histogram\nvllm:inter_token_latency_seconds_sum{engine="0"} 1.0\n'
    assert parse_engine_metrics(half).itl_sum_s is None


async def test_the_poller_feeds_a_mock_engines_tpot_to_the_price_book() -> None:
    """A real mock engine's /metrics, polled by the controller's poller: each poll's inter-token
    latency delta becomes a TPOT observation of that instance."""
    import aiohttp

    from smetric_lmc.controller.engine_metrics import EngineMetricsPoller
    from smetric_lmc.lab.mock_engine.cli import options, running_mocks
    from smetric_lmc.load import LoadTracker

    book = PriceBook()
    seen: list[tuple[str, float, float]] = []

    def on_tpot(iid: str, tpot_s: float, running: float) -> None:
        seen.append((iid, tpot_s, running))
        book.observe_tpot(iid, tpot_s, running)

    async with running_mocks(options(speed=100.0)) as mocks, aiohttp.ClientSession() as http:
        url = mocks[0][0].http_url
        poller = EngineMetricsPoller({"m0": url}, LoadTracker(), on_tpot=on_tpot)
        try:
            await poller.poll_once()  # the baseline
            for k in range(3):
                async with http.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [k + 1] * 64,
                                                                     "max_tokens": 20}) as r:
                    assert r.status == 200
            await poller.poll_once()
        finally:
            await poller.close()
    assert len(seen) == 1 and seen[0][0] == "m0" and seen[0][1] > 0
    assert book.instances() == ["m0"] and book.pooled.tpot.slow.n == 1


def test_retrieve_observations_measure_the_retrieve_price_and_decide_nothing() -> None:
    """A fetch path 30x the prior's price. The engines' retrieve metrics (each poll's mean retrieve
    time and size) feed a fit of the retrieve alone, which finds that price from a few dozen polls,
    while the TTFT fit, from 150 done reports (a third of them fetch), is still on its way. The
    retrieve fit decides nothing: the TTFT fit and the decision prices are those of a book without it."""
    true = {**TRUE, "fetch_global_us": 30 * DEFAULT_PRIORS["fetch_global_us"]}
    for seed in (3, 4, 5):
        rng = np.random.default_rng(seed)
        alone, both = PriceBook(), PriceBook()
        for k, o in enumerate(synthetic(rng, 150, true)):
            alone.observe("a", o)
            both.observe("a", o)
            if k % 4 == 3:  # a poll every fourth report
                tokens = float(rng.integers(2000, 30000))
                secs = (true["fetch_global_us"] * tokens + true["fetch_global_fixed_us"]) / 1e6
                both.observe_retrieve("a", secs * float(np.exp(rng.normal(0, 0.05))), tokens)
        got = both._by["a"].retrieve_prices()
        assert got is not None and got["fetch_global_us"] == pytest.approx(true["fetch_global_us"], rel=0.05)
        assert both.pooled.retrieve_prices()["fetch_global_us"] == pytest.approx(got["fetch_global_us"])  # type: ignore[index]
        assert both.prices("a") == alone.prices("a") and both.decision_prices("a") == alone.decision_prices("a")
        assert both.prices("a").fetch_global_us < 0.85 * true["fetch_global_us"]  # the TTFT fit, not there yet
        snap = both.snapshot()["instances"]["a"]["retrieve"]  # type: ignore[index]
        assert snap["observations"] == 37 and snap["prices"]["fetch_global_us"] == pytest.approx(got["fetch_global_us"], abs=1e-3)
    assert alone.snapshot()["instances"]["a"]["retrieve"] is None  # type: ignore[index]
    # nonsense from an engine teaches nothing
    for bad in ((0.0, 100.0), (float("nan"), 100.0), (0.1, -1.0), (float("inf"), 5.0), (0.1, float("nan")),
                (0.1, 1e300), (1e300, 10.0)):
        both.observe_retrieve("a", *bad)
    assert both.snapshot()["instances"]["a"]["retrieve"]["observations"] == 37  # type: ignore[index]


def test_a_retrieve_splits_between_the_tiers_as_the_instances_fetches_did() -> None:
    """Where the done reports show the connector's reuse coming from the local CPU tier (the router
    predicted no global hit), a retrieve the engine measured prices the local CPU tier."""
    book = PriceBook()
    for k in range(300):
        L = 8000 + 10 * k
        # reuse past the GPU hit with no global hit predicted: the local CPU tier's
        book.observe("a", Observation(L, 0, 0, 0.5 + L * 1e-5, cached_tokens=L // 2))
    assert book._by["a"].global_share < 0.01
    for k in range(30):
        tokens = 2000.0 + 100 * k
        book.observe_retrieve("a", (500 + 20 * tokens) / 1e6, tokens)
    got = book._by["a"].retrieve_prices()
    assert got is not None and got["fetch_local_us"] == pytest.approx(20.0, rel=0.1)
    assert got["fetch_global_us"] == pytest.approx(DEFAULT_PRIORS["fetch_global_us"], rel=0.05)  # untouched


def _lmcache_body(running: float, retrieve: tuple[float, float, float] | None) -> str:
    rows = ["# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{engine="0"}} {running}']
    if retrieve is not None:
        lab = 'model_name="m",worker_id="0"'
        rows += ["# TYPE lmcache:time_to_retrieve histogram",
                 f'lmcache:time_to_retrieve_bucket{{le="+Inf",{lab}}} {retrieve[1]}',
                 f"lmcache:time_to_retrieve_sum{{{lab}}} {retrieve[0]}",
                 f"lmcache:time_to_retrieve_count{{{lab}}} {retrieve[1]}",
                 "# TYPE lmcache:num_hit_tokens_total counter", f"lmcache:num_hit_tokens_total{{{lab}}} {retrieve[2]}"]
    return "\n".join(rows) + "\n"


def test_lmcache_retrieve_deltas_are_retrieve_observations() -> None:
    from smetric_lmc.controller.engine_metrics import RetrieveDeltas, parse_engine_metrics

    d = RetrieveDeltas()
    assert d.update("a", parse_engine_metrics(_lmcache_body(1, (1.0, 10.0, 20000.0)))) is None  # baseline
    assert d.update("a", parse_engine_metrics(_lmcache_body(1, (1.6, 13.0, 26000.0)))) == pytest.approx((3.0, 0.2, 2000.0))
    assert d.update("a", parse_engine_metrics(_lmcache_body(1, (1.6, 13.0, 26000.0)))) is None  # none since
    assert d.update("a", parse_engine_metrics(_lmcache_body(1, (0.1, 1.0, 100.0)))) is None  # a restart: new baseline
    # an engine without LMCache, or with half of what is needed, teaches nothing
    assert parse_engine_metrics(_lmcache_body(1, None)).retrieve_sum_s is None
    half = _lmcache_body(1, None) + '# TYPE lmcache:time_to_retrieve histogram\nlmcache:time_to_retrieve_sum{worker_id="0"} 1.0\n'
    s = parse_engine_metrics(half)
    assert (s.retrieve_sum_s, s.retrieve_count, s.retrieved_tokens) == (None, None, None)
    # summed over LMCache's workers (tensor-parallel ranks)
    two = _lmcache_body(1, (1.0, 2.0, 300.0)) + _lmcache_body(1, (3.0, 4.0, 500.0)).replace('worker_id="0"', 'worker_id="1"').split("\n", 2)[2]
    s = parse_engine_metrics(two)
    assert (s.retrieve_sum_s, s.retrieve_count, s.retrieved_tokens) == (4.0, 6.0, 800.0)


async def test_the_poller_feeds_a_mock_engines_retrieves_to_the_price_feed() -> None:
    """Two mock instances sharing a global tier: a prompt computed on one and sent to the other is
    fetched there; the poller reads that engine's LMCache retrieve metrics and the feed learns."""
    import asyncio

    import aiohttp

    from smetric_lmc.controller.engine_metrics import EngineMetricsPoller
    from smetric_lmc.lab.mock_engine.cli import options, running_mocks
    from smetric_lmc.load import LoadTracker

    feed = PriceFeed(unpredicted="global")
    seen: list[tuple[str, float, float, float]] = []

    def on_retrieve(iid: str, count: float, mean_s: float, mean_tokens: float) -> None:
        seen.append((iid, count, mean_s, mean_tokens))
        feed.on_retrieve(iid, count, mean_s, mean_tokens)

    args = options(instances=2, global_gib=1.0, retrieve_gbps=1.0, speed=50.0, num_gpu_blocks=4096)
    async with running_mocks(args) as mocks, aiohttp.ClientSession() as http:
        urls = {f"m{k}": m.http_url for k, (m, _) in enumerate(mocks)}
        poller = EngineMetricsPoller(urls, LoadTracker(), on_retrieve=on_retrieve)
        try:
            await poller.poll_once()  # the baseline
            prompt = [7 + k % 50 for k in range(2048)]
            for url in (urls["m0"], urls["m1"]):
                async with http.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                                    "max_tokens": 1}) as r:
                    assert r.status == 200
                await asyncio.sleep(0.3)  # the put to the global tier lands before the next instance asks
            await poller.poll_once()
        finally:
            await poller.close()
    assert [s[0] for s in seen] == ["m1"], seen
    _, count, mean_s, mean_tokens = seen[0]
    assert count == 1 and mean_s > 0 and 1024 <= mean_tokens <= 2048
    assert feed.stats["retrieve_polls"] == 1
    assert feed.book.snapshot()["instances"]["m1"]["retrieve"]["observations"] == 1  # type: ignore[index]


def test_decision_prices_are_reused_until_the_instance_or_the_cluster_learns_something() -> None:
    """A decision prices every candidate; between two done reports most of them are unchanged, so the
    book keeps each instance's decision prices until its own fit or the cluster's learns. What it
    returns is always what a book computing afresh returns."""
    rng = np.random.default_rng(11)
    obs = synthetic(rng, 300, TRUE)
    book, fresh = PriceBook(), PriceBook()
    ids = ["a", "b", "c"]
    for k, o in enumerate(obs):
        for b in (book, fresh):
            b.observe(ids[k % 3], o)
        if k % 7 == 0:
            fresh._decided.clear()  # a book with nothing kept
            for i in ids:
                assert book.decision_prices(i) == fresh.decision_prices(i)
    first = book.decision_prices("a")
    assert book.decision_prices("a") is first  # kept: nothing learned since
    book.observe("b", obs[0])  # the cluster learns: every instance's decision price may move
    assert book.decision_prices("a") is not first
    kept = book.decision_prices("a")
    book.observe_tpot("a", 0.03, 4)  # a's own decode fit learns (from /metrics)
    assert book.decision_prices("a") is not kept
    book.forget_instance("a")
    assert book.decision_prices("a") == book.pooled.prices()


def test_an_instance_that_rarely_or_never_fetched_is_priced_at_the_cluster_fetch_price() -> None:
    """A fetch path 30x the prior's price. Seven instances fetch as usual; "few" fetched in 1 of its
    20 requests and "never" in none (their sessions all hit locally). Neither's own fit can say what
    a fetch costs there: "never"'s sits at the prior, "few"'s is pulled towards it, each with a
    standard error too small to show that. Decisions used those as "significantly" cheaper fetches
    and sent fetching first turns onto busy instances (issue 23's traces at 16 instances); they must
    price them at the cluster's price. An instance that really fetches slower keeps its own price."""
    rng = np.random.default_rng(7)
    true = {**TRUE, "fetch_global_us": 30 * DEFAULT_PRIORS["fetch_global_us"]}
    book = PriceBook()
    usual = [f"i{k}" for k in range(7)]
    reports = synthetic(rng, 4000, true, 0.0)
    fetching = [o for o in reports if o.global_hit > 0]
    local = [o for o in reports if o.global_hit == 0]
    for k, o in enumerate(reports[:2800]):
        book.observe(usual[k % 7], o)
        if k % 7 == 0:
            book.observe("never", local[k // 7])
            book.observe("few", fetching[k // 7] if (k // 7) % 20 == 0 else local[-1 - k // 7])
    pooled = book.pooled.prices().fetch_global_us
    assert pooled == pytest.approx(true["fetch_global_us"], rel=0.15)
    assert book.prices("never").fetch_global_us < 0.2 * pooled  # its own fit: the prior
    for iid in ("never", "few", "i0"):
        assert book.decision_prices(iid).fetch_global_us == pytest.approx(pooled, rel=0.1), iid
    # an instance 4x slower to fetch, with the reports to show it, keeps its own price
    slow = {**true, "fetch_global_us": 4 * true["fetch_global_us"]}
    for o in synthetic(rng, 400, slow, 0.0):
        book.observe("slow", o)
    assert book.decision_prices("slow").fetch_global_us > 2 * pooled
