"""vLLM's router (vllm-router 0.1.17) and SGLang's router (sglang-router 0.3.2) keep their contract
with the mock engine: ``bench/live_peers.py --ci`` runs every router configuration (ours through the
controller + gateway, every peer policy) in front of 8 mock instances at 2 loads of the Trace-1
preset; every request must be served, and each peer must report (in its own counters or log) that it
ran the policy it was given. The engines are mock vLLM engines (the simulator's model in real time):
GPUs and the RDMA store cannot run here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
KEYS = {"instances", "workloads", "ours_best", "best_peer", "ours_vs_best_peer_tps_slo",
        "smetric_vs_best_peer_tps_slo", "router_cpu_ms_per_1k", "router_added_latency_p99_ms",
        "router_added_latency_p50_ms", "latency_probe_noise_p99_ms", "peers_tuned"}

pytestmark = pytest.mark.live_peers


def test_every_router_routes_the_mock_cluster(tmp_path: Path) -> None:
    bindir = Path(sys.executable).parent
    for exe in ("vllm-router", "sglang-router"):
        if not (shutil.which(exe, path=str(bindir)) or shutil.which(exe)):
            pytest.skip(f"{exe} not installed (pip install -e '.[live-peers]')")
    rows_path = tmp_path / "rows.jsonl"
    out = subprocess.run([sys.executable, str(REPO / "bench" / "live_peers.py"), "--ci", "--rows", str(rows_path)],
                         capture_output=True, text=True, timeout=900, cwd=REPO, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(last) == KEYS
    assert last["instances"] == 8 and last["workloads"] == ["trace1"]
    rows = [json.loads(x) for x in rows_path.read_text().splitlines()]
    names = {r["router"] for r in rows}
    assert names == {"ours:smetric", "ours:smetric_ect", "ours:load_balance", "ours:smetric[process=one]", "vllm:kv_aware",
                     "vllm:sticky_least_loaded", "vllm:cache_aware", "vllm:power_of_two", "vllm:round_robin",
                     "sglang:cache_aware", "sglang:power_of_two"}
    for r in rows:
        assert r["requests"] > 0 and r["failed"] == 0, r
        assert sum(r["per_instance_requests"]) > 0, r
        if r["family"] == "vllm":
            # vllm-router counts each decision under the policy that made it
            assert any(f'policy="{r["policy"]}"' in k for k in r["counters"]), r["counters"]
        elif r["family"] == "sglang":
            assert any(f"policy {r['policy']}" in ln for ln in r["policy_log"]), r["policy_log"]
            assert any("smg_router_requests_total" in k for k in r["counters"]), r["counters"]
        else:
            assert any(f'policy="{r["policy"]}"' in k for k in r["counters"]), r["counters"]
    # vLLM's kv_aware reads the engines' KV events: it found cached prefixes in its index (it did
    # not while the mock published on a topic it does not subscribe to).
    kv_hits = max(r["counters"].get('vllm_router_kv_placement_lookups_total{result="hit"}', 0.0)
                  for r in rows if r["router"] == "vllm:kv_aware")
    assert kv_hits > 0, [r["counters"] for r in rows if r["router"] == "vllm:kv_aware"]
    # Our controller follows the mock's global tier through the cluster's Redis (LMCache's key
    # layout): its decisions found prefixes there.
    for r in rows:
        if r["family"] == "ours":
            assert r["counters"].get('smetric_route_hit_tokens_total{tier="global"}', 0.0) > 0, r["counters"]
    # The CI mode runs two configurations at once, each on its own cluster: some runs overlapped in time.
    spans = sorted((r["started"], r["started"] + r["wall_s"]) for r in rows)
    assert all(r["parallel"] == 2 for r in rows)
    assert any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:])), spans
    # Round robin spreads requests evenly: the per-instance counts come from the engines themselves.
    by = {(r["router"], r["rate"]): r for r in rows}
    rr = by[("vllm:round_robin", 0.5)]["per_instance_requests"]
    assert max(rr) - min(rr) <= 1


def test_the_endpoints_peers_discover_and_tokenize_with() -> None:
    """What the peers call besides generation, answered as vLLM 0.32 / SGLang workers answer it."""
    import asyncio

    import aiohttp

    from smetric_lmc.lab.mock_engine.cli import options, running_mocks
    from smetric_lmc.lab.mock_engine.server import encode_text, render_chat

    async def main() -> None:
        async with running_mocks(options(instances=1, block_size=16)) as mocks, aiohttp.ClientSession() as s:
            url = mocks[0][0].http_url
            msgs = [{"role": "user", "content": "hi there"}]
            async with s.post(f"{url}/v1/chat/completions/render", json={"model": "tiny", "messages": msgs}) as r:
                assert r.status == 200
                assert (await r.json())["token_ids"] == encode_text(render_chat(msgs))
            async with s.post(f"{url}/v1/completions/render", json={"model": "tiny", "prompt": "abc"}) as r:
                assert [x["token_ids"] for x in await r.json()] == [[97, 98, 99]]
            async with s.post(f"{url}/v1/completions/render", json={"prompt": 5}) as r:
                assert r.status == 400
            for bad in (b"{not json", b"[1, 2]"):  # not JSON; JSON but not an object
                for path in ("/v1/completions/render", "/tokenize", "/v1/completions"):
                    async with s.post(url + path, data=bad, headers={"Content-Type": "application/json"}) as r:
                        assert r.status == 400, (path, bad)
                        assert (await r.json())["object"] == "error"
            for path in ("/server_info", "/get_server_info"):
                async with s.get(url + path) as r:
                    info = await r.json()
                    assert info["kv_block_size"] == 16 and info["model_id"] == "tiny"
            for path in ("/model_info", "/get_model_info"):
                async with s.get(url + path) as r:
                    assert (await r.json())["model_path"] == "tiny"

    asyncio.run(main())


def test_text_prompts_need_ascii_token_ids() -> None:
    """The replay's text prompts (for SGLang's router) are the token ids as characters: only ids
    below 128 survive the mock's byte tokenizer unchanged."""
    from smetric_lmc.lab.replay.prompts import TokenSpace
    from smetric_lmc.lab.replay.runner import ReplayConfig

    ReplayConfig(url="http://x", tokens=TokenSpace(128, 16), text_prompts=True)
    with pytest.raises(ValueError, match="below 128"):
        ReplayConfig(url="http://x", text_prompts=True)


