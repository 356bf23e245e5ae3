"""vLLM KV cache events on the wire: the structs, their decoders, and cheap peeks.

Wire (vLLM >= 0.9, verified against 0.32): a multipart message
``[topic, seq (u64 big-endian, from 0 per engine process), msgpack payload]`` where the
payload is ``[ts, [events...], data_parallel_rank]``. Events are msgpack maps tagged by
``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); older releases
encoded them as arrays ``[type, field, ...]``, which are accepted too. Block hashes are
u64 ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or raw digests, which
are folded to the same u64 vLLM would have sent (last 8 bytes, big-endian).

Replay: a DEALER sends ``[b"", start_seq u64 BE]`` to the engine's ROUTER and receives
``[b"", topic, seq, payload]`` per buffered batch, then ``[b"", b"", 0xff..ff, b""]``.

The planning of decoded batches into index operations is ``vllm_plan``; the subscriber that
receives them is ``vllm_events``.
"""


from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints cannot exceed 2^64-1
# Vocabulary ids; the index keeps them as u32. An event carrying anything else is dropped alone.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
END_SEQ = (1 << 64) - 1
MEDIUM_GPU = "GPU"


# ---------------------------------------------------------------------------
# Wire structs. Field order matters only for the legacy array form, so it follows vLLM's
# class definitions; fields we never read (locality, ownership, session_id, ...) are left
# undeclared and ignored by the decoder.


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[U64]
    parent_block_hash: U64 | None = None
    token_ids: list[TokenId] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[U64]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class DroppedEvent(msgspec.Struct, tag="__dropped__", omit_defaults=True, gc=False):
    """Stands in for an event that could not be used, so the rest of its batch survives.

    ``reason`` is ``"unknown"`` (a type this module does not know) or ``"malformed"``.
    """

    kind: str = ""
    reason: str = "unknown"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | DroppedEvent


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _ArrayBlockStored(BlockStored, tag="BlockStored", array_like=True):
    pass


class _ArrayBlockRemoved(BlockRemoved, tag="BlockRemoved", array_like=True):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, tag="AllBlocksCleared", array_like=True):
    pass


class _ArrayEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


class _RawEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_MAP_DECODER = msgspec.msgpack.Decoder(EventBatch)
_ARRAY_DECODER = msgspec.msgpack.Decoder(_ArrayEventBatch)
_RAW_DECODER = msgspec.msgpack.Decoder(_RawEventBatch)
_ANY_DECODER = msgspec.msgpack.Decoder()
_KNOWN: dict[str, type[msgspec.Struct]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


class PayloadError(ValueError):
    """The payload is not a vLLM event batch at all (nothing in it can be used)."""


def _fold_hash(value: Any) -> Any:
    # vLLM's maybe_convert_block_hash keeps the low 64 bits of the digest, big-endian.
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value[-8:], "big")
    return value


def _decode_one(raw: msgspec.Raw) -> KVEvent:
    try:
        obj = _ANY_DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return DroppedEvent(reason="malformed")
    if isinstance(obj, list) and obj and isinstance(obj[0], str):
        cls = _KNOWN.get(obj[0])
        if cls is None:
            return DroppedEvent(kind=obj[0][:64], reason="unknown")
        obj = dict(zip(cls.__struct_fields__, obj[1:], strict=False))
        obj["type"] = cls.__name__
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        return DroppedEvent(reason="malformed")
    kind = obj["type"]
    cls = _KNOWN.get(kind)
    if cls is None:
        return DroppedEvent(kind=kind[:64], reason="unknown")
    hashes = obj.get("block_hashes")
    if isinstance(hashes, list):
        obj["block_hashes"] = [_fold_hash(h) for h in hashes]
    if "parent_block_hash" in obj:
        obj["parent_block_hash"] = _fold_hash(obj["parent_block_hash"])
    try:
        return msgspec.convert(obj, cls)
    except (msgspec.ValidationError, TypeError, RecursionError):
        return DroppedEvent(kind=kind, reason="malformed")


def decode_payload(payload: bytes) -> EventBatch:
    """Decode one vLLM event-batch payload.

    Fast path: one typed decode of the whole batch. If any event is of an unknown type,
    in the legacy array form, carries digest hashes or is malformed, the batch is decoded
    event by event and each unusable event becomes a ``DroppedEvent``. Each pass is linear in
    the payload, and nesting beyond the interpreter's recursion limit is malformed, not a crash.
    Raises ``PayloadError`` when the envelope itself is not a batch.
    """
    try:
        return _decode_batch(payload)
    except RecursionError:
        raise PayloadError("nesting too deep") from None


def _decode_batch(payload: bytes) -> EventBatch:
    try:
        return _MAP_DECODER.decode(payload)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as exc:
        raise PayloadError(str(exc)) from exc
    try:
        arr = _ARRAY_DECODER.decode(payload)
        return EventBatch(arr.ts, list(arr.events), arr.data_parallel_rank)
    except msgspec.ValidationError:
        pass
    try:
        raw = _RAW_DECODER.decode(payload)
    except msgspec.MsgspecError as exc:
        raise PayloadError(str(exc)) from exc
    return EventBatch(raw.ts, [_decode_one(r) for r in raw.events], raw.data_parallel_rank)


_SCALAR_SIZES = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}


def peek_event_count(payload: bytes) -> int | None:
    """The length of a ``[ts, events, rank]`` payload's events array, read from the msgpack
    headers without decoding anything; None when the payload does not start that way."""
    if len(payload) < 3 or payload[0] not in (0x92, 0x93):
        return None
    b = payload[1]
    i = 2 if (b < 0x80 or b >= 0xE0) else 1 + _SCALAR_SIZES.get(b, len(payload))
    if i >= len(payload):
        return None
    h = payload[i]
    if 0x90 <= h <= 0x9F:
        return h & 0x0F
    if h in (0xDC, 0xDD):
        width = 2 if h == 0xDC else 4
        if i + width < len(payload):
            return int.from_bytes(payload[i + 1 : i + 1 + width], "big")
    return None


