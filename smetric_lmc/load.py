"""Load accounting: in-flight requests and unprefilled tokens per instance.

A request counts from the moment it is routed (so a burst cannot herd onto one instance before any
engine reports) until its done report; its prompt tokens count as unprefilled until its prefilled
report (the gateway sends it at the first streamed token; the simulator at prefill end). Without
that report the engines' ``vllm:num_requests_waiting`` bounds how many of an instance's requests
can still wait for prefill: older ones beyond that many are taken as prefilled (``reconcile``). Engines' own counters (``vllm:num_requests_running`` +
``_waiting``) heal lost done reports: entries older than a grace period beyond what the engine says
it holds are released, oldest first. Requests that other routers sent to an engine show up as
``external`` load, so the view never under-counts a shared engine.
"""

from __future__ import annotations

import itertools
import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from itertools import repeat

import msgspec

from smetric_lmc.policy.view import rr_pick
from smetric_lmc.tables import compacted


class _InFlight(msgspec.Struct, gc=False):
    # gc=False: holds only str/int/float/bool, so the cyclic GC need not track it. Hundreds of
    # thousands of in-flight entries otherwise make every full collection (a loop stall) longer.
    instance: str
    unprefilled: int
    since: float
    prefilled: bool = False
    cohort: int = -1  # the age cohort holding it (see ``LoadTracker._cohorts``); -1: none


SLICE = 2048  # entries one slice of upkeep handles: a few ms of the event loop
#: Queued entries a route looks at for expiry: more than the one it adds, so routing keeps up.
EXPIRE_PER_ROUTE = 8
#: Releases between two checks for request maps that shrank (see :meth:`LoadTracker._compact`).
COMPACT_EVERY = 1024
#: Age cohorts across ``expire_s``: an entry expires at most ``expire_s / COHORTS`` late.
COHORTS = 32


