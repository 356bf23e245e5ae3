"""The typed view of the cluster a policy decides on, and its choice."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from smetric_lmc.prices import InstancePrices

from smetric_lmc.wire import Reason


class Hits(Protocol):
    """Local hits per instance, as the router's index lookup or a plain list gives them."""

    def best(self) -> tuple[int, list[int] | None]: ...  # (longest hit, its holders; None: all)
    def at(self, i: int) -> int: ...
    def local_hit_tokens(self) -> list[int]: ...


class Loads(Protocol):
    """Loads per instance, as the load tracker or a plain list gives them."""

    def __len__(self) -> int: ...
    def at(self, i: int) -> float: ...
    def total(self) -> float: ...
    def least(self, rr: int) -> int: ...  # rr_argmin over every instance (ties: rr_pick)
    def dense(self) -> list[float]: ...


class DenseHits:
    __slots__ = ("_c",)

    def __init__(self, c: Sequence[int]) -> None:
        self._c = c

    def best(self) -> tuple[int, list[int] | None]:
        c = self._c
        top = max(c, default=0)
        holders = [i for i, v in enumerate(c) if v == top]
        return top, None if len(holders) == len(c) else holders

    def at(self, i: int) -> int:
        return self._c[i]

    def local_hit_tokens(self) -> list[int]:
        return list(self._c)


class DenseLoads:
    __slots__ = ("_l",)

    def __init__(self, load: Sequence[float]) -> None:
        self._l = load

    def __len__(self) -> int:
        return len(self._l)

    def at(self, i: int) -> float:
        return self._l[i]

    def total(self) -> float:
        return sum(self._l)

    def least(self, rr: int) -> int:
        return rr_argmin(list(self._l), rr)

    def dense(self) -> list[float]:
        return list(self._l)


class ClusterView:
    """Everything a policy may look at for one request; instances are positions in ``instances``.

    Policies ask it questions (:meth:`best_hit`, :meth:`holder`, :meth:`least_loaded`,
    :meth:`mean_load`, :meth:`hit`, :meth:`load_of`) that the router answers in O(instances with
    a hit) from the index lookup and the load tracker; ``local_hit`` and ``load`` as whole lists
    (for policies that score every instance) are built on first use. Tests and tools may pass
    plain lists."""

    __slots__ = ("instances", "prompt_tokens", "turn", "est_hit", "global_hit", "unprefilled", "in_flight", "prices", "rr",
                 "_hits", "_loads", "_c", "_l", "_best")

    def __init__(
        self,
        instances: Sequence[str],
        local_hit: Sequence[int] | None = None,  # c[i]: local-tier prefix hit on instance i (tokens)
        load: Sequence[float] | None = None,  # l[i]: in-flight requests (colocated) or unprefilled tokens (PD)
        prompt_tokens: int = 0,  # L
        turn: int = 0,  # 0 = the session's first request
        est_hit: int = 0,  # tokens the session's earlier turns should have left cached
        global_hit: int = 0,  # contiguous hit in the global tier (tokens)
        # Queued prefill tokens per instance; filled only for policies that declare needs={"unprefilled"}.
        unprefilled: Sequence[float] | None = None,
        # In-flight requests per instance whatever ``load`` counts (under PD it counts unprefilled
        # tokens); filled only for policies that declare needs={"in_flight"}.
        in_flight: Sequence[float] | None = None,
        # Round-robin pointer for tie-breaking: a tie goes to the first tied position at or after
        # it (rr_pick). The router keeps one per request kind (first turns, follow-ups) and moves
        # it past each decision's pick, so first turns rotate over all tied instances whatever
        # follow-ups do.
        rr: int = 0,
        *,
        hits: Hits | None = None,  # instead of local_hit
        loads: Loads | None = None,  # instead of load
        # What each instance's requests were measured to cost (smetric_lmc.prices); filled only for
        # policies that declare needs={"prices"} and only where the router has an estimator.
        prices: Sequence[InstancePrices] | None = None,
    ) -> None:
        self.instances = instances
        self.prompt_tokens = prompt_tokens
        self.turn = turn
        self.est_hit = est_hit
        self.global_hit = global_hit
        self.unprefilled = unprefilled
        self.in_flight = in_flight
        self.prices = prices
        self.rr = rr
        self._hits: Hits = hits if hits is not None else DenseHits(local_hit if local_hit is not None else ())
        self._loads: Loads = loads if loads is not None else DenseLoads(load if load is not None else ())
        self._c: list[int] | None = None
        self._l: list[float] | None = None
        self._best: tuple[int, list[int] | None] | None = None

    @property
    def local_hit(self) -> list[int]:
        if self._c is None:
            self._c = self._hits.local_hit_tokens()
        return self._c

    @property
    def load(self) -> list[float]:
        if self._l is None:
            self._l = self._loads.dense()
        return self._l

    def hit(self, i: int) -> int:
        return self._hits.at(i)

    def load_of(self, i: int) -> float:
        return self._loads.at(i)

    def mean_load(self) -> float:
        return self._loads.total() / len(self.instances)

    def best_hit(self) -> tuple[int, list[int] | None]:
        """(the longest local hit, the instances holding it in order; None when all do)."""
        if self._best is None:
            self._best = self._hits.best()
        return self._best

    def least_loaded(self, among: Sequence[int] | None = None) -> int:
        """``rr_argmin`` of the loads over ``among`` (default: every instance)."""
        if among is None:
            return self._loads.least(self.rr)
        at = self._loads.at
        best = min(at(i) for i in among)
        return rr_pick([i for i in among if at(i) == best], self.rr)

    def holder(self) -> int:
        """The instance with the longest local hit; ties go to the least loaded of them."""
        holders = self.best_hit()[1]
        if holders is not None and len(holders) == 1:
            return holders[0]
        return self.least_loaded(holders)


@dataclass(frozen=True, slots=True)
class Choice:
    """A policy's pick within its view; the router turns it into the ``RouteDecision``."""

    index: int  # into view.instances; -1 when nothing is routable
    reason: Reason


NO_INSTANCE = Choice(-1, Reason.NO_INSTANCES)


def rr_pick(ties: Sequence[int], rr: int) -> int:
    """The one round-robin tie-break: of ``ties`` (ascending positions), the first at or after
    position ``rr``, wrapping to the first. With the pointer moved past each pick, every tied
    position is picked in turn, whichever subset ties each time."""
    k = bisect_left(ties, rr)
    return ties[k] if k < len(ties) else ties[0]


def rr_argmin(values: list[float] | list[int], rr: int, among: Sequence[int] | None = None) -> int:
    """Index of the smallest value; ties broken by :func:`rr_pick`, never "always the first"."""
    if among is None:
        best = min(values)
        # rr_pick's rule at C speed (a Python scan of 1,024 loads costs more than the lookup):
        # the first minimum at or after rr, else the first one.
        try:
            return values.index(best, max(rr, 0))
        except ValueError:
            return values.index(best)
    best = min(values[i] for i in among)
    return rr_pick([i for i in among if values[i] == best], rr)
