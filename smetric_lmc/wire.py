"""Wire schema of the `route` service (version 1).

Every message is a msgpack map or a JSON object whose ``type`` field names the message. A gateway
in any language can speak it: the controller detects the encoding of each request from its first
byte (``{`` is JSON, anything else msgpack) and answers in kind.

Requests (gateway -> controller): ``route``, ``prefilled`` (optional), ``done``, ``stats``,
``health``, ``instances``.
Replies (controller -> gateway): ``decision``, ``prefilled_ack``, ``done_ack``, ``stats_reply``,
``health_reply``, ``instances_reply``, ``error``.

The prompt of a ``route`` may be given as token ids (the controller hashes them) or as precomputed
prefix-chained block hashes, one chain per hash scheme (see ``smetric_lmc.hashing``), so that only
hashes cross the wire. Unknown fields are rejected so that typos fail loudly; new optional fields
only ever get added with a default, and an incompatible change bumps ``WIRE_VERSION``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

import msgspec

WIRE_VERSION = 1

#: Default size cap of a frame, checked before decoding (a 1M-token prompt of token ids is ~5 MB);
#: the controller passes its configured ``limits.max_frame_bytes`` instead.
MAX_FRAME_BYTES = 16 * 1024 * 1024


class Reason(str, Enum):
    """Why the policy chose the instance it chose."""

    FIRST_TURN = "first_turn"  # a session's first request: balance
    STICKY = "sticky"  # follow-up routed to where its KV lives
    OVERLOADED = "overloaded_fallback"  # the KV holder is above OVERLOAD x mean load: balance
    EVICTED = "evicted_fallback"  # best local hit below HIT_RATIO x est_hit: balance
    NO_INSTANCES = "no_instances"  # nothing routable
    SCORED = "scored"  # a baseline's argmin of its score
    ROUND_ROBIN = "round_robin"
    CACHE_FIRST = "cache_first"


class TurnSource(str, Enum):
    """Where a decision's turn came from; every value but ``request`` is a route that had no turn."""

    REQUEST = "request"  # the route request carried it
    EST_HIT = "est_hit"  # no turn, est_hit_tokens > 0: a follow-up
    INDEX_FOLLOW_UP = "index_follow_up"  # no turn: the longest local hit runs past the shared prefix
    INDEX_FIRST_TURN = "index_first_turn"  # no turn: nothing beyond the shared prefix is cached


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=False):
    pass


class HashChain(msgspec.Struct, forbid_unknown_fields=True):
    """A prompt's prefix-chained block hashes in one hash scheme."""

    scheme: str  # "fast" | "lmcache_builtin" | "lmcache_sha256_cbor"
    block_size: int
    hashes: list[int]
    # The chain's root (fast_root or LMCache NONE_HASH) the sender hashed from; when given, the
    # controller refuses the route ("hash_mismatch") unless it is the index's own root.
    root: int | None = None


class RouteRequest(_Msg, tag="route"):
    request_id: str
    model: str = ""
    token_ids: list[int] | None = None
    hashes: list[HashChain] = []
    prompt_tokens: int | None = None  # defaults to len(token_ids)
    turn: int | None = None  # explicit turn; None = unknown: inferred (see TurnSource, README "Unknown turns")
    est_hit_tokens: int | None = None
    version: int = WIRE_VERSION


class DoneReport(_Msg, tag="done"):
    request_id: str
    instance_id: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # engine-reported prompt_tokens_details.cached_tokens
    ttft_s: float | None = None
    e2e_s: float | None = None
    ok: bool = True
    # Why the attempt failed, when the engine is to blame: "connect" (no connection: the controller
    # takes the instance out of routing at once) or "cut" (the engine dropped a started answer).
    error: Literal["connect", "cut"] | None = None
    version: int = WIRE_VERSION


class PrefilledReport(_Msg, tag="prefilled"):
    """The request's first output token arrived: its prompt no longer waits for prefill. Optional;
    without it the controller infers prefill progress from the engines' /metrics."""

    request_id: str
    instance_id: str | None = None
    version: int = WIRE_VERSION


class StatsRequest(_Msg, tag="stats"):
    version: int = WIRE_VERSION


