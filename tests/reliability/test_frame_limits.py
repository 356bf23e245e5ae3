"""Route frame size limits: the configured ``limits.max_frame_bytes`` drives the wire decoder, and
every frame over it, up to the transport cap, gets a ``too_large`` reply without being decoded, counted;
beyond the cap the transport drops the connection."""

from __future__ import annotations

import msgspec
import zmq
from service_helpers import PROMPT, ServiceThread, connect_dealer, make_core, route_req  # noqa: E402

from smetric_lmc.config import LimitsConfig
from smetric_lmc.controller.route_prep import prepare_frame
from smetric_lmc.wire import ErrorReply, RouteDecision, StatsReply, decode_reply, encode

MIB = 1 << 20


def _padded_stats(size: int) -> bytes:
    """A valid JSON ``stats`` request of ``size`` bytes (JSON allows trailing whitespace)."""
    head = b'{"type":"stats"}'
    return head + b" " * (size - len(head))


def test_the_configured_frame_limit_drives_the_decoder_not_a_fixed_16_mib() -> None:
    frame = _padded_stats(20 * MIB)  # over the old fixed 16 MiB cap, under the configured 24 MiB
    core = make_core()
    core.limits = LimitsConfig(max_frame_bytes=24 * MIB)
    assert isinstance(decode_reply(core.handle(frame)), StatsReply)
    out = prepare_frame(frame, core.hashing, core.limits, core.hashing.fast_root)  # the worker's path
    assert out[0] == "request" and out[1].__class__.__name__ == "StatsRequest"
    # A smaller configured limit refuses what the default would decode, in both paths, and says so.
    core.limits = LimitsConfig(max_frame_bytes=1 * MIB)
    err = decode_reply(core.handle(_padded_stats(2 * MIB)))
    assert isinstance(err, ErrorReply) and err.code == "too_large" and f"exceeds {MIB}" in err.message
    out = prepare_frame(_padded_stats(2 * MIB), core.hashing, core.limits, core.hashing.fast_root)
    assert out[:2] == ("error", "too_large")


def test_every_oversize_frame_gets_too_large_however_large_and_is_counted() -> None:
    core = make_core()
    limit = 4096
    with ServiceThread(core, max_frame_bytes=limit) as st, connect_dealer(st.endpoint) as s:
        s.setsockopt(zmq.RCVTIMEO, 10_000)
        sizes = [limit + 1, 4 * limit + 65_537, 64 * limit, 8 * MIB]  # the last ones were cut unanswered
        for k, size in enumerate(sizes):
            payload = (_padded_stats(size) if k % 2 else msgspec.msgpack.encode({"type": "stats", "pad": "x" * size}))
            s.send_multipart([b"", payload])
            reply = s.recv_multipart()[-1]
            err = decode_reply(reply)
            assert isinstance(err, ErrorReply) and err.code == "too_large", (size, err)
            assert reply[:1] == (b"{" if k % 2 else reply[:1])  # a JSON frame is answered in JSON
            assert f"frame of {len(payload)} bytes exceeds {limit}" in err.message
        assert st.service is not None and st.service.counters["too_large"] == len(sizes)
        assert core.counters["stats"] == 0  # none was decoded
        reply = decode_reply((s.send_multipart([b"", encode(route_req("ok", token_ids=PROMPT[:64]))]),
                              s.recv_multipart())[1][-1])
        assert isinstance(reply, RouteDecision)


def test_a_frame_over_the_transport_cap_is_cut_and_the_service_goes_on() -> None:
    core = make_core()
    core.limits = LimitsConfig(max_frame_bytes=4096, max_transport_bytes=64 * 1024)
    with ServiceThread(core) as st:
        with connect_dealer(st.endpoint) as s:
            s.setsockopt(zmq.RCVTIMEO, 10_000)
            s.send_multipart([b"", _padded_stats(32 * 1024)])  # under the cap: answered
            err = decode_reply(s.recv_multipart()[-1])
            assert isinstance(err, ErrorReply) and err.code == "too_large"
        with connect_dealer(st.endpoint) as s:
            s.setsockopt(zmq.RCVTIMEO, 1_000)
            s.send_multipart([b"", _padded_stats(1 * MIB)])  # over it: ZMQ drops the connection unread
            try:
                s.recv_multipart()
                raise AssertionError("a frame over the transport cap was answered")
            except zmq.Again:
                pass
        with connect_dealer(st.endpoint) as s:
            s.setsockopt(zmq.RCVTIMEO, 10_000)
            s.send_multipart([b"", encode(route_req("after", token_ids=PROMPT[:64]))])
            assert isinstance(decode_reply(s.recv_multipart()[-1]), RouteDecision)
        assert st.service is not None and st.service.counters["too_large"] == 1
