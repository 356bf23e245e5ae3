"""smetric replay against a real vLLM CPU engine: the prompts' token ids reproduce the trace's block
sharing in vLLM's own prefix cache (``usage.prompt_tokens_details.cached_tokens``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from smetric_lmc.lab.replay.runner import ReplayConfig, replay
from smetric_lmc.lab.replay.validate import small_workload
from smetric_lmc.lab.sim.cluster import chained_lcp

pytestmark = pytest.mark.e2e


def test_replay_reproduces_block_sharing_on_vllm(start_engines: Callable[..., list]) -> None:
    (engine,) = start_engines(1)
    wl = small_workload(sessions=3, turns=5, context_scale=0.02, output_scale=0.02, seed=4)
    records = replay(wl, ReplayConfig(url=engine.http_url, rate=5.0, max_think_s=0.2, seed=1, feedback=False))
    served = [r for r in records if not r.rejected]
    assert len(served) >= 10 and all(r.ok for r in served), [r.error for r in served if not r.ok]
    by_id = {s.session_id: s for s in wl.sessions}
    follow = 0
    for r in served:
        tr = by_id[r.session_id].requests[r.request]
        before = [q for q in served if q.finish <= r.arrival]
        shared = max((chained_lcp(by_id[q.session_id].requests[q.request].block_ids, tr.block_ids)
                      for q in before), default=0)
        assert r.cached_tokens == min(shared * wl.block_size, (r.input - 1) // 32 * 32), (r.session_id, r.request)
        follow += r.request > 0 and shared > 0
    assert follow >= 5


def test_replayed_answers_hit_vllm_decode_blocks(start_engines: Callable[..., list]) -> None:
    """With feedback, a follow-up resends the tokens vLLM generated; vLLM cached their full blocks."""
    from replay_helpers import check_feedback

    (engine,) = start_engines(1)
    wl = small_workload(sessions=2, turns=6, context_scale=0.05, output_scale=0.05, seed=4)
    records = replay(wl, ReplayConfig(url=engine.http_url, rate=5.0, max_think_s=0.2, seed=1))
    assert all(r.ok for r in records if not r.rejected)
    assert check_feedback([r for r in records if not r.rejected], 32) >= 3
