"""Local-tier ingest: vLLM KV cache events (ZMQ PUB + ROUTER replay) into the index.

Wire (vLLM >= 0.9, verified against 0.32): a multipart message
``[topic, seq (u64 big-endian, from 0 per engine process), msgpack payload]`` where the
payload is ``[ts, [events...], data_parallel_rank]``. Events are msgpack maps tagged by
``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); older releases
encoded them as arrays ``[type, field, ...]``, which are accepted too. Block hashes are
u64 ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or raw digests, which
are folded to the same u64 vLLM would have sent (last 8 bytes, big-endian).

Replay: a DEALER sends ``[b"", start_seq u64 BE]`` to the engine's ROUTER and receives
``[b"", topic, seq, payload]`` per buffered batch, then ``[b"", b"", 0xff..ff, b""]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, Protocol

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from smetric_lmc.controller.tasks import cancel_and_wait

if TYPE_CHECKING:
    from smetric_lmc.controller.offload import OffloadWorker

log = logging.getLogger(__name__)

U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints cannot exceed 2^64-1
# Vocabulary ids; the index keeps them as u32. An event carrying anything else is dropped alone.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
END_SEQ = (1 << 64) - 1
#: The subscriber yields to the other tasks after this many batches, payload bytes or seconds,
#: whichever comes first (a count alone let 64 MB-sized batches hold the loop for 100 ms).
YIELD_AFTER_BATCHES = 64
YIELD_AFTER_BYTES = 1 << 20
YIELD_AFTER_S = 0.002
#: Payloads larger than this are decoded and planned in the frame worker (``worker``): ~50 ms of
#: CPU per 4.5 MB here, which on the loop would stall every client.
OFFLOAD_BYTES = 256 << 10
#: Stores and removals larger than this are applied in slices, with loop turns between them.
SLICE_BLOCKS = 4096
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


# ---------------------------------------------------------------------------
# Applying batches to the index.


class GpuBlockSink(Protocol):
    """What the index offers for the GPU (vLLM prefix cache) part of the local tier."""

    def gpu_stored(
        self,
        instance_id: str,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        lora_id: int | None = None,
    ) -> int: ...

    def gpu_removed(self, instance_id: str, block_hashes: Sequence[int]) -> int: ...

    def gpu_cleared(self, instance_id: str) -> None: ...

    def mark_stale(self, instance_id: str) -> None: ...


def _untracked(ev: BlockStored | BlockRemoved, group_idx: int | None) -> str | None:
    """The tally for a block event of another medium or KV cache group; None if it is tracked."""
    if ev.medium is not None and ev.medium != MEDIUM_GPU:
        return "non_gpu"
    if group_idx is not None and ev.group_idx is not None and ev.group_idx != group_idx:
        return "other_group"
    return None


#: A plan is the batch's sink calls, in order: ``(STORED, hashes, parent, token_ids, block_size,
#: keys)`` (``keys``: the adapter / extra-key keyword arguments), ``(REMOVED, hashes)`` (a run of
#: consecutive removals, merged) or ``(CLEARED,)``. Planning is pure, so large payloads are
#: planned in the frame worker; applying is the only part that touches the index.
STORED, REMOVED, CLEARED = 0, 1, 2
Op = tuple[Any, ...]


def plan_batch(
    batch: EventBatch, *, group_idx: int | None = 0, max_blocks_per_event: int | None = None
) -> tuple[list[Op], dict[str, int]]:
    """The sink calls that apply ``batch`` (see :func:`apply_batch`) and its per-kind tallies."""
    n_stored = n_removed = n_cleared = blocks_stored = blocks_removed = 0
    unknown = malformed = 0
    untracked = {"non_gpu": 0, "other_group": 0}
    ops: list[Op] = []
    # vLLM sends one BlockRemoved per evicted block; consecutive removals commute, so they
    # are merged into one sink call (flushed before anything that must stay ordered).
    pending: list[int] = []
    for ev in batch.events:
        if isinstance(ev, BlockRemoved):  # half of a busy stream: the tracked case inlined
            n_removed += 1
            if (ev.medium is None or ev.medium == MEDIUM_GPU) and (
                group_idx is None or ev.group_idx is None or ev.group_idx == group_idx
            ):
                pending.extend(ev.block_hashes)
            else:
                untracked[_untracked(ev, group_idx)] += 1  # type: ignore[index]
            continue
        if pending:
            blocks_removed += len(pending)
            ops.append((REMOVED, pending))
            pending = []
        if isinstance(ev, BlockStored):
            n_stored += 1
            skip = _untracked(ev, group_idx)
            if skip is not None:
                untracked[skip] += 1
            elif len(ev.token_ids) != len(ev.block_hashes) * ev.block_size or (
                max_blocks_per_event is not None and len(ev.block_hashes) > max_blocks_per_event
            ):
                # vLLM reports full blocks only; anything else would corrupt a re-hash.
                malformed += 1
            elif ev.block_hashes:
                blocks_stored += len(ev.block_hashes)
                # Adapter and extra keys set the block's identity (the index folds them into its chain).
                keyed = ev.lora_name is not None or ev.lora_id is not None or any(ev.extra_keys or ())
                keys = {"lora_name": ev.lora_name, "extra_keys": ev.extra_keys, "lora_id": ev.lora_id} if keyed else {}
                ops.append((STORED, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, keys))
        elif isinstance(ev, AllBlocksCleared):
            n_cleared += 1
            ops.append((CLEARED,))
        elif isinstance(ev, DroppedEvent):
            if ev.reason == "unknown":
                unknown += 1
            else:
                malformed += 1
    if pending:
        blocks_removed += len(pending)
        ops.append((REMOVED, pending))
    counts = {"BlockStored": n_stored, "BlockRemoved": n_removed, "blocks_stored": blocks_stored,
              "blocks_removed": blocks_removed}
    if n_cleared or unknown or malformed or untracked["non_gpu"] or untracked["other_group"]:
        counts.update(AllBlocksCleared=n_cleared, unknown=unknown, malformed=malformed, **untracked)
    return ops, counts


def run_op(op: Op, sink: GpuBlockSink, instance_id: str) -> None:
    kind = op[0]
    if kind == REMOVED:
        sink.gpu_removed(instance_id, op[1])
    elif kind == STORED:
        if op[5]:
            sink.gpu_stored(instance_id, op[1], op[2], op[3], op[4], **op[5])
        else:
            sink.gpu_stored(instance_id, op[1], op[2], op[3], op[4])
    else:
        sink.gpu_cleared(instance_id)


def _as_list(values: Any) -> list[Any]:
    return values.tolist() if isinstance(values, np.ndarray) else values


def cut_op(op: Op, max_blocks: int) -> Sequence[Op]:
    """``op`` as ops of at most ``max_blocks`` blocks each, with plain-int lists (a worker's plan
    carries numpy arrays). A store is cut into a chain: each piece's parent is the last block of
    the piece before it, as if vLLM had reported the blocks in several events."""
    kind = op[0]
    if kind == CLEARED:
        return (op,)
    hashes = op[1]
    if len(hashes) <= max_blocks and not isinstance(hashes, np.ndarray):
        return (op,)
    if kind == REMOVED:
        return [(REMOVED, _as_list(hashes[k : k + max_blocks])) for k in range(0, len(hashes), max_blocks)]
    _, hashes, parent, tokens, bs, keys = op
    extra = keys.get("extra_keys")
    out: list[Op] = []
    for k in range(0, len(hashes), max_blocks):
        piece = _as_list(hashes[k : k + max_blocks])
        part = dict(keys, extra_keys=extra[k : k + max_blocks]) if extra is not None else keys
        out.append((STORED, piece, parent, _as_list(tokens[k * bs : (k + max_blocks) * bs]), bs, part))
        parent = piece[-1]
    return out


def apply_batch(
    batch: EventBatch,
    sink: GpuBlockSink,
    instance_id: str,
    counts: dict[str, int] | None = None,
    *,
    group_idx: int | None = 0,
    max_blocks_per_event: int | None = None,
) -> int:
    """Apply a decoded batch to ``sink`` in order; returns the number of block events applied.

    A ``BlockStored`` of more than ``max_blocks_per_event`` blocks counts as malformed and is
    skipped alone (the index then under-reports, never over-reports).

    Only GPU-medium events (``medium`` "GPU" or absent) are applied. For hybrid models with
    several KV cache groups only ``group_idx`` is tracked (the same block hash appears in
    every group, so one full-attention group is enough; ``None`` applies all groups).
    Per-kind tallies are added to ``counts`` when given: the event type names plus
    ``blocks_stored``, ``blocks_removed``, ``unknown``, ``malformed``, ``non_gpu``,
    ``other_group``.
    """
    ops, tally = plan_batch(batch, group_idx=group_idx, max_blocks_per_event=max_blocks_per_event)
    for op in ops:
        run_op(op, sink, instance_id)
    if counts is not None:
        add_counts(counts, tally)
    return tally.get("blocks_stored", 0) + tally.get("blocks_removed", 0)


def add_counts(counts: dict[str, int], tally: dict[str, int]) -> None:
    for key, value in tally.items():
        if value:
            counts[key] = counts.get(key, 0) + value


class Planned(NamedTuple):
    """A payload made ready to apply: its timestamp, its sink calls and their tallies."""

    ts: float
    ops: list[Op]
    counts: dict[str, int]


def plan_payload(
    payload: bytes, group_idx: int | None, max_events: int, max_blocks_per_event: int | None, compact: bool = False
) -> Planned | str:
    """Decode and plan one payload; a string says why it was refused (``"decode"``: not a batch,
    ``"oversize"``: more than ``max_events`` events). ``compact`` (the worker's answer) turns each
    op's hash and token lists into numpy arrays: they unpickle as one copy, not millions of ints."""
    try:
        batch = decode_payload(payload)
    except PayloadError:
        return "decode"
    if len(batch.events) > max_events:
        return "oversize"
    ops, counts = plan_batch(batch, group_idx=group_idx, max_blocks_per_event=max_blocks_per_event)
    if compact:
        ops = [_compact(op) for op in ops]
    return Planned(batch.ts, ops, counts)


def _compact(op: Op) -> Op:
    if op[0] == REMOVED:
        return (REMOVED, np.array(op[1], dtype=np.uint64))
    if op[0] == STORED:
        _, hashes, parent, tokens, bs, keys = op
        return (STORED, np.array(hashes, dtype=np.uint64), parent, np.array(tokens, dtype=np.uint32), bs, keys)
    return op


# ---------------------------------------------------------------------------
# Subscriber.


def vllm_binds(endpoint: str) -> bool:
    """vLLM's own rule (ZmqEventPublisher._is_bind_endpoint): it binds wildcard, IPv6-any,
    ipc:// and inproc:// endpoints and connects to every other one."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def connectable(endpoint: str) -> str:
    """Turn a bind-style endpoint into one this host can connect to (wildcards -> loopback)."""
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:").replace("[::]", "[::1]")


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    events: dict[str, int] = field(default_factory=dict)
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    unfilled_gaps: int = 0
    restarts: int = 0
    duplicates: int = 0
    decode_errors: int = 0
    oversize_batches: int = 0
    internal_errors: int = 0
    replay_deadlines: int = 0
    bad_frames: int = 0
    offloaded: int = 0  # batches decoded and planned in the frame worker
    large_on_loop: int = 0  # batches over offload_bytes handled on the loop (no worker here)
    worker_failures: int = 0
    other_topic: int = 0
    sink_errors: int = 0
    last_seq: int | None = None
    last_event_time: float | None = None
    lag_s: float | None = None


class VllmEventSubscriber:
    """Follows one vLLM engine's KV event stream and mirrors its GPU prefix cache into a sink.

    ``endpoint`` is the engine's ``kv-events-config`` endpoint string. With ``bind=None``
    the socket role is derived with vLLM's own rule: when vLLM binds (``tcp://*:P``,
    ``tcp://[::]:P``, ``ipc://...``) we connect (a wildcard host becomes loopback; pass
    ``bind=False`` with the engine's address when it runs on another host); when vLLM
    connects (``tcp://host:P``) we bind that address. The replay endpoint is always a ROUTER
    bound by vLLM, so we always connect to it.

    Sequence handling: a gap (or a first message with seq > 0) is filled from the replay
    endpoint; a seq that goes back with a newer timestamp is an engine restart and clears
    the instance; an older timestamp is a duplicate and is skipped. A gap that cannot be
    filled (or a batch the sink failed on) marks the instance's entries stale: the blocks the
    engine stored before the gap are most likely still there, so they stay indexed (and usable)
    until the engine's next events store them again or they age out, rather than declaring
    every session on the instance evicted at once.
    """

    def __init__(
        self,
        endpoint: str,
        instance_id: str,
        sink: GpuBlockSink,
        *,
        topic: str = "kv",
        replay_endpoint: str | None = None,
        bind: bool | None = None,
        group_idx: int | None = 0,
        replay_timeout_s: float = 1.0,
        replay_deadline_s: float = 10.0,
        max_replay_batches: int = 200_000,
        max_message_bytes: int = 64 << 20,
        max_events_per_batch: int = 65_536,
        max_blocks_per_event: int = 65_536,
        worker: OffloadWorker | None = None,
        offload_bytes: int = OFFLOAD_BYTES,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.stats = SubscriberStats()
        self._sink = sink
        self._topic = topic.encode()
        self._group_idx = group_idx
        self._replay_endpoint = connectable(replay_endpoint) if replay_endpoint else None
        self._replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        self._replay_deadline_s = replay_deadline_s
        self._max_replay_batches = max_replay_batches
        self._max_events = max_events_per_batch
        self._max_blocks = max_blocks_per_event
        self._worker = worker
        self._offload_bytes = offload_bytes
        self._last_error_log = 0.0
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._last_ts: float | None = None
        self._closing = False
        self._task: asyncio.Task[Any] | None = None
        self._resume = False
        self.caught_up = asyncio.Event()  # set once a resumed subscriber replayed what it missed
        self.caught_up.set()

        self._bind = (not vllm_binds(endpoint)) if bind is None else bind
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        # Live batches keep queueing while a replay is in flight; vLLM's own PUB HWM is 100k,
        # and anything beyond that shows up as a gap and is replayed.
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        if "[" in endpoint:
            sub.setsockopt(zmq.IPV6, 1)
        try:
            if self._bind:
                sub.bind(endpoint)
            else:
                sub.connect(connectable(endpoint))
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        self._sub = sub
        self.endpoint: str = sub.getsockopt_string(zmq.LAST_ENDPOINT) if self._bind else connectable(endpoint)

    @property
    def binds(self) -> bool:
        return self._bind

    def position(self) -> tuple[int | None, float | None]:
        """(seq, ts) of the last batch applied: what a snapshot records to ``resume`` from."""
        return self.stats.last_seq, self._last_ts

    def resume(self, last_seq: int, last_ts: float | None) -> None:
        """Continue after a snapshot's batch ``last_seq``: ``run`` first replays from
        ``last_seq + 1``, then ``caught_up`` is set. Call before ``run``. What replay cannot bring
        back (no replay endpoint, the engine unreachable) leaves the instance's entries stale; an
        engine that restarted meanwhile shows as a restart at its first live batch (seq back,
        newer timestamp) and is cleared."""
        self.stats.last_seq, self._last_ts = last_seq, last_ts
        self._resume = True
        self.caught_up.clear()

    async def _catch_up(self) -> None:
        self._resume = False
        try:
            last = self.stats.last_seq
            assert last is not None
            if self._replay_endpoint is None:
                log.warning("vLLM events %s: resumed after batch %d without a replay endpoint; entries stale",
                            self.instance_id, last)
                self._mark_stale()
                return
            before = self.stats.replay_failures
            await self._fill(last + 1)
            if self.stats.replay_failures > before:
                self._mark_stale()
            log.info("vLLM events %s: caught up from batch %d to %s", self.instance_id, last, self.stats.last_seq)
        finally:
            self.caught_up.set()

    async def run(self) -> None:
        """Receive and apply batches until ``close()``."""
        self._task = asyncio.current_task()
        n, nbytes, until = 0, 0, time.perf_counter() + YIELD_AFTER_S
        try:
            if self._resume:
                await self._catch_up()
            while not self._closing:
                n += 1
                if n >= YIELD_AFTER_BATCHES or nbytes >= YIELD_AFTER_BYTES or time.perf_counter() >= until:
                    # A queued batch is returned without a trip through the event loop: a
                    # backlog would otherwise hold the loop until it is drained.
                    await asyncio.sleep(0)
                    n, nbytes, until = 0, 0, time.perf_counter() + YIELD_AFTER_S
                try:
                    frames = await self._sub.recv_multipart()
                except zmq.ZMQError:
                    if self._closing:
                        return
                    log.exception("vLLM events %s: receive failed", self.instance_id)
                    await asyncio.sleep(0.1)
                    continue
                nbytes += len(frames[-1]) if frames else 0
                try:
                    parsed = await self._parse(frames)
                    if parsed is not None:
                        await self._on_live(*parsed)
                except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                    raise
                except BaseException:
                    # A bug or a frame nobody foresaw costs that frame, not the stream.
                    self._internal_error()
        except asyncio.CancelledError:
            # close() cancels us mid-receive or mid-replay; that is a normal end.
            if not self._closing:
                raise
        finally:
            self._task = None

    async def close(self) -> None:
        self._closing = True
        await cancel_and_wait(self._task)
        self._sub.close(linger=0)

    def _internal_error(self) -> None:
        self.stats.internal_errors += 1
        now = time.monotonic()
        if now - self._last_error_log > 10.0:  # a hostile peer must not flood the log
            self._last_error_log = now
            log.exception("vLLM events %s: frame handling failed (%d so far)", self.instance_id,
                          self.stats.internal_errors)

    # -- frames ---------------------------------------------------------------

    async def _parse(self, frames: list[bytes]) -> tuple[int, Planned] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.bad_frames += 1
            return None
        topic, seq_bytes, payload = frames
        if topic != self._topic:
            # SUBSCRIBE matches prefixes, so "kv" also lets "kv2" through.
            self.stats.other_topic += 1
            return None
        seq = int.from_bytes(seq_bytes, "big")
        announced = peek_event_count(payload)
        if announced is not None and announced > self._max_events:
            # Refused from its header: decoding it first would cost the whole frame.
            self._oversize(seq, announced)
            return None
        args = (payload, self._group_idx, self._max_events, self._max_blocks)
        if len(payload) <= self._offload_bytes:
            planned = plan_payload(*args)
        elif self._worker is not None and self._worker.start():
            try:
                planned = await self._worker.submit(plan_payload, *args, True)
            except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                # The worker died (or could not take the frame): that batch is lost, and the next
                # one shows the gap, which replay fills. Never retried on the loop: a frame that
                # kills the worker must not kill the controller.
                self.stats.worker_failures += 1
                log.error("vLLM events %s: frame worker failed on batch %d (%s); dropped",
                          self.instance_id, seq, exc)
                return None
            self.stats.offloaded += 1
        else:
            self.stats.large_on_loop += 1  # no worker here (its start failure is logged once)
            planned = plan_payload(*args)
        if planned == "decode":
            self.stats.decode_errors += 1
            return None
        if planned == "oversize":
            # Applying part of it would leave the mirror wrong; skipping it is a gap.
            self._oversize(seq, None)
            return None
        assert isinstance(planned, Planned)
        return seq, planned

    def _oversize(self, seq: int, announced: int | None) -> None:
        self.stats.oversize_batches += 1
        log.warning("vLLM events %s: batch %d %s more than %d events; dropped", self.instance_id, seq,
                    "has" if announced is None else f"announces {announced},", self._max_events)

    # -- ordering -------------------------------------------------------------

    async def _on_live(self, seq: int, batch: Planned) -> None:
        last = self.stats.last_seq
        if last is None:
            if seq > 0:
                await self._fill(0)
        elif seq <= last:
            if self._last_ts is not None and batch.ts <= self._last_ts:
                self.stats.duplicates += 1
                return
            # A new engine process restarts seq at 0 with fresh timestamps.
            log.warning("vLLM events %s: engine restart (seq %d after %d)", self.instance_id, seq, last)
            self.stats.restarts += 1
            self._clear()
            self.stats.last_seq = self._last_ts = None
            if seq > 0:
                await self._fill(0)
        elif seq > last + 1:
            self.stats.gaps += 1
            await self._fill(last + 1)
        await self._apply_in_order(seq, batch)

    async def _apply_in_order(self, seq: int, batch: Planned) -> None:
        last = self.stats.last_seq
        expected = 0 if last is None else last + 1
        if seq < expected:
            self.stats.duplicates += 1
            return
        if seq > expected:
            self.stats.unfilled_gaps += 1
            log.warning(
                "vLLM events %s: batches %d..%d lost; marking the instance's entries stale",
                self.instance_id,
                expected,
                seq - 1,
            )
            self._mark_stale()
        try:
            await self._run(batch.ops)
            add_counts(self.stats.events, batch.counts)
        except Exception:
            # The sink is our own index; a failure there must not kill ingest, but what it
            # holds for this instance is no longer certain.
            log.exception("vLLM events %s: sink failed on seq %d; marking stale", self.instance_id, seq)
            self.stats.sink_errors += 1
            self._mark_stale()
        now = time.time()
        self.stats.batches += 1
        self.stats.last_seq = seq
        self.stats.last_event_time = now
        self.stats.lag_s = now - batch.ts
        self._last_ts = batch.ts

    async def _run(self, ops: list[Op]) -> None:
        """Run a plan's sink calls in order, in slices of at most ``SLICE_BLOCKS`` blocks, giving
        the loop a turn whenever ``YIELD_AFTER_S`` has passed (a legal 65,536-block store costs
        ~60 ms of index work). This subscriber applies nothing else meanwhile, so the engine's
        order holds; a route meanwhile sees the first part of the batch, as if vLLM had sent it
        as several events. A snapshot taken meanwhile records the batch before as its position,
        and a restart replays this one whole (stores are idempotent)."""
        sink, iid = self._sink, self.instance_id
        until = time.perf_counter() + YIELD_AFTER_S
        for op in ops:
            for piece in cut_op(op, SLICE_BLOCKS):
                run_op(piece, sink, iid)
                if time.perf_counter() >= until:
                    await asyncio.sleep(0)
                    until = time.perf_counter() + YIELD_AFTER_S

    def _clear(self) -> None:
        self._tell_sink(self._sink.gpu_cleared, "clear")

    def _mark_stale(self) -> None:
        self._tell_sink(self._sink.mark_stale, "mark stale")

    def _tell_sink(self, call: Callable[[str], None], what: str) -> None:
        try:
            call(self.instance_id)
        except Exception:
            log.exception("vLLM events %s: sink failed to %s", self.instance_id, what)
            self.stats.sink_errors += 1

    async def _fill(self, start: int) -> None:
        """Replay from ``start`` and apply what comes back in order."""
        if self._replay_endpoint is None:
            return
        self.stats.replays += 1
        replayed = await self._request_replay(start)
        if replayed is None:
            self.stats.replay_failures += 1
            return
        for seq, batch in replayed:
            await self._apply_in_order(seq, batch)

    async def _request_replay(self, start: int) -> list[tuple[int, Planned]] | None:
        assert self._replay_endpoint is not None
        # A fresh DEALER per request: late replies to an abandoned request cannot leak
        # into the next one.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if "[" in self._replay_endpoint:
            dealer.setsockopt(zmq.IPV6, 1)
        out: list[tuple[int, Planned]] = []
        # A total deadline: a peer trickling one batch just inside the per-batch timeout must
        # not hold this engine's ingest (live batches queue meanwhile) for long.
        deadline = time.monotonic() + self._replay_deadline_s
        try:
            dealer.connect(self._replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while len(out) < self._max_replay_batches:
                left_ms = int((deadline - time.monotonic()) * 1000)
                wait_ms = max(0, min(self._replay_timeout_ms, left_ms))
                if left_ms <= 0 or not await dealer.poll(wait_ms, zmq.POLLIN):
                    if wait_ms < self._replay_timeout_ms:
                        self.stats.replay_deadlines += 1
                        log.warning("vLLM events %s: replay from %d past its %.1fs deadline",
                                    self.instance_id, start, self._replay_deadline_s)
                    else:
                        log.warning("vLLM events %s: replay from %d timed out", self.instance_id, start)
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) == 4 and frames[0] == b"" and frames[2] == END_SEQ.to_bytes(8, "big"):
                    break
                if len(frames) != 4 or frames[0] != b"":
                    self.stats.bad_frames += 1
                    continue
                parsed = await self._parse(frames[1:])
                if parsed is not None and parsed[0] >= start:
                    out.append(parsed)
        except zmq.ZMQError:
            log.exception("vLLM events %s: replay from %d failed", self.instance_id, start)
            return None
        finally:
            dealer.close(linger=0)
        out.sort(key=lambda item: item[0])
        return out
