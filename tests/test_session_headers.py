"""Session identifiers as the peers send them, taken as a turn / est_hit hint (SessionHints), and the
signed LMCache builtin chunk hashes a gateway sends with them."""

from __future__ import annotations

from smetric_lmc.config import LimitsConfig
from smetric_lmc.controller.route_prep import route_inputs
from smetric_lmc.hashing import HashSettings, lmcache_chunk_chain
from smetric_lmc.session import SESSION_HEADERS, SessionHints
from smetric_lmc.wire import RouteRequest


def test_peer_headers_make_later_requests_follow_ups() -> None:
    hints = SessionHints()
    assert {"x-dynamo-session-id", "x-smg-routing-key", "x-smetric-session"} <= set(hints.headers)
    for header in ("x-dynamo-session-id", "X-SMG-Routing-Key", "X-SMetric-Session"):
        key = hints.key({header.lower(): f"s-{header}"})
        assert key == f"s-{header}"
        assert hints.observe(key, None, None, 1000) == (0, None)  # first request: a first turn
        assert hints.observe(key, None, None, 1500) == (1, 1000)  # expects the previous prompt cached
        assert hints.observe(key, None, 42, 400) == (2, 42)  # an explicit est_hit wins
    assert hints.observe(None, None, None, 10) == (None, None)  # no session header: unchanged
    assert hints.observe("chat", 3, 900, 10) == (3, 900)  # a chat's own turn wins


def test_production_stack_session_key_and_bounds() -> None:
    hints = SessionHints(capacity=2)
    assert hints.key({"x-user-id": "u1"}) is None
    hints.add_header("X-User-Id")
    assert hints.key({"x-user-id": "u1"}) == "u1"
    assert len(hints.key({"x-user-id": "k" * 10_000}) or "") == 256
    for k in ("a", "b", "c"):
        hints.observe(k, None, None, 10)
    assert hints.observe("a", None, None, 10)[0] == 0  # evicted: least recently used first
    assert "X-SMetric-Session" in SESSION_HEADERS


def test_signed_lmcache_builtin_chunks_from_a_client_are_accepted() -> None:
    hs = HashSettings(block_size=16, want_chunks=True)
    toks = list(range(1, 4097))
    chunks = lmcache_chunk_chain(toks, 256, root=hs.lmcache_root, algo="builtin")
    assert min(chunks) < 0  # Python hash() values: signed
    req = RouteRequest(request_id="r", token_ids=None, hashes=hs.chains(toks))
    fast, got, n = route_inputs(req, hs, LimitsConfig(), hs.fast_root)
    assert got == chunks and n == 4096
