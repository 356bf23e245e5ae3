"""Workload data model shared by the trace loaders, the generator, the analysis and the simulator.

Block ids are prefix-chained: two requests hold the same id at position j exactly when their first
j+1 blocks are the same content. Requests of one session usually extend each other, so their id
arrays are stored as views into one base array per context stream (see `share_prefix_views`), which
keeps a full WEKA replay to roughly one id per distinct block in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BLOCK_DTYPE = np.uint64


@dataclass(slots=True, eq=False)
class TraceRequest:
    """One LLM call. `arrival` is seconds since its session's start, as recorded or generated."""

    arrival: float
    input_tokens: int
    output_tokens: int
    block_ids: np.ndarray
    think_time: float = 0.0
    kind: str = "n"
    # Number of earlier requests of the session whose history this request carries (0 = first turn,
    # or a request that dropped its history, e.g. after context compaction).
    turn: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TraceRequest):
            return NotImplemented
        return (
            self.arrival == other.arrival
            and self.input_tokens == other.input_tokens
            and self.output_tokens == other.output_tokens
            and self.think_time == other.think_time
            and self.kind == other.kind
            and self.turn == other.turn
            and np.array_equal(self.block_ids, other.block_ids)
        )


@dataclass(slots=True)
class TraceSession:
    """A sequence of requests from one client context (an agent, a chat, or a sub-agent).

    `start_offset` is relative to the start of the root session (the one without a parent). For a
    root session it is its recorded start in the trace when the workload has absolute start times
    (`Workload.meta["absolute_starts"]`), else 0 and a replay places it.
    """

    session_id: str
    requests: list[TraceRequest]
    parent_id: str | None = None
    start_offset: float = 0.0


@dataclass(slots=True)
class Workload:
    name: str
    block_size: int
    sessions: list[TraceSession]
    meta: dict[str, Any] = field(default_factory=dict)

    def iter_requests(self) -> Iterator[tuple[TraceSession, TraceRequest]]:
        for s in self.sessions:
            for r in s.requests:
                yield s, r

    @property
    def n_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions)

    def root_of(self) -> dict[str, str]:
        """Map every session id to the id of its root session (following `parent_id`)."""
        parent = {s.session_id: s.parent_id for s in self.sessions}
        roots: dict[str, str] = {}
        for sid in parent:
            path: list[str] = []
            cur = sid
            while cur not in roots:
                p = parent[cur]
                # A parent missing from the trace, or a cycle in a malformed one, ends the walk.
                if p is None or p not in parent or cur in path:
                    roots[cur] = cur
                    break
                path.append(cur)
                cur = p
            for c in path:
                roots[c] = roots[cur]
        return roots

    def absolute_start(self) -> dict[str, float]:
        """Start time of every session relative to its root's start (roots at their start_offset)."""
        roots = self.root_of()
        by_id = {s.session_id: s for s in self.sessions}
        out: dict[str, float] = {}
        for s in self.sessions:
            root = by_id[roots[s.session_id]]
            out[s.session_id] = s.start_offset if root is s else root.start_offset + s.start_offset
        return out


def share_prefix_views(arrays: list[np.ndarray], extends: list[bool]) -> list[np.ndarray]:
    """Turn each array that is a prefix of the next into a view of it, saving its memory.

    `extends[i]` says array i starts with all of array i-1 (callers know it from the raw ids, so no
    comparison is repeated here). Works backwards so a chain of extensions ends up on one base.
    """
    out = list(arrays)
    for i in range(len(out) - 1, 0, -1):
        if extends[i] and len(out[i - 1]) <= len(out[i]):
            out[i - 1] = out[i][: len(out[i - 1])]
    return out