class LoadTracker:
    """``expire_s``: an entry never reported done is released after this long (counted as
    ``expired``), so a gateway that died cannot grow the in-flight set without bound."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, expire_s: float | None = None) -> None:
        self._clock = clock
        self._expire_s = expire_s
        # Expiry by age cohorts: the requests routed in one ``expire_s / COHORTS`` span share a
        # map, oldest cohort first, and a request leaves its cohort when it is released. A done
        # request then costs nothing until expiry. (An age queue of every route kept each done
        # request's entry and id for ``expire_s``, churned through pymalloc arenas that a few long-lived objects then kept resident, bench/kit/arena_census.py.)
        # Maps of untracked objects (str keys, gc=False entries) are not tracked by the cyclic GC
        # either: one GC-tracked record per route, freed by expiry as new ones come, keeps the
        # generation-0 count from reaching its threshold, and one collection of the young records
        # it let pile up stalled the loop (bench/soak.py).
        self._cohorts: deque[dict[str, _InFlight]] = deque()
        self._cohort_opened: deque[float] = deque()
        self._first_cohort = 0  # the number of ``_cohorts[0]``
        self._cohort_s = expire_s / COHORTS if expire_s is not None else 0.0
        self._requests: dict[str, _InFlight] = {}
        # Per instance, in routing (= age) order: every entry, and those not yet prefilled. Healing
        # and prefill inference then touch the oldest few entries of one instance, not all of them
        # (a scan of 200-400 k in-flight entries per poll stalled the loop for 0.4-1.2 s).
        self._of: dict[str, dict[str, _InFlight]] = {}
        self._queued: dict[str, dict[str, _InFlight]] = {}
        self._count: dict[str, int] = {}
        self._unprefilled: dict[str, int] = {}
        self._external: dict[str, int] = {}
        # count + external, kept up to date so a route reads every instance's load with one C-level
        # map (at 1,024 instances two dict lookups per instance were most of the route's cost).
        self._total: dict[str, int] = {}
        # The same totals laid out in the index's instance order (see ``aligned``), with their sum
        # and, per load value, the positions at that load in order: a route then reads the mean
        # and the least-loaded instance in O(1) instead of scanning every instance.
        self._aligned: list[int] = []
        self._aligned_pos: dict[str, int] = {}
        self._aligned_key: tuple[int, int] | None = None
        self.reconcile_left = False  # the last reconcile stopped at its budget
        self._draining: list[dict[str, _InFlight]] = []  # entries of removed instances, to forget
        self._dead = 0  # of those, how many the request map still holds
        self._released = 0  # since the last check for shrunken maps
        self._aligned_sum = 0
        self._at_load: dict[int, list[int]] = {}
        self._min_load = 0
        self.view = AlignedLoads(self)
        self.stats = {"routed": 0, "done": 0, "unknown_done": 0, "healed": 0, "prefilled": 0,
                      "prefilled_inferred": 0, "expired": 0}

    def add_instance(self, instance_id: str) -> None:
        self._count.setdefault(instance_id, 0)
        self._unprefilled.setdefault(instance_id, 0)
        self._external.setdefault(instance_id, 0)
        if instance_id not in self._total:
            self._set_total(instance_id, 0)

    def remove_instance(self, instance_id: str, budget: int = SLICE) -> None:
        """Forget the instance's load. Its entries leave the request map by :meth:`drain` slices
        (the first one now, of ``budget`` entries): until then they are dead, not counted."""
        of = self._of.pop(instance_id, None)
        if of:
            self._draining.append(of)
            self._dead += len(of)
            self.drain(budget)
        self._queued.pop(instance_id, None)
        self._count.pop(instance_id, None)
        self._unprefilled.pop(instance_id, None)
        self._external.pop(instance_id, None)
        self._total.pop(instance_id, None)
        k = self._aligned_pos.get(instance_id)
        if k is not None:
            self._move(k, 0)

    def on_route(self, request_id: str, instance_id: str, prompt_tokens: int, hit_tokens: int = 0) -> None:
        """Count a routed request; re-routing the same id moves it."""
        if request_id in self._requests:
            self._release(request_id)
        self.add_instance(instance_id)
        todo = max(0, prompt_tokens - hit_tokens)
        now = self._clock()
        entry = self._requests[request_id] = _InFlight(instance_id, todo, now)
        self._of.setdefault(instance_id, {})[request_id] = entry
        self._queued.setdefault(instance_id, {})[request_id] = entry
        if self._expire_s is not None:
            self.expire(EXPIRE_PER_ROUTE)
            opened = self._cohort_opened
            if not opened or now - opened[-1] >= self._cohort_s:
                self._cohorts.append({})
                opened.append(now)
            self._cohorts[-1][request_id] = entry
            entry.cohort = self._first_cohort + len(self._cohorts) - 1
        self._count[instance_id] += 1
        self._set_total(instance_id, self._total[instance_id] + 1)
        self._unprefilled[instance_id] += todo
        self.stats["routed"] += 1

    def drain(self, budget: int = SLICE) -> bool:
        """Forget up to ``budget`` entries of removed instances; True while some are left."""
        requests, draining = self._requests, self._draining
        while draining and budget > 0:
            of = draining[-1]
            k = min(budget, len(of))
            for _ in range(k):
                rid, entry = of.popitem()
                if requests.get(rid) is entry:
                    del requests[rid]
                    self._dead -= 1
            budget -= k
            self._released += k
            if not of:
                draining.pop()
        self._maybe_compact()
        return bool(draining)

    def _live(self, request_id: str, entry: _InFlight | None) -> bool:
        of = self._of.get(entry.instance) if entry is not None else None
        return of is not None and of.get(request_id) is entry

    def on_prefilled(self, request_id: str) -> bool:
        """Prefill finished: its tokens no longer queue. False when not in flight or already prefilled."""
        entry = self._requests.get(request_id)
        if entry is None or entry.prefilled or not self._live(request_id, entry):
            return False
        self._unprefilled[entry.instance] -= entry.unprefilled
        entry.unprefilled = 0
        entry.prefilled = True
        self._queued[entry.instance].pop(request_id, None)
        self.stats["prefilled"] += 1
        return True

    def on_done(self, request_id: str) -> bool:
        """Release a request; False when it was not in flight (duplicate or healed)."""
        if self._release(request_id):
            self.stats["done"] += 1
            self._maybe_compact()
            return True
        self.stats["unknown_done"] += 1
        return False

    def _release(self, request_id: str) -> bool:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return False
        k = entry.cohort - self._first_cohort
        if k >= 0:
            self._cohorts[k].pop(request_id, None)
        if not self._live(request_id, entry):  # its instance was removed: the entry was dead
            self._dead -= 1
            return False
        self._of[entry.instance].pop(request_id, None)
        self._queued[entry.instance].pop(request_id, None)
        self._count[entry.instance] -= 1
        self._set_total(entry.instance, self._total[entry.instance] - 1)
        self._unprefilled[entry.instance] -= entry.unprefilled
        self._released += 1
        return True

    def _maybe_compact(self) -> None:
        if self._released >= COMPACT_EVERY:
            self._compact()

    def _compact(self) -> None:
        """Replace request maps whose tables are far larger than their entries need by right-sized
        copies (``smetric_lmc.tables``): a dict never shrinks on deletion, so after a burst (160 k
        requests held by a crashed gateway, then expired) the tables of the peak stayed allocated
        for good. Called from the public mutators, never while a caller iterates a map."""
        self._released = 0
        self._requests = compacted(self._requests)
        for maps in (self._of, self._queued):
            for iid, m in maps.items():
                c = compacted(m)
                if c is not m:
                    maps[iid] = c  # same key: no resize of ``maps`` during the iteration

    def expire(self, budget: int = SLICE) -> int:
        """Release the entries of cohorts wholly older than ``expire_s``, up to ``budget`` entries
        (a slice of the loop: after an idle spell a whole burst's entries are due at once); O(1)
        amortized (each route joins one cohort once). Returns how many were released."""
        if self._expire_s is None:
            return 0
        cutoff = self._clock() - self._expire_s - self._cohort_s
        cohorts, n = self._cohorts, 0
        while cohorts and budget > 0 and self._cohort_opened[0] < cutoff:
            members = cohorts[0]
            while members and budget > 0:
                budget -= 1
                rid, entry = members.popitem()
                if self._requests.get(rid) is entry:  # not of a removed instance (drained)
                    self._release(rid)
                    n += 1
            if members:
                break
            cohorts.popleft()
            self._cohort_opened.popleft()
            self._first_cohort += 1
            budget -= 1
        self.stats["expired"] += n
        self._maybe_compact()
        return n

    def expire_due(self) -> bool:
        """Whether the oldest cohort is past ``expire_s`` (:meth:`expire` has work)."""
        return self._expire_s is not None and bool(self._cohort_opened) and (
            self._cohort_opened[0] < self._clock() - self._expire_s - self._cohort_s)

    def reconcile(
        self, instance_id: str, engine_requests: int, grace_s: float = 30.0, *,
        engine_waiting: int | None = None, prefill_grace_s: float = 1.0, budget: int | None = None,
    ) -> int:
        """Align with the engine's running+waiting count. Returns entries released as lost.

        ``budget``: release and infer at most this many entries each, so one call stays a few ms
        (an event loop's slice); ``reconcile_left`` then says whether calling again with the same
        counts has more to do (entries routed or done meanwhile are accounted as they come).

        With ``engine_waiting`` (requests the engine has not scheduled yet), entries routed more than
        ``prefill_grace_s`` ago that are still unprefilled, beyond the ``engine_waiting`` newest of
        them, are taken as prefilled (the engine schedules first come, first served): the fallback
        for gateways that send no prefilled report. It cannot see a chunked prefill in progress."""
        self.add_instance(instance_id)  # an engine that reports load exists, routed to or not
        ours = self._count[instance_id]
        self._external[instance_id] = max(0, engine_requests - ours)
        self._set_total(instance_id, ours + self._external[instance_id])
        excess = ours - engine_requests
        self.reconcile_left = False
        if self._draining:
            self.drain()
        if engine_waiting is not None:
            self._infer_prefilled(instance_id, engine_waiting, prefill_grace_s, budget)
        if excess <= 0:
            return 0
        if budget is not None and excess > budget:
            excess = budget
        cutoff = self._clock() - grace_s
        stale = []
        for rid, e in self._of.get(instance_id, {}).items():  # oldest first
            if e.since >= cutoff or len(stale) >= excess:
                break
            stale.append(rid)
        if len(stale) == budget:
            self.reconcile_left = True
        for rid in stale:
            self._release(rid)
        self.stats["healed"] += len(stale)
        self._maybe_compact()
        return len(stale)

    def _infer_prefilled(self, instance_id: str, engine_waiting: int, prefill_grace_s: float,
                         budget: int | None) -> None:
        cutoff = self._clock() - prefill_grace_s
        queued = self._queued.get(instance_id, {})
        recent = 0
        for e in reversed(queued.values()):  # newest first: only those routed within the grace
            if e.since < cutoff:
                break
            recent += 1
        # The oldest unprefilled entries beyond the engine's waiting count have been scheduled.
        todo = len(queued) - recent - engine_waiting
        if budget is not None and todo > budget:
            todo = budget
            self.reconcile_left = True
        for rid in list(itertools.islice(queued, max(0, todo))):
            if self.on_prefilled(rid):
                self.stats["prefilled"] -= 1
                self.stats["prefilled_inferred"] += 1

    def in_flight(self, instance_id: str) -> int:
        return self._total.get(instance_id, 0)

    def unprefilled(self, instance_id: str) -> int:
        return self._unprefilled.get(instance_id, 0)

    def _set_total(self, instance_id: str, value: int) -> None:
        self._total[instance_id] = value
        k = self._aligned_pos.get(instance_id)
        if k is not None:
            self._move(k, value)

    def _move(self, k: int, value: int) -> None:
        """Position ``k`` of the aligned order now carries ``value``."""
        old = self._aligned[k]
        if old == value:
            return
        self._aligned[k] = value
        self._aligned_sum += value - old
        at = self._at_load
        dst = at.get(value)
        if dst is None:
            at[value] = [k]
        else:
            insort(dst, k)
        src = at[old]
        del src[bisect_left(src, k)]
        if value < self._min_load:
            self._min_load = value
        if not src:
            del at[old]
            if old == self._min_load:
                self._min_load = min(at)  # O(distinct loads): a handful

    def aligned(self, order: list[str], key: tuple[int, int]) -> AlignedLoads:
        """In-flight loads (colocated) of every instance of ``order``, as a live view.

        ``key`` identifies the order (the router passes the index's identity and membership
        counter): while it is unchanged the loads are kept laid out in that order, with their sum
        and the positions at each load, as they change; a new key rebuilds them (O(instances))."""
        if key != self._aligned_key:
            self._aligned_key = key
            self._aligned_pos = {iid: k for k, iid in enumerate(order)}
            self._aligned = list(map(self._total.get, order, repeat(0)))
            self._aligned_sum = sum(self._aligned)
            self._at_load = {}
            for k, v in enumerate(self._aligned):
                self._at_load.setdefault(v, []).append(k)
            self._min_load = min(self._at_load, default=0)
        return self.view

    def loads(self, instance_ids: list[str], disaggregated: bool = False) -> list[int]:
        """The policy's load: in-flight requests (colocated) or unprefilled tokens (disaggregated)."""
        if disaggregated:
            return list(map(self._unprefilled.get, instance_ids, repeat(0)))
        return list(map(self._total.get, instance_ids, repeat(0)))

    def instance_of(self, request_id: str) -> str | None:
        entry = self._requests.get(request_id)
        return entry.instance if entry is not None and self._live(request_id, entry) else None

    def __len__(self) -> int:
        return len(self._requests) - self._dead

    @property
    def draining(self) -> int:
        """Entries of removed instances still held, left for later :meth:`drain` slices (not in
        ``len``: they count as no instance's load)."""
        return self._dead


class AlignedLoads:
    """A tracker's loads in the aligned instance order (:meth:`LoadTracker.aligned`), read live:
    what a ``ClusterView`` asks of its loads, each in O(1) or O(log n)."""

    __slots__ = ("_t",)

    def __init__(self, tracker: LoadTracker) -> None:
        self._t = tracker

    def __len__(self) -> int:
        return len(self._t._aligned)

    def at(self, k: int) -> int:
        return self._t._aligned[k]

    def total(self) -> int:
        return self._t._aligned_sum

    def least(self, rr: int) -> int:
        """Position of the least-loaded instance; ties broken by ``policy.view.rr_pick``."""
        return rr_pick(self._t._at_load[self._t._min_load], rr)

    def dense(self) -> list[int]:
        return self._t._aligned.copy()
