"""The real-engine validation's model of a live run: scheduler limits read from a vLLM log, decode
steps timed through servers that coalesce tokens, and the request path the simulated closed loop
waits between turns."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import pytest

from smetric_lmc.lab.mock_engine.cli import options, running_mocks
from smetric_lmc.lab.replay.calibrate import VLLM_CPU_SERVER_DEFAULTS, Calibration, measure, scheduler_limits
from smetric_lmc.lab.replay.compare import simulate_like, simulate_per_instance, with_kv_tokens, write_profile
from smetric_lmc.lab.replay.ranking import rank_fields, rank_pairs, run_order, spread
from smetric_lmc.lab.replay.schedstat import (
    CpuTime,
    measured_slowdowns,
    parse_schedstat,
    sample_engines,
    sample_group,
)
from smetric_lmc.lab.replay.under_load import (
    Contention,
    LoadedFit,
    RequestPath,
    bracketed,
    decode_s_per_token,
    fit_contention,
    fit_under_load,
    inflight_on_instance,
    run_tps,
    slowed,
    with_turnaround,
)
from smetric_lmc.lab.replay.validate import measure_path, small_workload, summarize_repeats
from smetric_lmc.lab.sim.profile import load_profile

# Two lines as vLLM 0.32's API server logs them at startup (shortened; the dict is its repr).
VLLM_LOG = (
    "(APIServer pid=13047) INFO 11-30 15:49:17 [api_utils.py:286] non-default args: {'host': '127.0.0.1', "
    "'port': 34727, 'model': '/models/tiny-qwen2', 'dtype': 'float32', 'max_model_len': 2048, "
    "'max_num_seqs': 48, 'block_size': 32, 'enable_prefix_caching': True}\n"
    "(EngineCore pid=13272) INFO 11-30 15:49:25 [core.py:101] Initializing a V1 LLM engine (v0.32.0) with "
    "config: model='/models/tiny-qwen2', seed=0, served_model_name=tiny, enable_prefix_caching=True, "
    "enable_chunked_prefill=False, pooler_config=None\n"
)


def test_scheduler_limits_come_from_the_engine_log_else_vllm_cpu_defaults() -> None:
    got = scheduler_limits(VLLM_LOG)
    assert got["max_num_seqs"] == 48  # set on the command line
    assert got["max_num_batched_tokens"] == VLLM_CPU_SERVER_DEFAULTS["max_num_batched_tokens"]  # not set
    assert got["enable_chunked_prefill"] is False
    assert got["source"].startswith("engine log")
    none = scheduler_limits(None)
    assert {k: none[k] for k in VLLM_CPU_SERVER_DEFAULTS} == VLLM_CPU_SERVER_DEFAULTS
    assert none["source"] == "vLLM CPU defaults"


def test_decode_steps_are_timed_through_coalesced_stream_chunks(tmp_path: Path) -> None:
    """The mock streams 4 tokens per chunk (``--stream-interval``), as vLLM's API server does when it
    falls behind: gaps between chunks are mostly zero inside a burst, yet the measured step is the
    engine's step (model time = wall time x speed)."""
    prof = with_kv_tokens(load_profile(), 64_000).with_overrides(iter_overhead_s=0.02)
    path = write_profile(prof, tmp_path / "p.yaml")
    speed = 2.0

    async def run() -> tuple[dict, list]:
        async with running_mocks(options(profile=str(path), speed=speed, max_model_len=4096,
                                         stream_interval=4)) as mocks:
            return await measure(mocks[0][0].http_url, repeats=1, decode_batches=(1, 4), decode_tokens=24)

    _, samples = asyncio.run(run())
    dec = [s for s in samples if s.kind == "decode"]
    assert len(dec) == 4
    for s in dec:
        model_step = prof.iteration_time([], s.new_tokens, s.context)
        # Loop jitter only makes a step look longer; a gap between 4-token chunks is 4 steps.
        assert 0.7 < s.seconds * speed / model_step < 2, (s, model_step)


