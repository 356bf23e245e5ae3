"""LMCache 0.5.x controller wire protocol (worker <-> controller), as msgspec structs.

Every message is a msgpack map (or a JSON object) whose first key is ``type`` = the class name,
followed by every field in declaration order (defaults are written, not omitted). Field names,
order and defaults mirror LMCache's ``lmcache.v1.cache_controller.message`` so that the bytes we
encode equal the bytes LMCache's own controller sends, and LMCache's workers decode them with
their own classes.

Sockets (controller side): PULL for fire-and-forget worker messages (one message per frame, a
multipart message may carry several), ROUTER for request/reply (``[identity, b"", payload]``),
and an optional dedicated heartbeat ROUTER advertised in ``RegisterRetMsg.extra_config``.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import msgspec

__all__ = [
    "AnyMsg",
    "BatchedKVOperationMsg",
    "BatchedP2PLookupMsg",
    "BatchedP2PLookupRetMsg",
    "DeRegisterMsg",
    "ErrorMsg",
    "FullSyncBatchMsg",
    "FullSyncCommand",
    "FullSyncEndMsg",
    "FullSyncStartMsg",
    "FullSyncStartRetMsg",
    "FullSyncStatusMsg",
    "FullSyncStatusRetMsg",
    "HeartbeatCommand",
    "HeartbeatMsg",
    "HeartbeatRetMsg",
    "KVAdmitMsg",
    "KVEvictMsg",
    "KVOpEvent",
    "LMCACHE_MESSAGE_MODULE",
    "LookupMsg",
    "LookupRetMsg",
    "ProtocolError",
    "RegisterMsg",
    "RegisterRetMsg",
    "ReplyMsg",
    "WORKER_PUSH_TYPES",
    "WORKER_REQ_TYPES",
    "WorkerPushMsg",
    "WorkerReqMsg",
    "decode",
    "encode",
    "encode_json",
    "unknown_type_error",
]

# LMCache names message classes by their module in error texts; peers may parse those.
LMCACHE_MESSAGE_MODULE = "lmcache.v1.cache_controller.message"


class _Msg(msgspec.Struct, tag=True):
    """Base of every message: tag field ``type``, tag value = class name."""


# ---- worker -> controller, request/reply (ROUTER) ----


class RegisterMsg(_Msg):
    instance_id: str
    worker_id: int
    ip: str
    port: int
    # Only set when the worker serves P2P transfers.
    peer_init_url: str | None


class HeartbeatMsg(_Msg):
    # Carries the registration fields so the controller can re-register a worker it forgot.
    instance_id: str
    worker_id: int
    ip: str
    port: int
    peer_init_url: str | None


class BatchedP2PLookupMsg(_Msg):
    hashes: list[int]
    instance_id: str
    worker_id: int


class FullSyncStartMsg(_Msg):
    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    total_keys: int
    batch_count: int


class FullSyncStatusMsg(_Msg):
    instance_id: str
    worker_id: int
    sync_id: str


# ---- worker -> controller, fire-and-forget (PULL) ----


class DeRegisterMsg(_Msg):
    instance_id: str
    worker_id: int
    ip: str
    port: int


OpType = Literal["admit", "evict"]


class KVOpEvent(msgspec.Struct):
    """One admit/evict inside a batch: an untagged map."""

    op_type: OpType
    key: int
    seq_num: int


class BatchedKVOperationMsg(_Msg):
    instance_id: str
    worker_id: int
    location: str
    operations: list[KVOpEvent]


class KVAdmitMsg(_Msg):
    """Single-op form; still defined by LMCache 0.5.6, no longer sent by its workers."""

    instance_id: str
    worker_id: int
    key: int
    location: str
    seq_num: int = 0


class KVEvictMsg(_Msg):
    instance_id: str
    worker_id: int
    key: int
    location: str
    seq_num: int = 0


class FullSyncBatchMsg(_Msg):
    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    batch_id: int
    keys: list[int]


class FullSyncEndMsg(_Msg):
    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    actual_total_keys: int


# ---- controller -> worker replies ----


class HeartbeatCommand(msgspec.Struct, tag_field="command_type", tag=True):
    """Command piggy-backed on a heartbeat reply; tagged by ``command_type``."""

    reason: str | None = None
    args: dict[str, Any] | None = None


class FullSyncCommand(HeartbeatCommand, tag="full_sync"):
    """Asks the worker to resend its whole hot-cache key set (FullSyncStart/Batch/End)."""


class RegisterRetMsg(_Msg):
    extra_config: dict[str, str] = msgspec.field(default_factory=dict)


class HeartbeatRetMsg(_Msg):
    commands: list[FullSyncCommand | HeartbeatCommand] = msgspec.field(default_factory=list)


class BatchedP2PLookupRetMsg(_Msg):
    # (instance_id, location, num_hit_chunks, peer_init_url)
    layout_info: list[tuple[str, str, int, str]]


class FullSyncStartRetMsg(_Msg):
    sync_id: str
    accepted: bool
    error_msg: str | None = None


class FullSyncStatusRetMsg(_Msg):
    sync_id: str
    is_complete: bool
    global_progress: float
    can_exit_freeze: bool
    missing_batches: list[int] = msgspec.field(default_factory=list)


class ErrorMsg(_Msg):
    error: str


# ---- orchestration (HTTP on LMCache's controller; kept for reference tooling) ----


class LookupMsg(_Msg):
    event_id: str
    tokens: list[int]


class LookupRetMsg(_Msg):
    event_id: str
    layout_info: dict[str, tuple[str, int]]


WorkerReqMsg = RegisterMsg | HeartbeatMsg | BatchedP2PLookupMsg | FullSyncStartMsg | FullSyncStatusMsg
WorkerPushMsg = (
    BatchedKVOperationMsg | DeRegisterMsg | FullSyncBatchMsg | FullSyncEndMsg | KVAdmitMsg | KVEvictMsg
)
ReplyMsg = (
    RegisterRetMsg | HeartbeatRetMsg | BatchedP2PLookupRetMsg | FullSyncStartRetMsg
    | FullSyncStatusRetMsg | ErrorMsg
)
AnyMsg = WorkerReqMsg | WorkerPushMsg | ReplyMsg | LookupMsg | LookupRetMsg

WORKER_REQ_TYPES: tuple[type, ...] = (
    RegisterMsg,
    HeartbeatMsg,
    BatchedP2PLookupMsg,
    FullSyncStartMsg,
    FullSyncStatusMsg,
)
WORKER_PUSH_TYPES: tuple[type, ...] = (
    BatchedKVOperationMsg,
    DeRegisterMsg,
    FullSyncBatchMsg,
    FullSyncEndMsg,
    KVAdmitMsg,
    KVEvictMsg,
)

# Other classes in LMCache's message union (control / orchestration). A peer sending one of these
# gets LMCache's "Unknown message type" error rather than a tag-validation error, as upstream does.
_OTHER_LMCACHE_CLASSES = frozenset(
    {
        "ClearWorkerMsg", "ClearWorkerRetMsg", "PinWorkerMsg", "PinWorkerRetMsg", "CompressWorkerMsg",
        "CompressWorkerRetMsg", "DecompressWorkerMsg", "DecompressWorkerRetMsg", "MoveWorkerMsg",
        "MoveWorkerRetMsg", "HealthWorkerMsg", "HealthWorkerRetMsg", "CheckFinishWorkerMsg",
        "CheckFinishWorkerRetMsg", "ClearMsg", "ClearRetMsg", "PinMsg", "PinRetMsg", "CompressMsg",
        "CompressRetMsg", "DecompressMsg", "DecompressRetMsg", "MoveMsg", "MoveRetMsg", "HealthMsg",
        "HealthRetMsg", "CheckFinishMsg", "CheckFinishRetMsg", "QueryInstMsg", "QueryInstRetMsg",
        "QueryWorkerInfoMsg", "QueryWorkerInfoRetMsg",
    }
)


class ProtocolError(ValueError):
    """A frame that is not a valid LMCache message. ``str()`` is the text for ``ErrorMsg``."""

    def __init__(self, error: str, *, lmcache_type: str | None = None) -> None:
        super().__init__(error)
        # Set when the frame named a real LMCache class this controller does not model.
        self.lmcache_type = lmcache_type


_mp_decoder = msgspec.msgpack.Decoder(AnyMsg)
_json_decoder = msgspec.json.Decoder(AnyMsg)
_mp_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()


def _is_json(frame: bytes) -> bool:
    # Same rule as LMCache's controller: a JSON object is the only payload starting with '{'
    # (0x7b is a msgpack positive fixint, never a valid message on its own).
    return frame[:1] == b"{"


def decode(frame: bytes | bytearray | memoryview) -> AnyMsg:
    """Decode one frame (msgpack, or JSON if it starts with ``{``) into a typed message.

    Raises ProtocolError (never anything else) for garbage, unknown tags, wrong field types or
    nesting deeper than the interpreter's recursion limit. A rejected frame is not decoded again:
    the unknown tag is read from msgspec's own error.
    """
    data = bytes(frame)
    try:
        return _json_decoder.decode(data) if _is_json(data) else _mp_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        first_error = str(exc)
    except RecursionError:
        raise ProtocolError("undecodable frame: nesting too deep") from None
    except Exception as exc:  # msgspec never raises others today; a peer must not crash us anyway
        raise ProtocolError(f"undecodable frame: {exc!r}") from None
    tag = _unknown_tag(first_error)
    if tag in _OTHER_LMCACHE_CLASSES:
        raise ProtocolError(unknown_type_error(tag), lmcache_type=tag)
    raise ProtocolError(first_error)


class Bulk(NamedTuple):
    """The long list of a ``BatchedKVOperationMsg`` (``admits``, ``keys``, ``seqs``) or a
    ``FullSyncBatchMsg`` (``keys``; ``admits`` and ``seqs`` None), as columns that are applied a
    slice at a time; numpy arrays when they come back from the frame worker (one copy to unpickle,
    not a Python object per key), lists otherwise."""

    admits: Any
    keys: Any
    seqs: Any


def split_bulk(msg: AnyMsg, compact: bool = False) -> tuple[AnyMsg, Bulk | None]:
    """``msg`` without its operations / keys, and those as a :class:`Bulk` (None for other messages)."""
    if isinstance(msg, BatchedKVOperationMsg):
        ops = msg.operations
        bulk = Bulk([op.op_type == "admit" for op in ops], [op.key for op in ops], [op.seq_num for op in ops])
        msg = msgspec.structs.replace(msg, operations=[])
    elif isinstance(msg, FullSyncBatchMsg):
        bulk = Bulk(None, msg.keys, None)
        msg = msgspec.structs.replace(msg, keys=[])
    else:
        return msg, None
    if compact:
        bulk = Bulk(*(None if col is None else _column(col) for col in bulk))
    return msg, bulk


def _column(values: list[Any]) -> Any:
    import numpy as np

    if values and isinstance(values[0], bool):
        return np.array(values, dtype=np.bool_)
    for dtype in (np.int64, np.uint64):
        try:
            return np.array(values, dtype=dtype)
        except OverflowError:
            pass
    return values  # signed and beyond 2^63 at once: stays a list


def decode_split(frame: bytes) -> tuple[AnyMsg, Bulk | None] | str:
    """The frame worker's part (controller/offload.py): :func:`decode` then :func:`split_bulk`
    into numpy columns; the ProtocolError's text when the frame is refused."""
    try:
        return split_bulk(decode(frame), compact=True)
    except ProtocolError as exc:
        return str(exc)


def _unknown_tag(error: str) -> str | None:
    # msgspec: "Invalid value 'ClearMsg' - at `$.type`"
    head, sep, _ = error.rpartition("' - at `$.type`")
    if not sep or not head.startswith("Invalid value '"):
        return None
    return head[len("Invalid value '"):]


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack encoding, byte-identical to LMCache's ``msgspec.msgpack.encode`` of its class."""
    return _mp_encoder.encode(msg)


def encode_json(msg: msgspec.Struct) -> bytes:
    """JSON encoding (same field names), as LMCache's controller accepts on its sockets."""
    return _json_encoder.encode(msg)


def unknown_type_error(msg_or_name: msgspec.Struct | str) -> str:
    """LMCache's error text for a well-formed message of the wrong kind for a socket."""
    name = msg_or_name if isinstance(msg_or_name, str) else type(msg_or_name).__name__
    return f"Unknown message type: <class '{LMCACHE_MESSAGE_MODULE}.{name}'>"
