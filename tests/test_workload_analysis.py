"""Synthetic generator and trace analysis."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from smetric_lmc.lab.workload import (
    WEKA_FIT,
    TraceRequest,
    TraceSession,
    Workload,
    analyze,
    format_report,
    plot_report,
    save_native,
    synthetic,
)
from smetric_lmc.lab.workload.cli import add_trace_subcommands, main


def _ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def _req(t: float, ids: np.ndarray, turn: int, tokens: int | None = None) -> TraceRequest:
    return TraceRequest(t, tokens if tokens is not None else 16 * len(ids), 1, ids, 0.0, "n", turn)


def _sessions_sharing_a_prefix() -> Workload:
    # a, b: a shared system prompt; chained ids, so a "c" after (a, b) is one id everywhere
    a, b, c, d, e, x, f = 1, 2, 3, 4, 5, 6, 7
    s1 = TraceSession("s1", [_req(0.0, _ids(a, b, c), 0), _req(10.0, _ids(a, b, c, d), 1)], None, 0.0)
    s2 = TraceSession("s2", [_req(0.0, _ids(a, b, e), 0)], None, 5.0)
    s3 = TraceSession("s3", [_req(0.0, _ids(x), 0), _req(10.0, _ids(a, b, c, d, f), 0)], None, 20.0)
    return Workload("hand", 16, [s1, s2, s3], {"absolute_starts": True})


def test_reuse_split_known_answer() -> None:
    r = analyze(_sessions_sharing_a_prefix(), instances=2, window_s=1000.0)
    # blocks: 3 + 4 + 3 + 1 + 5 = 16. Hits: s2 (t=5) a,b -> system prompt (first requests of s1, s2);
    # s1 turn 1 (t=10) a,b,c -> intra; s3 (t=30) a,b -> system prompt, c,d -> inter-session.
    assert r.total_blocks == 16 and r.reused_blocks == 9
    assert r.reuse["intra_session"] == pytest.approx(3 / 16)
    assert r.reuse["system_prompt"] == pytest.approx(4 / 16)
    assert r.reuse["inter_session"] == pytest.approx(2 / 16)
    assert r.reuse["total"] == pytest.approx(9 / 16)
    # intervals: 5, 5 (s2); 5, 5, 10 (s1); 20, 20, 20, 20 (s3 at 30 after s1 at 10)
    edges, cdf = r.interval_edges, r.interval_cdf
    assert cdf[np.searchsorted(edges, 5.0) - 1] == 0.0
    assert cdf[np.searchsorted(edges, 5.5)] == pytest.approx(4 / 9)
    assert cdf[np.searchsorted(edges, 11.0)] == pytest.approx(5 / 9)
    assert cdf[-1] == pytest.approx(1.0)
    assert r.first_request_share == pytest.approx(3 / 5)
    assert r.turn0_share == pytest.approx(4 / 5)
    assert r.session_pct["max"] == 2 and r.sessions == 3 and r.families == 3


def test_subagents_count_as_their_family() -> None:
    parent = TraceSession("p", [_req(0.0, _ids(1, 2), 0)], None, 0.0)
    child = TraceSession("p/c", [_req(0.0, _ids(1, 2, 3), 0)], "p", 1.0)
    r = analyze(Workload("fam", 16, [parent, child], {"absolute_starts": True}))
    assert r.families == 1
    assert r.reuse["intra_session"] == pytest.approx(2 / 5)
    assert r.reuse["inter_session"] == 0 and r.reuse["system_prompt"] == 0


def test_balance_least_tokens_vs_sticky() -> None:
    s1 = TraceSession("s1", [_req(0.0, _ids(1), 0, 300), _req(2.0, _ids(1, 2), 1, 100)], None, 0.0)
    s2 = TraceSession("s2", [_req(0.0, _ids(9), 0, 100)], None, 1.0)
    r = analyze(Workload("bal", 16, [s1, s2], {"absolute_starts": True}), instances=2, window_s=100.0)
    # least tokens: 300 -> i0, 100 -> i1, 100 -> i1: loads 300/200. Sticky: s1's follow-up -> i0: 400/100.
    assert r.balance["least_tokens"]["mean"] == pytest.approx(300 / 250)
    assert r.balance["sticky_sessions"]["mean"] == pytest.approx(400 / 250)


def test_placement_without_start_times_is_poisson_and_seeded() -> None:
    w = synthetic(30, seed=5, scale=0.05)
    a = analyze(w, seed=1)
    b = analyze(w, seed=1)
    c = analyze(w, seed=2)
    assert "Poisson" in a.placement
    assert a.interval_cdf.tolist() == b.interval_cdf.tolist()
    assert a.balance == b.balance
    assert a.balance != c.balance
    # reuse inside sessions does not depend on where sessions are placed
    assert a.reuse["intra_session"] == pytest.approx(c.reuse["intra_session"])


def test_synthetic_deterministic(tmp_path: Path) -> None:
    w = synthetic(200, seed=11)
    again = synthetic(200, seed=11)
    other = synthetic(200, seed=12)
    assert save_native(w, tmp_path / "a").read_bytes() == save_native(again, tmp_path / "b").read_bytes()
    assert (tmp_path / "a").read_bytes() != save_native(other, tmp_path / "c").read_bytes()
    # different seeds never share session blocks, only the framework prompts (main + each sub-agent type)
    ids_w = set(np.concatenate([s.requests[-1].block_ids for s in w.sessions]).tolist())
    ids_o = set(np.concatenate([s.requests[-1].block_ids for s in other.sessions]).tolist())
    p = WEKA_FIT
    bound = p.main.prompt_tokens // 64 + len(p.subagent_types) * (p.subagent.prompt_tokens // 64)
    assert 0 < len(ids_w & ids_o) <= bound


def test_synthetic_statistics_match_the_fit() -> None:
    w = synthetic(300, seed=2)
    r = analyze(w)
    # bounds around the WEKA trace's measured values (docs/workload.md)
    assert 25 <= r.session_pct["p50"] <= 70  # real: 38.5 per session
    assert 60_000 <= r.input_pct["p50"] <= 160_000  # real: 104,946
    assert 120 <= r.output_pct["p50"] <= 350  # real: 217
    assert 5 <= r.gap_pct["p50"] <= 40  # real: 18 s
    assert 0.005 <= r.first_request_share <= 0.04  # real: 1.6%
    assert 0.93 <= r.reuse["total"] <= 0.99  # real: 96.5% with the shared prefix
    assert r.reuse["system_prompt"] > 0 and r.reuse["inter_session"] == pytest.approx(0.0, abs=1e-3)
    assert set(r.kinds) == {"n", "s"}
    for s in w.sessions:
        for k, q in enumerate(s.requests):
            assert len(q.block_ids) == q.input_tokens // 64
            assert q.turn == 0 or np.array_equal(
                q.block_ids[: len(s.requests[k - 1].block_ids)], s.requests[k - 1].block_ids
            )
            assert k == 0 or q.arrival > s.requests[k - 1].arrival


def test_synthetic_scale_keeps_shape() -> None:
    full = analyze(synthetic(150, seed=4))
    small = analyze(synthetic(150, seed=4, scale=0.1))
    assert small.input_pct["p50"] == pytest.approx(full.input_pct["p50"] * 0.1, rel=0.1)
    assert small.session_pct == full.session_pct
    assert small.gap_pct["p50"] == pytest.approx(full.gap_pct["p50"], rel=0.05)


def test_format_and_plot(tmp_path: Path) -> None:
    r = analyze(_sessions_sharing_a_prefix(), instances=2)
    text = format_report(r)
    assert "| total | intra-session | inter-session | system prompt |" in text
    assert "| 56.2% | 18.8% | 12.5% | 25.0% |" in text
    paths = plot_report(r, tmp_path)
    assert len(paths) == 3 and all(p.stat().st_size > 1000 for p in paths)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    out = tmp_path / "syn.smw"
    assert (
        main(["trace", "synth", "--sessions", "5", "--seed", "1", "--scale", "0.05", "--out", str(out)]) == 0
    )
    assert main(["trace", "analyze", str(out), "--instances", "4", "--out", str(tmp_path / "rep")]) == 0
    assert "Ideal block reuse" in capsys.readouterr().out
    assert len(list((tmp_path / "rep").glob("*.png"))) == 3
    assert main(["trace", "convert", str(out), str(tmp_path / "copy.smw")]) == 0
    assert (tmp_path / "copy.smw").read_bytes() == out.read_bytes()
    parser = argparse.ArgumentParser()
    add_trace_subcommands(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["trace", "analyze", "synthetic", "--sessions", "3", "--scale", "0.05"])
    assert args.func(args) == 0