def test_the_simulated_closed_loop_waits_the_request_path_between_turns(tmp_path: Path) -> None:
    """A session's simulated span grows by the measured path once per follow-up, its first turn not."""
    wl = small_workload(1, 6, 0.03, 0.03)
    wl.sessions[0].requests[2].think_time = 5.0  # clipped by the replay's max_think_s, as the replay does
    turned = with_turnaround(wl, 0.25, max_think_s=1.0)
    thinks = [r.think_time for r in turned.sessions[0].requests]
    assert thinks[0] == 0.0 and thinks[2] == pytest.approx(1.25)
    assert all(t == pytest.approx(min(r.think_time, 1.0) + 0.25)
               for t, r in zip(thinks[1:], wl.sessions[0].requests[1:], strict=True) if r is not wl.sessions[0].requests[2])
    prof = load_profile()
    base = simulate_like(wl, prof, "smetric", 1, 1.0, 0, 1.0)
    slow = simulate_like(turned, prof, "smetric", 1, 1.0, 0, 1e9)
    served = ~base.cols["rejected"].astype(bool)
    follow_ups = int(served.sum()) - 1
    span = lambda r: float(np.nanmax(r.cols["finish"]) - np.nanmin(r.cols["arrival"]))  # noqa: E731
    assert span(slow) - span(base) == pytest.approx(0.25 * follow_ups, rel=0.05)


def test_request_path_is_measured_from_tiny_requests(tmp_path: Path) -> None:
    """Against any OpenAI endpoint (here one mock engine, its model 1000x faster than real time):
    both parts are non-negative and small."""
    cal = Calibration(load_profile(), [], 0.0)

    async def serve() -> None:
        async with running_mocks(options(speed=1000.0)) as mocks:
            url = mocks[0][0].http_url
            path = await asyncio.to_thread(measure_path, url, cal, 5)
            assert 0.0 <= path.pre < 1.0 and 0.0 <= path.post < 1.0
            assert path.turnaround == pytest.approx(path.pre + path.post)

    asyncio.run(serve())


def test_fit_under_load_recovers_a_known_slowdown_and_path() -> None:
    """A stand-in for a calibration replay: the simulator itself with every iteration 2.5x slower and a
    40 ms request path before the first token (as a client measures TTFT: from the send). Fitted from
    the idle profile (a tiny model on a CPU, as calibrated here) and a 5 ms idle path, both come back."""
    wl = small_workload(16, 8, 0.03, 0.03, seed=1)
    idle = with_kv_tokens(load_profile().with_overrides(
        total_params=1.38e6, active_params=1.38e6, bytes_per_param=4.0, layers=2, q_heads=2, kv_heads=2, head_dim=64,
        kv_bytes_per_elem=4.0, max_model_len=2048, peak_flops=2.1e11, hbm_bw=3.7e9, compute_eff=1.0, mem_eff=1.0,
        tp=1, tp_eff=1.0, iter_overhead_s=0.0034, max_num_seqs=128, max_num_batched_tokens=2048), 524288)
    pre, post = 0.040, 0.002
    truth = simulate_like(with_turnaround(wl, pre + post, 0.0), slowed(idle, 2.5), "load_balance", 2, 4.0, 1, 1e9)
    live = dataclasses.replace(truth, summary={**truth.summary, "ttft_p50": truth.summary["ttft_p50"] + pre})
    fit = fit_under_load(wl, live, idle, RequestPath(0.005, post), "load_balance", 2, 4.0, 1, 0.0)
    assert fit.slowdown == pytest.approx(2.5, rel=0.03)
    assert fit.pre == pytest.approx(pre, abs=0.003)
    assert decode_s_per_token(fit.sim) == pytest.approx(decode_s_per_token(truth), rel=0.03)


def _idle_cpu_profile():
    return with_kv_tokens(load_profile().with_overrides(
        total_params=1.38e6, active_params=1.38e6, bytes_per_param=4.0, layers=2, q_heads=2, kv_heads=2, head_dim=64,
        kv_bytes_per_elem=4.0, max_model_len=2048, peak_flops=2.1e11, hbm_bw=3.7e9, compute_eff=1.0, mem_eff=1.0,
        tp=1, tp_eff=1.0, iter_overhead_s=0.0034, max_num_seqs=128, max_num_batched_tokens=2048), 524288)