def test_added_latency_is_taken_per_pair() -> None:
    """The router's added time is the percentiles of each pair's difference (through it minus
    straight), not the difference of two percentiles (which went negative on a noisy machine); the
    probe's noise floor the same percentiles of two straight requests' difference."""
    live_peers = _live_peers()
    # The straight request is slow in the pairs where the routed one is slow too (machine noise);
    # the second straight request gives the probe's own noise floor.
    triples = [(1.0, 1.5, 1.1)] * 97 + [(1.0, 1.5, 3.0), (40.0, 40.5, 40.2), (1.0, 9.0, 1.0)]
    out = live_peers.latency_summary(triples)
    assert out["pairs"] == 100
    assert out["p50_ms"] == 0.5
    assert out["p99_ms"] == 8.0  # the one pair where the router itself was slow
    assert out["direct_p50_ms"] == 1.0 and out["via_p50_ms"] == 1.5
    assert out["noise_p50_ms"] == pytest.approx(0.1)
    assert out["noise_p99_ms"] == pytest.approx(2.0)  # the one triple where a straight request was slow


def test_weka_runs_its_own_loads_context_scale_and_session_count() -> None:
    """WEKA's sessions (~60 turns, ~123 k-token contexts) get their own loads, window and scale; a
    mode that sets none runs WEKA at Trace-1's settings with its fixed session count."""
    live_peers = _live_peers()
    quick = live_peers.MODES["quick"]
    assert quick.weka_loads and quick.loads_of("weka") == quick.weka_loads != quick.loads_of("trace1")
    assert quick.sessions_at(4.0, "weka") == max(quick.weka_sessions, round(4.0 * quick.weka_window_s))
    assert quick.sessions_at(4.0, "trace1") == max(quick.sessions, round(4.0 * quick.arrival_window_s))
    assert quick.context_scale_of("weka") < quick.context_scale_of("trace1")
    bare = live_peers.Mode(4, ("trace1", "weka"), (1.0, 2.0), 3, 0.05, False, 0, weka_sessions=2)
    assert bare.loads_of("weka") == (1.0, 2.0) and bare.sessions_at(9.0, "weka") == 2
    assert bare.context_scale_of("weka") == 0.05 and bare.max_output_of("weka") is None
    assert bare.parallel_of("weka") == bare.parallel_of("trace1") == 1
    bare.weka_parallel = 4
    assert bare.parallel_of("weka") == 4 and bare.parallel_of("trace1") == 1


