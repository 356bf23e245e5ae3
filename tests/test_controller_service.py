"""The route service over real ZMQ sockets on 127.0.0.1 (msgpack and JSON, bad input, CURVE)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from service_helpers import BS, PROMPT, ROOT, ServiceThread, connect_dealer, make_core, route_req, seed

from smetric_lmc.controller.service import RouteService, split_envelope
from smetric_lmc.hashing import fast_chain, lmcache_chunk_chain
from smetric_lmc.wire import (
    DoneAck,
    DoneReport,
    ErrorReply,
    HashChain,
    HealthReply,
    HealthRequest,
    InstancesReply,
    InstancesRequest,
    RouteDecision,
    RouteRequest,
    StatsReply,
    StatsRequest,
    decode_reply,
    encode,
)


@pytest.fixture
def svc() -> Iterator[ServiceThread]:
    core = make_core()
    seed(core, "i1", PROMPT)
    with ServiceThread(core) as st:
        yield st


@pytest.fixture
def dealer(svc: ServiceThread) -> Iterator[zmq.Socket]:
    with connect_dealer(svc.endpoint) as s:
        yield s


def ask(sock: zmq.Socket, payload: bytes, *, delimiter: bool = True) -> bytes:
    sock.send_multipart([b"", payload] if delimiter else [payload])
    frames = sock.recv_multipart()
    if delimiter:
        assert frames[0] == b"" and len(frames) == 2
    else:
        assert len(frames) == 1
    return frames[-1]


# ---- route, both encodings ----------------------------------------------------------------------


def test_route_msgpack_sticks_to_the_prefix_holder(dealer: zmq.Socket) -> None:
    reply = decode_reply(ask(dealer, encode(route_req())))
    assert isinstance(reply, RouteDecision)
    assert reply.instance_id == "i1" and reply.endpoint == "http://127.0.0.1:8001"
    assert reply.reason.value == "sticky" and reply.policy == "smetric"
    assert reply.local_hit_tokens == 40 * BS  # full blocks only
    assert reply.prompt_tokens == len(PROMPT)
    assert reply.est_hit_tokens == (len(PROMPT) - 50) // BS * BS


def test_route_json_is_answered_in_json(dealer: zmq.Socket) -> None:
    raw = ask(dealer, encode(route_req(), json=True))
    assert raw[:1] == b"{"
    reply = decode_reply(raw)
    assert isinstance(reply, RouteDecision) and reply.instance_id == "i1"
    # A hand-written JSON request (what a gateway in another language sends).
    hand = b'{"type":"route","request_id":"j2","token_ids":[1,2,3],"turn":0}'
    reply2 = msgspec.json.decode(ask(dealer, hand))
    assert reply2["type"] == "decision" and reply2["request_id"] == "j2" and reply2["reason"] == "first_turn"


def test_route_with_hashes_only_equals_token_ids(dealer: zmq.Socket) -> None:
    chain = HashChain("fast", BS, fast_chain(PROMPT, BS, root=ROOT))
    req = RouteRequest(request_id="h1", hashes=[chain], turn=2, est_hit_tokens=600)
    reply = decode_reply(ask(dealer, encode(req)))
    assert isinstance(reply, RouteDecision)
    assert (reply.instance_id, reply.local_hit_tokens, reply.prompt_tokens) == ("i1", 640, 640)


def test_framing_without_delimiter_and_via_req(svc: ServiceThread, dealer: zmq.Socket) -> None:
    reply = decode_reply(ask(dealer, encode(HealthRequest()), delimiter=False))
    assert isinstance(reply, HealthReply)
    req = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, 3000)
    req.connect(svc.endpoint)
    try:
        req.send(encode(StatsRequest(), json=True))
        assert isinstance(decode_reply(req.recv()), StatsReply)
    finally:
        req.close(linger=0)
    # A DEALER tagging requests with a correlation frame gets the tag back.
    dealer.send_multipart([b"tag-7", b"", encode(HealthRequest())])
    frames = dealer.recv_multipart()
    assert frames[:2] == [b"tag-7", b""] and isinstance(decode_reply(frames[2]), HealthReply)


# ---- bad input: error replies, and the service keeps serving ---------------------------------------


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\xc1garbage\xff\x00", "bad_request"),
        (b"{not json", "bad_request"),
        (b"", "bad_request"),
        (msgspec.msgpack.encode({"type": "route", "request_id": 5}), "bad_request"),  # wrong type
        (msgspec.msgpack.encode({"type": "route", "request_id": "x", "token_ids": "abc"}), "bad_request"),
        (msgspec.msgpack.encode({"type": "route", "request_id": "x", "tokens": [1]}), "bad_request"),  # unknown field
        (msgspec.msgpack.encode({"type": "teleport"}), "bad_request"),
        (msgspec.msgpack.encode([1, 2, 3]), "bad_request"),
        (msgspec.msgpack.encode({"type": "route", "request_id": "x", "token_ids": [1], "version": 99}), "unsupported_version"),
        (msgspec.msgpack.encode({"type": "route", "request_id": "x"}), "bad_request"),  # no prompt at all
        (msgspec.msgpack.encode({"type": "route", "request_id": "", "token_ids": [1]}), "bad_request"),
        (msgspec.msgpack.encode({"type": "route", "request_id": "x" * 600, "token_ids": [1]}), "bad_request"),
        (msgspec.msgpack.encode({"type": "route", "request_id": "x", "token_ids": [-1] * 32}), "bad_request"),
        (msgspec.msgpack.encode({"type": "route", "request_id": "x", "token_ids": [2**40] * 16}), "bad_request"),
        (msgspec.msgpack.encode({"type": "route", "request_id": "x", "token_ids": [1], "turn": -1}), "bad_request"),
        (msgspec.msgpack.encode({"type": "route", "request_id": "x", "hashes": [{"scheme": "fast", "block_size": 32, "hashes": [1]}]}), "bad_request"),
        (msgspec.msgpack.encode({"type": "route", "request_id": "x", "hashes": [{"scheme": "vllm_sha256_cbor", "block_size": 16, "hashes": [1]}]}), "bad_request"),
        (msgspec.msgpack.encode({"type": "done", "request_id": ["x"]}), "bad_request"),
    ],
)
def test_bad_frames_get_error_replies(dealer: zmq.Socket, payload: bytes, code: str) -> None:
    reply = decode_reply(ask(dealer, payload))
    assert isinstance(reply, ErrorReply), reply
    assert reply.code == code, reply.message
    # ...and the next good request is served normally.
    assert isinstance(decode_reply(ask(dealer, encode(route_req("after")))), RouteDecision)


def test_error_reply_names_the_request_and_speaks_json(dealer: zmq.Socket) -> None:
    raw = ask(dealer, b'{"type":"route","request_id":"bad-1","token_ids":[1],"turn":-2}')
    reply = decode_reply(raw)
    assert raw[:1] == b"{" and isinstance(reply, ErrorReply)
    assert reply.code == "bad_request" and reply.request_id == "bad-1" and "turn" in reply.message
    # A frame the schema rejects is not decoded a second time to find its request_id.
    reply = decode_reply(ask(dealer, b'{"type":"route","request_id":"bad-2","token_ids":[1],"turn":"two"}'))
    assert isinstance(reply, ErrorReply) and reply.request_id is None and "turn" in reply.message


def test_oversize_frame_is_rejected_before_decoding() -> None:
    core = make_core()
    with ServiceThread(core, max_frame_bytes=4096) as st, connect_dealer(st.endpoint) as s:
        big = encode(RouteRequest(request_id="big", token_ids=list(range(5000))))
        assert len(big) > 4096
        reply = decode_reply(ask(s, big))
        assert isinstance(reply, ErrorReply) and reply.code == "too_large"
        assert st.service is not None and st.service.counters["too_large"] == 1
        assert core.counters["route"] == 0  # never decoded
        assert isinstance(decode_reply(ask(s, encode(route_req("ok", token_ids=PROMPT[:64])))), RouteDecision)


def test_misframed_messages_are_answered_or_dropped(svc: ServiceThread, dealer: zmq.Socket) -> None:
    dealer.send_multipart([b"", b"one", b"two"])  # two payload frames
    frames = dealer.recv_multipart()
    assert frames[0] == b"" and decode_reply(frames[1]).code == "bad_request"  # type: ignore[union-attr]
    dealer.send_multipart([b"a", b"b", b"c"])  # no delimiter, three frames
    reply = decode_reply(dealer.recv_multipart()[-1])
    assert isinstance(reply, ErrorReply)
    assert isinstance(decode_reply(ask(dealer, encode(HealthRequest()))), HealthReply)
    assert svc.service is not None and svc.service.counters["bad_frames"] == 2


def test_random_garbage_never_kills_the_service(dealer: zmq.Socket, svc: ServiceThread) -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randrange(0, 200)
        payload = bytes(rng.randrange(256) for _ in range(n))
        reply = decode_reply(ask(dealer, payload))
        assert isinstance(reply, ErrorReply | RouteDecision | HealthReply | StatsReply | InstancesReply | DoneAck)
    assert isinstance(decode_reply(ask(dealer, encode(route_req("alive")))), RouteDecision)
    assert svc.core.counters["internal_errors"] == 0


def test_a_burst_of_pipelined_requests_is_answered_in_full(svc: ServiceThread, dealer: zmq.Socket) -> None:
    n = 500  # well past one drain batch of the service loop
    for k in range(n):
        dealer.send_multipart([f"{k}".encode(), b"", encode(route_req(f"burst{k}", token_ids=PROMPT[:64]))])
    seen = set()
    for _ in range(n):
        corr, _empty, raw = dealer.recv_multipart()
        reply = decode_reply(raw)
        assert isinstance(reply, RouteDecision) and reply.request_id == f"burst{corr.decode()}"
        seen.add(corr)
    assert len(seen) == n
    assert svc.service is not None and svc.service.counters["replies"] == n


class _InstantPrep:
    """Stands in for the frame worker process: the frame is "prepared" at once, so the test
    controls what happens between the worker's answer and the reply's send."""

    def start(self) -> bool:
        return True

    def prepare(self, payload: bytes, fast_root: int) -> asyncio.Future[tuple[object, ...]]:
        fut: asyncio.Future[tuple[object, ...]] = asyncio.get_running_loop().create_future()
        fut.set_result(("request", HealthRequest()))
        return fut

    def close(self) -> None:
        pass


def test_a_request_that_arrives_while_a_large_frame_is_answered_is_not_lost(svc: ServiceThread) -> None:
    # ZMQ signals its socket's file descriptor once per batch of arrivals, and any operation on the
    # socket may consume that signal. A large frame's reply is sent from its own task while the
    # service waits for the descriptor: a request whose arrival the send consumed was never read,
    # and every later one queued behind it (the route service hung for good: bench/soak.py).
    assert svc.service is not None
    svc.service._prep = _InstantPrep()  # type: ignore[assignment]
    answer = svc.core.answer
    assert svc.service._sock is not None
    route_sock = zmq.Socket.shadow(svc.service._sock.underlying)
    with connect_dealer(svc.endpoint) as big, connect_dealer(svc.endpoint) as small:
        for sock in (big, small):  # connected, and past the command a pipe's first message brings back
            assert isinstance(decode_reply(ask(sock, encode(HealthRequest()))), HealthReply)
        time.sleep(0.1)

        def answer_after_an_arrival(req: object, as_json: bool, **kw: object) -> bytes:
            small.send_multipart([b"", encode(HealthRequest())])
            time.sleep(0.2)  # ZMQ's I/O thread queues it and signals the route socket
            # What libzmq's send does when it gets to its command queue first (whether it does is
            # a matter of timing): take in the arrival, which clears the descriptor's signal.
            assert route_sock.get(zmq.EVENTS) & zmq.POLLIN
            return answer(req, as_json, **kw)  # type: ignore[arg-type]

        svc.core.answer = answer_after_an_arrival  # type: ignore[method-assign]
        big.send_multipart([b"", b"\x00" * (RouteService.OFFLOAD_BYTES + 1)])
        assert isinstance(decode_reply(big.recv_multipart()[-1]), HealthReply)
        svc.core.answer = answer  # type: ignore[method-assign]
        assert isinstance(decode_reply(small.recv_multipart()[-1]), HealthReply)  # RCVTIMEO 3 s
        assert isinstance(decode_reply(ask(small, encode(HealthRequest()))), HealthReply)


def test_split_envelope() -> None:
    assert split_envelope([b"id", b"p"]) == ([b"id"], b"p")
    assert split_envelope([b"id", b"", b"p"]) == ([b"id", b""], b"p")
    assert split_envelope([b"id", b"c", b"", b"p"]) == ([b"id", b"c", b""], b"p")
    assert split_envelope([b"id", b"", b"p", b"q"]) == ([b"id", b""], None)
    assert split_envelope([b"id"]) == ([], None)


# ---- done / stats / health / instances ------------------------------------------------------------


def test_done_releases_load(dealer: zmq.Socket, svc: ServiceThread) -> None:
    load = svc.core.load
    d = decode_reply(ask(dealer, encode(route_req("d1"))))
    assert isinstance(d, RouteDecision) and d.instance_id is not None
    assert load.in_flight(d.instance_id) == 1
    ack = decode_reply(ask(dealer, encode(DoneReport(request_id="d1", instance_id=d.instance_id, output_tokens=5))))
    assert isinstance(ack, DoneAck) and ack.released is True
    assert load.in_flight(d.instance_id) == 0
    again = decode_reply(ask(dealer, encode(DoneReport(request_id="d1"), json=True)))
    assert isinstance(again, DoneAck) and again.released is False


def test_stats_health_instances(dealer: zmq.Socket) -> None:
    ask(dealer, encode(route_req("s1")))
    stats = decode_reply(ask(dealer, encode(StatsRequest())))
    assert isinstance(stats, StatsReply)
    assert stats.stats["service"]["route"] == 1 and stats.stats["index_ready"] is True
    assert stats.stats["hashing"]["block_size"] == BS and stats.stats["hashing"]["fast_root"] == ROOT
    assert stats.stats["policy"]["name"] == "smetric"
    health = decode_reply(ask(dealer, encode(HealthRequest(), json=True)))
    assert isinstance(health, HealthReply)
    assert (health.ok, health.routable_instances, health.index_ready, health.global_store) == (True, 2, True, "none")
    inst = decode_reply(ask(dealer, encode(InstancesRequest())))
    assert isinstance(inst, InstancesReply)
    by_id = {i.id: i for i in inst.instances}
    assert by_id["i1"].indexed_blocks == 40 and by_id["i0"].indexed_blocks == 0
    assert by_id["i1"].in_flight == 1 and by_id["i1"].routable and by_id["i1"].endpoint == "http://127.0.0.1:8001"


def test_empty_index_degrades_to_load_balance() -> None:
    core = make_core()
    with ServiceThread(core) as st, connect_dealer(st.endpoint) as s:
        d = decode_reply(ask(s, encode(route_req("x1"))))
        assert isinstance(d, RouteDecision) and d.policy == "load_balance"
        h = decode_reply(ask(s, encode(HealthRequest())))
        assert isinstance(h, HealthReply) and h.index_ready is False and h.ok
        seed(core, "i0", PROMPT)
        d2 = decode_reply(ask(s, encode(route_req("x2"))))
        assert isinstance(d2, RouteDecision) and d2.policy == "smetric" and d2.instance_id == "i0"


def test_no_instances_is_a_decision_without_endpoint() -> None:
    core = make_core(0)
    with ServiceThread(core) as st, connect_dealer(st.endpoint) as s:
        d = decode_reply(ask(s, encode(route_req("n1"))))
        assert isinstance(d, RouteDecision)
        assert d.instance_id is None and d.endpoint is None and d.reason.value == "no_instances"
        h = decode_reply(ask(s, encode(HealthRequest())))
        assert isinstance(h, HealthReply) and not h.ok


def test_lmcache_chunks_count_as_local_hits() -> None:
    core = make_core(want_chunks=True)
    tokens = list(range(600))
    core.index.lmcache_admit("i0", lmcache_chunk_chain(tokens, 256, root=0))
    with ServiceThread(core) as st, connect_dealer(st.endpoint) as s:
        d = decode_reply(ask(s, encode(RouteRequest(request_id="c1", token_ids=tokens, turn=1, est_hit_tokens=512))))
        assert isinstance(d, RouteDecision) and (d.instance_id, d.local_hit_tokens) == ("i0", 512)
        # The same chain sent pre-hashed (lmcache scheme) gives the same answer.
        chain = HashChain("lmcache_builtin", 256, lmcache_chunk_chain(tokens, 256, root=0))
        d2 = decode_reply(ask(s, encode(RouteRequest(request_id="c2", hashes=[chain], turn=1, est_hit_tokens=512))))
        assert isinstance(d2, RouteDecision) and (d2.instance_id, d2.local_hit_tokens) == ("i0", 512)


def test_disaggregated_routes_only_to_prefill_capable_instances() -> None:
    core = make_core(3, disaggregated=True, roles=["decode", "prefill", "both"])
    seed(core, "i0", PROMPT)  # the decode instance holds the prefix, but takes no new requests
    with ServiceThread(core) as st, connect_dealer(st.endpoint) as s:
        chosen = set()
        for k in range(6):  # distinct last blocks: none extends another's pending prompt
            d = decode_reply(ask(s, encode(route_req(f"p{k}", token_ids=PROMPT[: 39 * BS] + [50_000 + k] * BS))))
            assert isinstance(d, RouteDecision)
            chosen.add(d.instance_id)
        assert chosen == {"i1", "i2"}
        h = decode_reply(ask(s, encode(HealthRequest())))
        assert isinstance(h, HealthReply) and h.routable_instances == 2


# ---- CURVE ---------------------------------------------------------------------------------------


def test_curve_on_and_off() -> None:
    from smetric_lmc.client import RouteClient, RouteTimeout

    public, secret = (k.decode() for k in zmq.curve_keypair())
    core = make_core()
    seed(core, "i1", PROMPT)
    with ServiceThread(core, curve_secret_key=secret, curve_public_key=public) as st:
        with RouteClient(st.endpoint, curve_server_key=public, timeout_s=3.0) as c:
            d = c.route("cv1", token_ids=PROMPT, turn=1, est_hit_tokens=600)
            assert d.instance_id == "i1"
        with RouteClient(st.endpoint, timeout_s=0.3) as plain, pytest.raises(RouteTimeout):
            plain.route("cv2", token_ids=PROMPT)
        wrong_public, _ = (k.decode() for k in zmq.curve_keypair())
        with RouteClient(st.endpoint, curve_server_key=wrong_public, timeout_s=0.3) as wrong, pytest.raises(RouteTimeout):
            wrong.health()
    assert core.counters["route"] == 1  # neither unauthenticated request reached the handler
    with ServiceThread(make_core()) as st2, RouteClient(st2.endpoint, timeout_s=3.0) as c2:
        assert c2.health().routable_instances == 2


def test_curve_allow_list_refuses_unknown_clients_clearly() -> None:
    from smetric_lmc.client import RouteClient, RouteRefused

    public, secret = (k.decode() for k in zmq.curve_keypair())
    known_pub, known_sec = (k.decode() for k in zmq.curve_keypair())
    core = make_core()
    with ServiceThread(core, curve_secret_key=secret, curve_public_key=public, curve_client_keys=[known_pub]) as st:
        with RouteClient(st.endpoint, curve_server_key=public, curve_public_key=known_pub,
                         curve_secret_key=known_sec, timeout_s=3.0) as c:
            assert c.health().ok
        # A self-made keypair is encrypted fine but not on the list: refused, and the client says so.
        with RouteClient(st.endpoint, curve_server_key=public, timeout_s=1.0) as stranger, \
                pytest.raises(RouteRefused, match="refused"):
            stranger.health()
        with RouteClient(st.endpoint, timeout_s=1.0) as plain, pytest.raises(RouteRefused, match="CURVE"):
            plain.health()
        assert st.service is not None and st.service.curve_counts["curve_refused"] >= 1
    assert core.counters["health"] == 1


def test_curve_needs_both_keys() -> None:
    _, secret = (k.decode() for k in zmq.curve_keypair())
    with pytest.raises(ValueError, match="CURVE"):
        RouteService(make_core(), "tcp://127.0.0.1:*", curve_secret_key=secret).bind()