def test_contention_fit_recovers_a_path_that_grows_with_requests_in_flight() -> None:
    """A stand-in live run: the simulator's own requests, each first token later by 10 ms + 12 ms per
    other request in flight on its engine (an API server sharing the engine's core). The fit on the
    per-request differences gets both back; a path that does not depend on load gives slope 0."""
    wl = small_workload(16, 8, 0.03, 0.03, seed=1)
    sim = simulate_like(with_turnaround(wl, 0.02, 0.0), slowed(_idle_cpu_profile(), 6.0), "load_balance", 2, 8.0, 1,
                        1e9)
    k = inflight_on_instance(sim)
    assert k.max() >= 2  # the workload does overlap on an engine
    cols = dict(sim.cols)
    cols["first_token"] = sim.cols["first_token"] + 0.010 + 0.012 * k
    live = dataclasses.replace(sim, cols=cols)
    got = fit_contention(live, sim, pre=0.02)
    assert got.base == pytest.approx(0.010, abs=1e-6) and got.per_inflight == pytest.approx(0.012, abs=1e-6)
    assert np.allclose(got.ttft(sim), cols["first_token"] - cols["arrival"], equal_nan=True)
    flat = dataclasses.replace(sim, cols={**sim.cols, "first_token": sim.cols["first_token"] + 0.03})
    assert fit_contention(flat, sim, pre=0.03) == Contention(pytest.approx(0.03), 0.0)


def test_run_order_is_balanced_so_a_linear_drift_weighs_on_every_policy_alike() -> None:
    order = run_order(("smetric", "load_balance", "round_robin"), 2)
    assert [p for p, _ in order] == ["smetric", "load_balance", "round_robin", "round_robin", "load_balance",
                                     "smetric"]
    assert [r for _, r in order] == [0, 0, 0, 1, 1, 1]
    # Throughput falling linearly over the run (the engines slowing down): equal means per policy.
    drift = {p: [] for p, _ in order}
    for slot, (p, _) in enumerate(order):
        drift[p].append(1000.0 - 50.0 * slot)
    assert len({np.mean(v) for v in drift.values()}) == 1
    assert run_order(("a", "b"), 1) == [("a", 0), ("b", 0)]
    with pytest.raises(ValueError):
        run_order(("a", "a"), 2)
    with pytest.raises(ValueError):
        run_order(("a", "b"), 0)


def _rows(noise: float, **tputs: tuple[float, float]) -> list[dict]:
    return [{"policy": k, "tput_live": live, "tput_sim": sim, "noise": noise} for k, (live, sim) in tputs.items()]


def test_ranking_counts_pairs_inside_the_live_noise_as_ties_and_judges_the_rest() -> None:
    """Repeats of a policy spread 10% (its noise); smetric and load_balance 5% apart live are a tie
    whichever order a mild simulator gives them; a pair 20% apart must keep its order."""
    assert spread([900.0, 1000.0, 1000.0]) == pytest.approx(0.1)  # over the median: one stall does not set it
    rows = _rows(0.1, smetric=(1050.0, 1000.0), load_balance=(1000.0, 1040.0), round_robin=(850.0, 880.0))
    verdicts = {(p.a, p.b): p.verdict for p in rank_pairs(rows)}
    assert verdicts == {("smetric", "load_balance"): "tie", ("smetric", "round_robin"): "agree",
                        ("load_balance", "round_robin"): "agree"}
    got = rank_fields(rows)
    assert got["rank_agree"] is True and got["rank_ties"] == ["smetric~load_balance"]
    assert got["rank_pairs_separated"] == 2 and got["rank_disagreements"] == []
    assert got["rank_noise_rel"] == {"smetric": 0.1, "load_balance": 0.1, "round_robin": 0.1}
    # The simulator swapping a separated pair is a disagreement, noise or not.
    swapped = _rows(0.1, smetric=(1050.0, 1000.0), load_balance=(1000.0, 1040.0), round_robin=(850.0, 1100.0))
    assert rank_fields(swapped)["rank_agree"] is False