class HealthRequest(_Msg, tag="health"):
    version: int = WIRE_VERSION


class InstancesRequest(_Msg, tag="instances"):
    version: int = WIRE_VERSION


class RouteDecision(_Msg, tag="decision"):
    """Where a request goes and why: the router's result, the simulator's, and the wire reply."""

    request_id: str
    instance_id: str | None
    endpoint: str | None
    reason: Reason
    policy: str
    local_hit_tokens: int = 0  # on the chosen instance
    global_hit_tokens: int = 0
    est_hit_tokens: int = 0
    turn: int = 0
    prompt_tokens: int = 0
    load: float = 0.0  # the chosen instance's load before this request
    best_local_hit_tokens: int = 0  # anywhere: the cache-loss funnel compares it with local_hit_tokens
    turn_source: TurnSource = TurnSource.REQUEST
    index_ready: bool = True  # False: no KV data indexed yet, so the decision was a load-balance pick
    version: int = WIRE_VERSION


class DoneAck(_Msg, tag="done_ack"):
    request_id: str
    released: bool
    version: int = WIRE_VERSION


class PrefilledAck(_Msg, tag="prefilled_ack"):
    request_id: str
    applied: bool  # False: not in flight (already done, unknown) or already prefilled
    version: int = WIRE_VERSION


class InstanceInfo(msgspec.Struct):
    id: str
    endpoint: str
    role: str
    routable: bool
    in_flight: int
    unprefilled_tokens: int
    indexed_blocks: int


class InstancesReply(_Msg, tag="instances_reply"):
    instances: list[InstanceInfo]
    version: int = WIRE_VERSION


class HealthReply(_Msg, tag="health_reply"):
    ok: bool
    routable_instances: int
    index_ready: bool
    global_store: str
    version: int = WIRE_VERSION


class StatsReply(_Msg, tag="stats_reply"):
    stats: dict[str, Any]
    version: int = WIRE_VERSION


class ErrorReply(_Msg, tag="error"):
    code: str  # "bad_request" | "unsupported_version" | "too_large" | "hash_mismatch" | "internal"
    message: str
    request_id: str | None = None
    version: int = WIRE_VERSION


Request = RouteRequest | DoneReport | PrefilledReport | StatsRequest | HealthRequest | InstancesRequest
Reply = RouteDecision | DoneAck | PrefilledAck | StatsReply | HealthReply | InstancesReply | ErrorReply


class WireError(ValueError):
    """A frame that is not a valid message; ``code`` goes into the ErrorReply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


_mp_enc = msgspec.msgpack.Encoder()
_js_enc = msgspec.json.Encoder()
_mp_req = msgspec.msgpack.Decoder(Request)
_js_req = msgspec.json.Decoder(Request)
_mp_rep = msgspec.msgpack.Decoder(Reply)
_js_rep = msgspec.json.Decoder(Reply)


def is_json(frame: bytes) -> bool:
    """JSON objects start with ``{`` (possibly after whitespace); a msgpack map never does."""
    return frame[:1] in (b"{", b" ", b"\n", b"\t", b"\r")


def encode(msg: msgspec.Struct, *, json: bool = False) -> bytes:
    return _js_enc.encode(msg) if json else _mp_enc.encode(msg)


def _decode(frame: bytes, mp: msgspec.msgpack.Decoder, js: msgspec.json.Decoder, max_bytes: int) -> Any:
    if len(frame) > max_bytes:
        raise WireError("too_large", f"frame of {len(frame)} bytes exceeds {max_bytes}")
    try:
        msg = js.decode(frame) if is_json(frame) else mp.decode(frame)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass: both are the peer's fault
        raise WireError("bad_request", str(exc)) from None
    if msg.version != WIRE_VERSION:
        raise WireError("unsupported_version", f"wire version {msg.version}; this controller speaks {WIRE_VERSION}")
    return msg


def decode_request(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Request:
    """Decode a gateway's request (``too_large`` past ``max_bytes``, before decoding); raises
    WireError with a reason fit for an ErrorReply."""
    return _decode(frame, _mp_req, _js_req, max_bytes)


def decode_reply(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Reply:
    return _decode(frame, _mp_rep, _js_rep, max_bytes)
