"""Schema round trips in both encodings and rejection of bad frames."""

import msgspec
import pytest

from smetric_lmc import wire
from smetric_lmc.wire import (
    DoneReport,
    ErrorReply,
    HashChain,
    Reason,
    RouteDecision,
    RouteRequest,
    WireError,
    decode_reply,
    decode_request,
    encode,
)

REQUESTS = [
    RouteRequest("r1", model="m", token_ids=[1, 2, 3], turn=2, est_hit_tokens=64),
    RouteRequest("r2", hashes=[HashChain("fast", 16, [2**64 - 1, 5]), HashChain("lmcache_builtin", 256, [-(2**63)])],
                 prompt_tokens=40000),
    DoneReport("r1", instance_id="a", prompt_tokens=10, output_tokens=3, cached_tokens=0, ttft_s=0.1, e2e_s=0.5),
    wire.StatsRequest(),
    wire.HealthRequest(),
    wire.InstancesRequest(),
]
REPLIES = [
    RouteDecision("r1", "a", "http://x", Reason.STICKY, "smetric", 64, 0, 64, 2, 100, 1.0),
    RouteDecision("r9", None, None, Reason.NO_INSTANCES, "smetric"),
    wire.DoneAck("r1", True),
    wire.StatsReply({"a": 1}),
    wire.HealthReply(True, 2, True, "none"),
    wire.InstancesReply([wire.InstanceInfo("a", "http://x", "both", True, 1, 10, 5)]),
    ErrorReply("bad_request", "nope", "r1"),
]


@pytest.mark.parametrize("json", [False, True])
@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg, json):
    frame = encode(msg, json=json)
    assert wire.is_json(frame) == json
    assert decode_request(frame) == msg


@pytest.mark.parametrize("json", [False, True])
@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(msg, json):
    assert decode_reply(encode(msg, json=json)) == msg


def test_tag_is_the_type_field():
    assert msgspec.json.decode(encode(RouteRequest("x"), json=True))["type"] == "route"
    assert msgspec.msgpack.decode(encode(REPLIES[0]))["reason"] == "sticky"


def test_a_gateway_in_another_language_can_send_plain_json():
    frame = b'{"type": "route", "request_id": "q", "token_ids": [1, 2], "turn": 1}'
    msg = decode_request(frame)
    assert isinstance(msg, RouteRequest) and msg.turn == 1 and msg.token_ids == [1, 2]


@pytest.mark.parametrize(
    "frame, code",
    [
        (b"\xc1\xff garbage", "bad_request"),
        (b'{"type": "route"}', "bad_request"),  # missing request_id
        (b'{"type": "route", "request_id": 5}', "bad_request"),  # wrong type
        (b'{"type": "launch_missiles", "request_id": "x"}', "bad_request"),
        (b'{"type": "route", "request_id": "x", "bogus": 1}', "bad_request"),
        (b'{"type": "route", "request_id": "x", "version": 99}', "unsupported_version"),
        (b"{" + b" " * wire.MAX_FRAME_BYTES, "too_large"),
    ],
)
def test_bad_frames_raise_wire_errors(frame, code):
    with pytest.raises(WireError) as exc:
        decode_request(frame)
    assert exc.value.code == code