def test_a_pair_is_judged_against_the_noisier_of_its_two_policies() -> None:
    """round_robin's repeats spread 60% (one replay stalled): its pairs are ties; smetric and
    load_balance, repeatable within 5%, are 12% apart and judged."""
    rows = _rows(0.05, smetric=(1120.0, 1100.0), load_balance=(1000.0, 1000.0))
    rows.append({"policy": "round_robin", "tput_live": 700.0, "tput_sim": 900.0, "noise": 0.6})
    verdicts = {(p.a, p.b): p.verdict for p in rank_pairs(rows)}
    assert verdicts == {("smetric", "load_balance"): "agree", ("smetric", "round_robin"): "tie",
                        ("load_balance", "round_robin"): "tie"}
    assert rank_fields(rows)["rank_agree"] is True and rank_fields(rows)["rank_pairs_separated"] == 1


def test_a_tie_the_simulator_orders_strongly_the_other_way_fails_the_ranking() -> None:
    """Live 5% apart (a tie at 10% noise) while the simulator puts the pair 30% apart the other way:
    the simulator claims a separation the engines do not show. 8% the other way is within the noise."""
    strong = _rows(0.1, smetric=(1050.0, 800.0), load_balance=(1000.0, 1080.0), round_robin=(700.0, 600.0))
    got = rank_fields(strong)
    assert got["rank_agree"] is False
    assert got["rank_disagreements"] == ["smetric~load_balance:tie-contradicted"]
    assert got["rank_ties"] == ["smetric~load_balance"]
    mild = _rows(0.1, smetric=(1050.0, 1000.0), load_balance=(1000.0, 1083.0), round_robin=(700.0, 600.0))
    assert rank_fields(mild)["rank_agree"] is True


def test_ranking_without_measured_noise_is_plain_ordering_and_all_ties_agree_on_nothing() -> None:
    rows = _rows(0.0, smetric=(1050.0, 1000.0), load_balance=(1000.0, 1040.0))
    assert spread([1000.0]) == 0.0  # one replay measures no noise
    assert rank_fields(rows) == {"rank_agree": False, "rank_noise_rel": {"smetric": 0.0, "load_balance": 0.0},
                                 "rank_pairs_separated": 1, "rank_ties": [],
                                 "rank_disagreements": ["smetric~load_balance:disagree"]}
    # Every pair within the noise: nothing was separated, so there is no ranking to agree with.
    wide = _rows(0.2, smetric=(1050.0, 1000.0), load_balance=(1000.0, 1040.0))
    assert rank_fields(wide)["rank_agree"] is False and rank_fields(wide)["rank_pairs_separated"] == 0


def test_repeats_are_summarized_per_policy_by_their_median_and_their_spread_is_the_noise() -> None:
    def slot(pol: str, rep: int, live: float, sim: float, ttft_live: float, ttft_sim: float) -> dict:
        return {"policy": pol, "repeat": rep, "tput_live": live, "tput_sim": sim, "ttft_p50_live": ttft_live,
                "ttft_p50_sim": ttft_sim, "ttft_p50_sim_const": ttft_sim * 1.5, "hit_live": 0.8, "hit_sim": 0.82,
                "sticky_live": 1.0, "sticky_sim": 1.0, "tput_sim_bracketed": sim * 1.2,
                "ttft_p50_sim_bracketed": ttft_sim, "hit_sim_bracketed": 0.9}

    slots = [slot("a", 0, 1000, 1100, 0.05, 0.05), slot("b", 0, 800, 800, 0.05, 0.06),
             slot("b", 1, 700, 720, 0.05, 0.04), slot("a", 1, 900, 800, 0.05, 0.05)]
    rows, f = summarize_repeats(slots, ["a", "b"])
    assert [r["policy"] for r in rows] == ["a", "b"] and rows[0]["tput_live"] == 950 and rows[0]["tput_sim"] == 950
    assert rows[0]["noise"] == pytest.approx(100 / 950) and rows[1]["noise"] == pytest.approx(100 / 750)
    assert f["repeats"] == 2 and f["tput_live_by_repeat"] == {"a": [1000, 900], "b": [800, 700]}
    assert f["tput_rel_err_max"] == pytest.approx(abs(760 / 750 - 1), abs=1e-4)
    assert f["tput_rel_err_max_repeat"] == pytest.approx(0.1111, abs=1e-4)  # a #1: 800 against 900
    assert f["ttft_p50_rel_err_max"] == 0.0 and f["ttft_p50_rel_err_max_repeat"] == pytest.approx(0.2)
    assert f["ttft_p50_rel_err_max_const_path"] == pytest.approx(0.5)
    assert f["tput_rel_err_max_bracketed"] == pytest.approx(abs(760 * 1.2 / 750 - 1), abs=1e-4)
    assert f["hit_abs_err_max_bracketed"] == pytest.approx(0.1)
    assert f["rank_pairs_separated"] == 1 and f["rank_agree"] is True  # a 950 vs b 750: 23.5% apart
    # Three repeats: the median ignores one stalled replay.
    rows3, _ = summarize_repeats([*slots, slot("a", 2, 300, 1000, 0.2, 0.05)], ["a", "b"])
    assert rows3[0]["tput_live"] == 900 and rows3[0]["ttft_p50_live"] == 0.05
    with pytest.raises(ValueError, match="no replay of policy c"):
        summarize_repeats(slots, ["a", "b", "c"])


