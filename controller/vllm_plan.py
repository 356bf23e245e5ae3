"""vLLM KV event batches planned into index operations, and applied to a sink.

Planning is pure (a decoded batch in, a list of operations out), so a large payload can be
decoded and planned in the frame worker and only the operations cross back to the loop.
"""


from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from smetric_lmc.controller.vllm_wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DroppedEvent,
    EventBatch,
    PayloadError,
    decode_payload,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


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