def test_repeated_loads_are_averaged_and_earlier_rows_can_be_reported(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A load run several times counts with the mean of its runs (one lucky run does not make the
    peak); --from-rows reports saved rows without running anything."""
    live_peers = _live_peers()

    def row(router: str, rate: float, tps: float) -> dict:
        return _summary_row(router, tps, rate=rate)

    rows = [row("ours:smetric", 6.0, 100.0), row("ours:smetric", 6.0, 140.0), row("ours:smetric", 12.0, 110.0),
            row("vllm:kv_aware", 6.0, 125.0), row("vllm:kv_aware", 12.0, 90.0)]
    assert live_peers.best_per_router(rows, "trace1") == {"ours:smetric": 120.0, "vllm:kv_aware": 125.0}
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    means = {(m["router"], m["rate"]): m for m in live_peers.load_means(rows)}
    assert (means[("ours:smetric", 6.0)]["tps_slo"], means[("ours:smetric", 6.0)]["runs"]) == (120.0, 2)
    assert means[("vllm:kv_aware", 12.0)]["runs"] == 1 and len(means) == 4
    for r in rows:
        r["instances"] = 8  # rows now say which cluster they ran on
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sigterm = signal.getsignal(signal.SIGTERM)  # main() installs its own; pytest's comes back after
    try:
        assert live_peers.main(["--quick", "--from-rows", str(path), "--plot", str(tmp_path / "p.png")]) == 0
        text = capsys.readouterr().out
        out = json.loads(text.strip().splitlines()[-1])
        assert out["ours_vs_best_peer_tps_slo"] == {"trace1": 0.96} and out["best_peer"] == "vllm:kv_aware"
        assert out["instances"] == 8 and "each load's mean over its runs" in text
        assert (tmp_path / "p.png").stat().st_size > 0
        (tmp_path / "bad.jsonl").write_text("not json\n")
        assert live_peers.main(["--quick", "--from-rows", str(tmp_path / "bad.jsonl")]) == 2
    finally:
        signal.signal(signal.SIGTERM, sigterm)


def test_a_parallel_or_repeat_count_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--parallel 0 is an error, not the mode's default (a falsy count once ran the whole sweep);
    so is --repeats 0, which would run nothing and report an empty table."""
    live_peers = _live_peers()
    assert live_peers.main(["--quick", "--parallel", "0"]) == 2
    assert "--parallel takes a count >= 1" in capsys.readouterr().err
    assert live_peers.main(["--quick", "--repeats", "0"]) == 2
    assert "--repeats takes a count >= 1" in capsys.readouterr().err


def test_routers_name_tuned_configurations_and_unknown_names_are_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A tuned configuration's parameters are comma-separated inside its brackets: --routers keeps
    them whole (they were split at every comma and silently matched nothing); a name that matches
    no configuration of the run is an error, not a smaller run."""
    live_peers = _live_peers()
    tuned = "vllm:cache_aware[cache-threshold=0.6,balance-abs-threshold=16]"
    assert live_peers.router_names(f"ours:smetric[process=one], {tuned},vllm:kv_aware") == [
        "ours:smetric[process=one]", tuned, "vllm:kv_aware"]
    assert tuned in {c.name for c in live_peers.tuning_confs()}
    assert live_peers.main(["--quick", "--routers", f"ours:smetric,{tuned}"]) == 2
    assert "tuned ones need --tune" in capsys.readouterr().err
    assert live_peers.main(["--quick", "--routers", "ours:smetric,vllm:no_such_policy"]) == 2
    assert "no configuration named vllm:no_such_policy" in capsys.readouterr().err


def test_a_stopped_sweep_starts_nothing_and_stops_what_was_starting(tmp_path: Path) -> None:
    """A SIGTERM during a parallel sweep's start phase once left runs going: a run that was still
    starting its cluster registered it after the stop had looked, and ran its whole sweep. A part
    registered after the stop is stopped at once, and no run starts after it."""
    live_peers = _live_peers()

    class Part:
        stopped = False

        def stop(self) -> None:
            self.stopped = True

    live_peers._STOPPED.clear()
    try:
        early = Part()
        live_peers._register(early)
        assert not early.stopped
        live_peers.stop_live()
        assert early.stopped
        late = Part()  # a run's cluster that came up after the stop
        with pytest.raises(live_peers.SweepStopped):
            live_peers._register(late)
        assert late.stopped
        conf = live_peers.default_confs()[0]
        with pytest.raises(live_peers.SweepStopped):
            live_peers.run_group(conf, "trace1", None, (1.0,), live_peers.MODES["ci"], tmp_path)  # type: ignore[arg-type]
        assert not list(tmp_path.iterdir())  # nothing was started
    finally:
        live_peers._STOPPED.clear()
        live_peers._LIVE.clear()


def test_the_decode_drivers_and_one_cluster_size_per_mean() -> None:
    """The report's "what slows the decodes" line correlates the engines' own time accounting over
    the runs (none below five runs with the fields), and rows of different cluster sizes are never
    averaged into one load's mean."""
    live_peers = _live_peers()

    def row(i: int, instances: int = 8) -> dict:
        return {"router": "ours:smetric", "workload": "trace1", "rate": 6.0, "instances": instances,
                "tps_slo": 100.0 + i, "engine_itl_ms": 30.0 + 2 * i, "mixed_share": 0.5 + 0.02 * i,
                "stall_share": 0.05 + 0.01 * (i % 2), "lost_tpot": 0.1 + 0.01 * i, "miss_share": 0.3 + 0.01 * i,
                "global_share": 0.0, "per_instance_gpu_busy": [0.5, 0.6, 0.7 + 0.01 * i],
                "per_instance_slow_tpot": [0.3, 0.2, 0.1] if i == 0 else [0.1, 0.2, 0.3],
                "per_instance_mixed_share": [0.6, 0.5, 0.4],
                "slow_tpot_share": 0.2, "engine_slow_tpot_share": 0.2, "slow_tpot_by_waits": 0.1 * (i % 2)}

    assert live_peers.decode_drivers([row(i) for i in range(4)]) == ""
    line = live_peers.decode_drivers([row(i) for i in range(6)])
    assert "over 6 runs" in line and "prompt chunks +1.00" in line and "computed +1.00" in line
    assert "global tier n/a" in line  # a constant column has no correlation
    # the losses on the busiest instances in five runs of six: the median says so
    assert "20.0% as the client timed them, 20.0% as the engines did, of which 5.0% (mean over 6 runs)" in line
    assert ("tokens past the TPOT SLO with GPU busy: median r +1.00 over 6 runs, with the GPU time in steps "
            "carrying prompt chunks: median r -1.00 over 6 runs") in line
    means = live_peers.load_means([row(0, 4), row(2, 4), row(1, 16)])
    assert sorted((m["instances"], m["runs"], m["tps_slo"]) for m in means) == [(4, 2, 101.0), (16, 1, 101.0)]


def test_the_decode_plot_needs_five_runs_with_the_engines_accounting(tmp_path: Path) -> None:
    live_peers = _live_peers()
    rows = [{"router": "ours:smetric" if i % 2 else "vllm:kv_aware", "instances": 8, "engine_itl_ms": 30.0 + i,
             "mixed_share": 0.5 + 0.01 * i, "stall_share": 0.05} for i in range(6)]
    assert not live_peers.plot_decode(rows[:4], tmp_path / "few.png") and not (tmp_path / "few.png").exists()
    assert live_peers.plot_decode(rows, tmp_path / "d.png") and (tmp_path / "d.png").stat().st_size > 0


def test_rows_of_several_cluster_sizes_are_summarized_one_size_at_a_time(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    live_peers = _live_peers()

    def row(router: str, instances: int, tps: float) -> dict:
        return _summary_row(router, tps, instances=instances)

    # on 4 instances the peer leads, on 16 ours: neither size's peak may stand in for the other's
    rows = [row("ours:smetric", 4, 100.0), row("vllm:kv_aware", 4, 200.0),
            row("ours:smetric", 16, 330.0), row("vllm:kv_aware", 16, 300.0)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        for extra, size, ratio in (([], 16, 1.1), (["--instances", "4"], 4, 0.5)):
            assert live_peers.main(["--from-rows", str(path), *extra]) == 0
            text = capsys.readouterr().out
            out = json.loads(text.strip().splitlines()[-1])
            assert out["instances"] == size and out["ours_vs_best_peer_tps_slo"] == {"trace1": ratio}
            assert "rows of 2 cluster sizes (4, 16)" in text
    finally:
        signal.signal(signal.SIGTERM, sigterm)


def _summary_row(router: str, tps: float, **fields: object) -> dict:
    """A run's row with what the report's table and summary read (Trace-1 at 6/s unless ``fields``
    say otherwise)."""
    return {"router": router, "family": router.split(":")[0], "policy": router.split(":")[1], "tuned": False,
            "workload": "trace1", "rate": 6.0, "requests": 10, "failed": 0, "tps_slo": tps, "ttft_p50": 0.1,
            "ttft_p99": 0.2, "local_share": 0.5, "global_share": 0.2, "miss_share": 0.3, "imbalance": 1.1,
            "router_cpu_ms_per_1k": 1000.0, "counters": {}, "argv": [router], **fields}


def test_the_latency_line_says_what_our_gateway_timed_of_its_own_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our gateway's /metrics give its own routing time and the controller's round trip within it;
    a peer's line has no such note."""
    live_peers = _live_peers()
    text = """# HELP smetric_gateway_routing_seconds ...
smetric_gateway_routing_seconds_bucket{le="0.001"} 3.0
smetric_gateway_routing_seconds_sum 0.0024
smetric_gateway_routing_seconds_count 4.0
smetric_gateway_route_rtt_seconds_sum{outcome="ok"} 0.002
smetric_gateway_route_rtt_seconds_count{outcome="ok"} 4.0
smetric_gateway_route_rtt_seconds_count{outcome="timeout"} 1.0
"""

    async def fake_get(_s: Any, url: str) -> str:
        assert url == "http://gw/metrics"
        return text

    monkeypatch.setattr(live_peers, "_get_text", fake_get)
    got = live_peers.gateway_routing("http://gw")
    assert got == {"routing_sum": 0.0024, "routing_count": 4.0, "route_rtt_sum": 0.002, "route_rtt_count": 4.0}
    note = live_peers._routing_note({"gateway_routing_mean_ms": 0.6, "gateway_route_rtt_mean_ms": 0.5})
    assert "mean 0.60 ms" in note and "round trip 0.50" in note
    assert live_peers._routing_note({"p50_ms": 1.0}) == ""


def test_a_parallel_sweep_runs_every_workload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Runs side by side (--parallel) of one workload must not stop the next workload's: the
    sweep's stop flag is for a stopped sweep only (the full mode once skipped every WEKA run, silently,
    after its Trace-1 runs had finished)."""
    live_peers = _live_peers()
    monkeypatch.setattr(live_peers, "load_workloads", lambda names, _n: {n: None for n in names})

    def fake_group(conf: Any, wl: str, _wl: Any, rates: Any, _mode: Any, _root: Any) -> list[dict]:
        if live_peers._STOPPED.is_set():  # as run_group: a stopped sweep starts nothing
            raise live_peers.SweepStopped("the sweep was stopped")
        return [_summary_row(conf.name, 100.0, workload=wl, rate=r) for r in rates]

    monkeypatch.setattr(live_peers, "run_group", fake_group)
    rows = tmp_path / "rows.jsonl"
    assert live_peers.main(["--quick", "--no-latency", "--workloads", "trace1,weka", "--parallel", "2",
                            "--routers", "ours:smetric,vllm:kv_aware", "--rows", str(rows)]) == 0
    got = [json.loads(x) for x in rows.read_text().splitlines()]
    assert {r["workload"] for r in got} == {"trace1", "weka"}
    assert "never started" not in capsys.readouterr().out
    # a run that finds the sweep stopped is said, not dropped in silence

    def stopped(*_a: Any) -> list[dict]:
        raise live_peers.SweepStopped("the sweep was stopped")

    monkeypatch.setattr(live_peers, "run_group", stopped)
    assert live_peers.main(["--quick", "--no-latency", "--workloads", "trace1", "--parallel", "2",
                            "--routers", "ours:smetric"]) == 0
    assert "runs never started (the sweep was stopped): ours:smetric trace1" in capsys.readouterr().out


def _live_peers() -> Any:
    """``bench/live_peers.py`` as a module (the bench folder is not a package)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import live_peers
    finally:
        sys.path.pop(0)
    return live_peers