def test_a_replay_is_simulated_with_the_mean_of_the_calibrations_around_it() -> None:
    idle = _idle_cpu_profile()
    live = simulate_like(small_workload(4, 2, 0.03, 0.03), idle, "load_balance", 2, 4.0, 1, 1e9)

    def fit(factor: float, pre: float, base: float, per: float) -> LoadedFit:
        return LoadedFit(slowed(idle, factor), factor, pre, live, live, Contention(base, per))

    prof, factor, pre, ct = bracketed(fit(1.0, 0.02, 0.01, 0.004), fit(4.0, 0.04, 0.03, 0.008), idle)
    assert factor == pytest.approx(2.0) and pre == pytest.approx(0.03)
    assert ct == Contention(pytest.approx(0.02), pytest.approx(0.006))
    assert prof.iteration_time([(256, 0)], 2, 512) == pytest.approx(2 * idle.iteration_time([(256, 0)], 2, 512))


def test_caches_are_reset_only_once_the_engine_has_no_request_holding_blocks() -> None:
    """vLLM refuses ``/reset_prefix_cache`` while a request holds blocks (so does the mock engine):
    the reset between replays retries until it is accepted, then the engine holds nothing; an
    engine that stays busy past the timeout is an error, not a silently skipped reset."""
    import aiohttp

    from smetric_lmc.lab.replay.validate import _reset_caches

    async def serve() -> None:
        async with running_mocks(options(speed=2.0)) as mocks:
            inst, core = mocks[0]
            body = {"model": inst.model, "prompt": list(range(100, 420)), "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{inst.http_url}/v1/completions", json=body) as r:
                    await r.content.readline()  # streaming: the request holds its blocks now
                    assert core.running
                    with pytest.raises(RuntimeError, match="refused to reset"):
                        await asyncio.to_thread(_reset_caches, [inst], 0.3)
                    reset = asyncio.create_task(asyncio.to_thread(_reset_caches, [inst], 60.0))
                    await r.read()
                    ended = time.monotonic()
                await reset
                assert time.monotonic() >= ended and not core.running
                assert not core.cached_block_hashes()

    asyncio.run(serve())


def test_schedstat_lines_parse_and_bad_ones_are_refused() -> None:
    assert parse_schedstat("114426 591797 4\n") == (114426, 591797)
    for bad in ("", "1 2", "1 2 x", "-1 2 3"):
        with pytest.raises(ValueError, match="not a schedstat line"):
            parse_schedstat(bad)


