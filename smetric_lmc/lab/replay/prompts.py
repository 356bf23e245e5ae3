"""Prompts whose token ids reproduce a trace's block sharing.

A trace records each request as prefix-chained block ids (equal id at position j <=> equal first
j+1 blocks). Every block id maps to its own block of token ids through a 64-bit mixer, so equal ids
give equal token blocks and different ids give different ones (up to a 2^-64-ish collision per
pair): an engine with prefix caching then hits exactly where the trace's requests share prefixes.

Context scaling keeps that structure: scaled block i takes the id of original block
``floor(i / scale)``, so two prompts that shared their first j blocks share about ``j * scale``.
The partial tail block (and any tail beyond the recorded ids) comes from a per-request salt and is
never shared, as an engine caches whole blocks only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from smetric_lmc.lab.workload.model import TraceRequest, TraceSession, Workload

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorised (uint64 arithmetic wraps, as the mixer needs)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


@dataclass(frozen=True, slots=True)
class TokenSpace:
    """Token ids are drawn from ``[low, vocab_size)``: below ``low`` sit a tokenizer's special ids."""

    vocab_size: int = 4096
    low: int = 16

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.vocab_size:
            raise ValueError(f"need 0 <= low < vocab_size, got low={self.low}, vocab_size={self.vocab_size}")

    def blocks(self, ids: np.ndarray, block_size: int) -> np.ndarray:
        """Token ids of whole blocks, shape (len(ids), block_size)."""
        ids = np.asarray(ids, dtype=np.uint64)
        offs = (np.arange(1, block_size + 1, dtype=np.uint64) * _GOLDEN)[None, :]
        with np.errstate(over="ignore"):
            x = _mix(ids[:, None] + offs)
        span = np.uint64(self.vocab_size - self.low)
        return (x % span).astype(np.int64) + self.low


def scaled_ids(ids: np.ndarray, n_blocks: int, scale: float) -> np.ndarray:
    """The ids of a prompt scaled to ``n_blocks`` whole blocks (block i <- original floor(i/scale))."""
    if scale == 1.0:
        return ids[:n_blocks]
    src = np.floor(np.arange(n_blocks) / scale).astype(np.int64)
    return ids[src[src < len(ids)]]


def prompt_tokens(
    req: TraceRequest, block_size: int, space: TokenSpace, *, scale: float = 1.0, salt: int = 0
) -> list[int]:
    """The token ids of one trace request (``round(input_tokens * scale)`` of them, at least 1)."""
    n = max(1, round(req.input_tokens * scale))
    ids = scaled_ids(req.block_ids, n // block_size, scale)
    body = space.blocks(ids, block_size).reshape(-1)
    rest = n - len(body)
    if rest > 0:
        # Unshared tail: from the salt (a request's own id), never equal to a trace block.
        tail_blocks = -(-rest // block_size)
        with np.errstate(over="ignore"):
            seeds = np.uint64(salt) * _GOLDEN + np.arange(tail_blocks, dtype=np.uint64) + np.uint64(1 << 63)
        tail = space.blocks(_mix(seeds), block_size).reshape(-1)[:rest]
        body = np.concatenate([body, tail])
    return body[:n].tolist()


def scale_workload(wl: Workload, scale: float, output_scale: float | None = None) -> Workload:
    """The same sessions with every prompt (and its shared prefixes) ``scale`` times as long: what a
    replay with ``context_scale`` sends, as a workload the simulator can run too. Outputs scale by
    ``output_scale`` (default: ``scale``, so that an answer still fits in the next prompt)."""
    out_scale = scale if output_scale is None else output_scale
    if scale == 1.0 and out_scale == 1.0:
        return wl
    if not 0 < scale <= 1:
        raise ValueError("scale must be in (0, 1]")
    bs = wl.block_size
    sessions = []
    for s in wl.sessions:
        reqs = []
        for r in s.requests:
            n = max(1, round(r.input_tokens * scale))
            ids = scaled_ids(r.block_ids, n // bs, scale)
            out = max(1, round(r.output_tokens * out_scale))
            reqs.append(TraceRequest(r.arrival, n, out, ids, r.think_time, r.kind, r.turn))
        sessions.append(TraceSession(s.session_id, reqs, s.parent_id, s.start_offset))
    return Workload(f"{wl.name}@x{scale:g}", bs, sessions, dict(wl.meta))
