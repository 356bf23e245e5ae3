"""The typed view of the cluster a policy decides on, and its choice."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, count, islice, repeat
from operator import eq

from smetric_lmc.wire import Reason


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Everything a policy may look at for one request. Sequences are indexed by instance."""

    instances: Sequence[str]
    local_hit: Sequence[int]  # c[i]: local-tier prefix hit of the request on instance i (tokens)
    load: Sequence[float]  # l[i]: in-flight requests (colocated) or unprefilled tokens (disaggregated)
    prompt_tokens: int  # L
    turn: int = 0  # 0 = the session's first request
    est_hit: int = 0  # tokens the session's earlier turns should have left cached
    global_hit: int = 0  # contiguous hit in the global tier (tokens)
    # Queued prefill tokens per instance; filled only for policies that declare needs={"unprefilled"}.
    unprefilled: Sequence[float] | None = None
    # In-flight requests per instance whatever ``load`` counts (under PD it counts unprefilled tokens);
    # filled only for policies that declare needs={"in_flight"}.
    in_flight: Sequence[float] | None = None
    rr: int = 0  # round-robin cursor for tie-breaking; the caller advances it per decision


@dataclass(frozen=True, slots=True)
class Choice:
    """A policy's pick within its view; the router turns it into the ``RouteDecision``."""

    index: int  # into view.instances; -1 when nothing is routable
    reason: Reason


NO_INSTANCE = Choice(-1, Reason.NO_INSTANCES)


def rr_argmin(values: list[float] | list[int], rr: int, among: Sequence[int] | None = None) -> int:
    """Index of the smallest value; ties broken round-robin by the cursor, never "always the first"."""
    if among is None:
        best = min(values)
        if values.count(best) == 1:  # the common case, at C speed
            return values.index(best)
        # The rr-th tie at C speed: a Python-level scan of 1,024 loads costs more than the lookup.
        ties_n = values.count(best)
        return next(islice(compress(count(), map(eq, values, repeat(best))), rr % ties_n, None))
    else:
        best = min(values[i] for i in among)
        ties = [i for i in among if values[i] == best]
    return ties[rr % len(ties)]