def _fake_proc(root: Path, procs: dict[int, tuple[int, dict[int, tuple[str, str]]]]) -> Path:
    """A /proc tree: pid -> (process group, {tid: (thread name, schedstat line)})."""
    for pid, (pgid, tasks) in procs.items():
        (root / str(pid)).mkdir(parents=True)
        # comm with a space and a parenthesis, as a thread name can have
        (root / str(pid) / "stat").write_text(f"{pid} (VLLM::Engine (1)) S 1 {pgid} {pgid} 0 -1\n")
        for tid, (comm, line) in tasks.items():
            (root / str(pid) / "task" / str(tid)).mkdir(parents=True)
            (root / str(pid) / "task" / str(tid) / "comm").write_text(comm + "\n")
            (root / str(pid) / "task" / str(tid) / "schedstat").write_text(line)
    return root


def test_an_engine_run_share_sums_its_worker_threads_or_every_thread_of_its_process_group(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {10: (10, {10: ("python", "100 50 1"), 11: ("ZMQbg/IO/0", "300 50 9")}),
                                 12: (10, {12: ("VLLM::Worker", "600 0 2"), 13: ("gloo_tcp_loop", "5 70 1")}),
                                 20: (20, {20: ("VLLM::Worker", "999 999 1")}),
                                 21: (10, {21: ("VLLM::Worker", "garbage")})})
    t = sample_group(10, 5.0, proc, comm=None)
    assert (t.run_ns, t.wait_ns) == (1005, 170)
    w = sample_engines({"e0": 10, "other": 20}, proc)
    assert (w["e0"].run_ns, w["e0"].wait_ns) == (600, 0) and (w["other"].run_ns, w["other"].wait_ns) == (999, 999)
    later = CpuTime(1005 + 900, 170 + 900, 7.0)
    d = later - t
    assert d.run_share == pytest.approx(0.5) and d.wait_per_s == pytest.approx(900e-9 / 2.0)
    with pytest.raises(ValueError, match="no runnable time"):
        (t - t).run_share  # noqa: B018


def test_run_share_of_a_real_busy_thread_comes_from_the_kernel() -> None:
    start = sample_engines({"me": os.getpgid(0)}, comm=None)
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:
        pass
    d = sample_engines({"me": os.getpgid(0)}, comm=None)["me"] - start["me"]
    assert d.run_ns >= 0.04e9 and 0 < d.run_share <= 1


def test_each_engine_is_slowed_by_its_own_loss_of_run_share_against_the_calibration() -> None:
    got = measured_slowdowns(2.0, {"a": 0.9, "b": 0.9}, {"a": 0.9, "b": 0.45})
    assert got == {"a": pytest.approx(2.0), "b": pytest.approx(4.0)}
    assert measured_slowdowns(2.0, {"a": 0.6}, {"a": 0.9})["a"] == pytest.approx(2.0 * 0.6 / 0.9)
    with pytest.raises(ValueError, match="different engines"):
        measured_slowdowns(2.0, {"a": 0.9}, {"b": 0.9})
    with pytest.raises(ValueError, match="out of"):
        measured_slowdowns(2.0, {"a": 0.9}, {"a": 0.0})


def test_per_instance_profiles_slow_only_their_instance() -> None:
    idle = _idle_cpu_profile()
    wl = small_workload(6, 3, 0.03, 0.03)
    same = simulate_like(wl, slowed(idle, 3.0), "round_robin", 2, 4.0, 0, 1e9)
    per = simulate_per_instance(wl, [slowed(idle, 3.0), slowed(idle, 3.0)], "round_robin", 4.0, 0, 1e9)
    assert run_tps(per) == pytest.approx(run_tps(same))
    one_slow = simulate_per_instance(wl, [slowed(idle, 3.0), slowed(idle, 12.0)], "round_robin", 4.0, 0, 1e9)
    c = one_slow.cols
    dec = (c["finish"] - c["first_token"]) / np.maximum(c["output"] - 1, 1)
    ins = c["instance"]
    assert np.nanmedian(dec[ins == 1]) > 2 * np.nanmedian(dec[ins == 0])  # -1: rejected
    with pytest.raises(ValueError, match="same KV capacity"):
        simulate_per_instance(wl, [idle, with_kv_tokens(idle, 1 << 20)], "round_robin", 4.0, 0, 1e9)
