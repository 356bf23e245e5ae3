"""Load as a real router sees it (``SimConfig.load_signal``).

``router``: the router's own in-flight counts, exact at every decision (what ``LoadTracker`` keeps;
SMetric's reference router and LMetric count their own routed requests). ``scrape``: the engines'
metrics scraped every ``scrape_s`` seconds (production routers poll vLLM's ``/metrics``; Bailian reads
batch size): every decision between two scrapes sees the loads of the last one, so requests routed
in between do not count — a burst herds onto the instance that looked least loaded.

The snapshot is taken at the first decision after each scrape instant (decisions are the only
readers); completions between the instant and that decision are counted, a slight freshening.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from smetric_lmc.load import LoadTracker
from smetric_lmc.policy.view import DenseLoads


class ScrapedLoadTracker(LoadTracker):
    """A ``LoadTracker`` whose readers see the loads of the last scrape, not the live counts."""

    def __init__(self, clock: Callable[[], float], scrape_s: float) -> None:
        if not scrape_s > 0:
            raise ValueError("scrape_s must be > 0")
        super().__init__(clock=clock)
        self.scrape_s = scrape_s
        self._clock = clock
        self._next = -math.inf
        self._snap_total: dict[str, int] = {}
        self._snap_unpre: dict[str, int] = {}
        self.scrapes = 0

    def _fresh(self) -> None:
        now = self._clock()
        if now >= self._next:
            self._snap_total = dict(self._total)
            self._snap_unpre = dict(self._unprefilled)
            self._next = (math.floor(now / self.scrape_s) + 1) * self.scrape_s
            self.scrapes += 1

    def true_loads(self, instance_ids: list[str], disaggregated: bool = False) -> list[int]:
        return LoadTracker.loads(self, instance_ids, disaggregated)

    def aligned(self, order: list[str], key: tuple[int, int]) -> DenseLoads:  # type: ignore[override]
        return DenseLoads(self.loads(order))

    def loads(self, instance_ids: list[str], disaggregated: bool = False) -> list[int]:
        self._fresh()
        snap = self._snap_unpre if disaggregated else self._snap_total
        return [snap.get(i, 0) for i in instance_ids]

    def in_flight(self, instance_id: str) -> int:
        self._fresh()
        return self._snap_total.get(instance_id, 0)

    def unprefilled(self, instance_id: str) -> int:
        self._fresh()
        return self._snap_unpre.get(instance_id, 0)


class BatchLoadTracker(LoadTracker):
    """A ``LoadTracker`` whose readers see each engine's running batch (requests it admitted, not
    those queued behind them), as the paper's Bailian reads load ("batch size", §4.1) and LMetric does
    ("current batch size of the instance", LMetric's own paper). A full batch stops growing while its
    queue does, so a KV-favoured instance keeps attracting work. Bookkeeping (and the unprefilled
    tokens Dynamo reads) stays the router's."""

    def __init__(self, clock: Callable[[], float], batch: Callable[[str], int]) -> None:
        super().__init__(clock=clock)
        self._batch = batch

    def aligned(self, order: list[str], key: tuple[int, int]) -> DenseLoads:  # type: ignore[override]
        return DenseLoads(self.loads(order))

    def loads(self, instance_ids: list[str], disaggregated: bool = False) -> list[int]:
        return [self._batch(i) for i in instance_ids]

    def in_flight(self, instance_id: str) -> int:
        return self._batch(instance_id)
