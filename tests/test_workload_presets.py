"""Workload presets: `weka` is the WEKA fit unchanged, `trace1` matches the paper's Trace 1 statistics."""

from __future__ import annotations

import numpy as np
import pytest

from smetric_lmc.cli import main
from smetric_lmc.lab.workload import TraceRequest, TraceSession, Workload, analyze, save_native, synthetic
from smetric_lmc.lab.workload.presets import (
    PAPER_TRACE1,
    TRACE1,
    nominal_rate,
    preset_params,
    preset_workload,
    requests_per_root,
)


def test_weka_preset_is_the_fit_unchanged(tmp_path) -> None:
    a = save_native(preset_workload("weka", 30, seed=3), tmp_path / "a").read_bytes()
    b = save_native(synthetic(30, seed=3), tmp_path / "b").read_bytes()
    assert a == b


def test_trace1_matches_the_papers_published_statistics() -> None:
    r = analyze(preset_workload("trace1", 600, seed=0), scope="session")
    tot = r.reuse["total"]
    assert 0.76 <= tot <= 0.85  # paper: ~80%
    assert 0.62 <= r.reuse["intra_session"] / tot <= 0.72  # ~67%
    assert 0.16 <= r.reuse["system_prompt"] / tot <= 0.22  # 18-20%
    assert 0.08 <= r.reuse["inter_session"] / tot <= 0.18  # the rest: forks sharing the parent's context
    within_100s = float(np.interp(100.0, r.interval_edges, r.interval_cdf))
    assert within_100s >= 0.85  # ~90% of reuse within ~100 s


def test_forks_carry_the_parents_context_and_turns() -> None:
    w = preset_workload("trace1", 50, seed=1)
    by_id = {s.session_id: s for s in w.sessions}
    forks = [s for s in w.sessions if s.parent_id is not None]
    assert forks
    for f in forks[:20]:
        parent = by_id[f.parent_id]
        first = f.requests[0]
        # the fork's first request starts with some parent request's whole context, one turn later
        src = [
            r
            for r in parent.requests
            if len(r.block_ids) and np.array_equal(first.block_ids[: len(r.block_ids)], r.block_ids)
        ]
        assert src and first.turn == max(r.turn for r in src) + 1
        assert first.turn > 0  # a stateless router sees its history: not a first turn


def test_frameworks_have_their_own_prompts() -> None:
    w = preset_workload("trace1", 200, seed=2)
    bs, prompt = w.block_size, TRACE1.main.prompt_tokens // w.block_size
    heads = {int(s.requests[0].block_ids[0]) for s in w.sessions if s.parent_id is None}
    assert len(heads) == len(TRACE1.frameworks)
    assert prompt * bs <= min(s.requests[0].input_tokens for s in w.sessions if s.parent_id is None)


def test_trace1_prompts_share_a_head_per_framework_and_the_rest_per_user() -> None:
    w = preset_workload("trace1", 300, seed=5)
    head = TRACE1.prompt_shared_tokens // w.block_size
    prompt = TRACE1.main.prompt_tokens // w.block_size
    roots = [s for s in w.sessions if s.parent_id is None]
    by_head: dict[int, set[int]] = {}
    for s in roots:
        b = s.requests[0].block_ids
        by_head.setdefault(int(b[head - 1]), set()).add(int(b[prompt - 1]))
    assert len(by_head) == len(TRACE1.frameworks)  # the head: one per framework
    variants = sum(len(v) for v in by_head.values())
    # the rest: one per (framework, user) in use, each repeated by about sessions_per_user roots
    assert len(TRACE1.frameworks) < variants < len(roots) / 4
    old = preset_workload("trace1-shared", 300, seed=5)
    assert len({int(s.requests[0].block_ids[prompt - 1]) for s in old.sessions if s.parent_id is None}) == 3


def test_scale_and_context_limit() -> None:
    small = preset_workload("trace1", 200, seed=4, scale=0.5)
    full = preset_workload("trace1", 200, seed=4)
    ms = np.mean([r.input_tokens for _, r in small.iter_requests()])
    mf = np.mean([r.input_tokens for _, r in full.iter_requests()])
    assert ms == pytest.approx(0.5 * mf, rel=0.1)
    capped = preset_workload("trace1", 200, seed=4, scale=4.0, context_limit=100_000)
    assert max(r.input_tokens for _, r in capped.iter_requests()) <= 100_000
    assert preset_params("trace1", 2.0, context_limit=10**9).context_limit == int(TRACE1.max_context * 2.0)
    with pytest.raises(ValueError):
        preset_params("nope")


def test_nominal_rate_offers_the_papers_request_rate() -> None:
    w = preset_workload("trace1", 300, seed=0)
    rate = nominal_rate(w, 32)
    assert rate * requests_per_root(w) * 60 / 32 == pytest.approx(PAPER_TRACE1["rpm_per_instance"])


def test_session_scope_counts_a_forks_reuse_of_its_parent_as_inter_session() -> None:
    ids = lambda *x: np.array(x, dtype=np.uint64)  # noqa: E731
    parent = TraceSession("p", [TraceRequest(0.0, 48, 1, ids(1, 2, 3), 0.0, "n", 0)], None, 0.0)
    fork = TraceSession("p/f", [TraceRequest(0.0, 64, 1, ids(1, 2, 3, 4), 0.0, "n", 1)], "p", 1.0)
    w = Workload("fork", 16, [parent, fork], {"absolute_starts": True})
    fam, ses = analyze(w), analyze(w, scope="session")
    assert fam.reuse["intra_session"] == pytest.approx(3 / 7) and fam.reuse["inter_session"] == 0
    assert ses.reuse["intra_session"] == 0 and ses.reuse["inter_session"] == pytest.approx(3 / 7)
    with pytest.raises(ValueError):
        analyze(w, scope="nope")


def test_trace_presets_command_prints_the_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "presets", "--sessions", "120"]) == 0
    out = capsys.readouterr().out
    assert "| paper, Trace 1 |" in out and "| preset trace1 (120 roots) |" in out and "| preset weka" in out
