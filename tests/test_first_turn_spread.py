"""Issue 21 item 1: first turns spread evenly over tied instances, whatever the follow-ups do.

The paper's ``rr_argmin(l)`` rotates a session's first request over all least-loaded instances.
Sessions of ``k`` turns sent one after another to an idle cluster of ``n`` instances must put their
first turns on every instance equally, for every ``k`` — through the Router (what the controller
and the simulator run) and through a live controller's route socket.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_controller_app import base_config

from smetric_lmc.client import AsyncRouteClient
from smetric_lmc.config import PolicyConfig, parse_config
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.hashing import fast_chain
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router
from smetric_lmc.wire import Reason

BS = 16
# The policies whose first turn is "least loaded, ties round-robin".
BALANCING = ("smetric", "smetric_ect", "smetric_ect_fixed", "load_balance")


def _prompt(session: int, turn: int) -> list[int]:
    """A session's prompt at ``turn``: its own history grows by 4 blocks a turn (no shared prefix)."""
    return [session * 100_000 + t for t in range((turn + 1) * 4 * BS)]


def _run_sessions(r: Router, n_sessions: int, k: int) -> Counter[str]:
    """Sessions of ``k`` turns one after another; each request ends before the next starts, and
    the engine reports the prompt's blocks cached where it ran. Returns first turns per instance."""
    firsts: Counter[str] = Counter()
    for s in range(n_sessions):
        home = None
        for t in range(k):
            p = _prompt(s, t)
            blocks = fast_chain(p, BS)
            d = r.route(f"s{s}t{t}", blocks, None, len(p), turn=t, est_hit=len(_prompt(s, t - 1)) if t else 0)
            assert d.instance_id is not None
            if t == 0:
                firsts[d.instance_id] += 1
                home = d.instance_id
            elif r.policy_cfg.name == "smetric":
                assert (d.instance_id, d.reason) == (home, Reason.STICKY)
            r.index.gpu_stored_hashes(d.instance_id, blocks)
            r.load.on_done(f"s{s}t{t}")
    return firsts


@pytest.mark.parametrize("policy", BALANCING)
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 7), k=st.integers(1, 6), rounds=st.integers(1, 3))
def test_first_turns_rotate_over_all_idle_instances_for_every_session_length(
    policy: str, n: int, k: int, rounds: int
) -> None:
    ix = TierIndex(BS, 64)
    for i in range(n):
        ix.register_instance(f"i{i}")
    r = Router(ix, LoadTracker(), PolicyConfig(name=policy))
    firsts = _run_sessions(r, rounds * n, k)
    assert firsts == Counter({f"i{i}": rounds for i in range(n)}), (policy, n, k)


def test_the_two_turn_and_four_turn_cases_of_the_report() -> None:
    """The issue's observation: 4 instances, 8 sessions of 4 turns (all went to one instance) and
    of 2 turns (alternated between two)."""
    for k in (2, 4):
        ix = TierIndex(BS, 64)
        for i in range(4):
            ix.register_instance(f"mock-{i}")
        firsts = _run_sessions(Router(ix, LoadTracker(), PolicyConfig()), 8, k)
        assert sorted(firsts.values()) == [2, 2, 2, 2], (k, firsts)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
async def test_first_turns_spread_through_a_live_controller(k: int) -> None:
    """A real ControllerApp on its ZMQ route socket. No engine runs here, so each prompt's vLLM
    ``BlockStored`` is applied to the controller's index directly (the event path itself is
    covered by test_controller_app's recorded-events test); routes and dones go over the wire."""
    ids = [f"mock-{i}" for i in range(4)]
    cfg = base_config(instances=[{"id": i, "http": "http://127.0.0.1:9"} for i in ids])
    app = ControllerApp(parse_config(cfg))
    await app.start()
    try:
        firsts = await _live_sessions(app, k)
    finally:
        await app.close()
    assert firsts == Counter({i: 2 for i in ids}), (k, firsts)


async def _live_sessions(app: ControllerApp, k: int) -> Counter[str]:
    bs = app.index.block_size
    firsts: Counter[str] = Counter()
    async with AsyncRouteClient(app.service.endpoint or "", timeout_s=3.0) as client:
        for s in range(8):
            for t in range(k):
                p = [s * 100_000 + x for x in range((t + 1) * 2 * bs)]
                d = await client.route(f"s{s}t{t}", token_ids=p, turn=t,
                                       est_hit_tokens=(t * 2 * bs) if t else None)
                assert d.instance_id is not None
                if t == 0:
                    firsts[d.instance_id] += 1
                else:
                    assert d.policy == "smetric" and d.reason == Reason.STICKY
                # the engine's BlockStored for this prompt (vLLM's own hashes are opaque here)
                app.index.gpu_stored(d.instance_id, list(range(1, len(p) // bs + 1)), None, p, bs)
                await client.done(f"s{s}t{t}", instance_id=d.instance_id, prompt_tokens=len(p), output_tokens=1)
    return firsts
