"""Engine ``/metrics`` poller: heals lost done reports and tells the controller an engine is alive.

Every ``interval_s`` each instance's ``GET <http>/metrics`` is read and
``vllm:num_requests_running + vllm:num_requests_waiting`` (summed over engines / data-parallel
ranks) goes to ``LoadTracker.reconcile``, with the waiting count on its own as the fallback for
prefill progress (requests the engine has not scheduled have not been prefilled). A poll that fails (connection refused, timeout,
non-200, unparsable text, or neither gauge present) is counted and marks the instance's engine
metrics unhealthy; the controller's liveness rule decides what that means for routing.

Re-probe: an instance whose last poll failed is polled again after ``probe_s``, doubling per
further failure up to the regular interval (the half-open probe of the controller's circuit
breaker), so an engine that comes back is seen within about a second instead of a full period.
``probe_now`` asks for an immediate poll of one instance (the gateway reported it unreachable).

Prices: each poll's growth of vLLM's inter-token latency histogram is a decode-time observation
(``on_tpot``), and of LMCache's retrieve histogram and retrieved-token counter a retrieve-time one
(``on_retrieve``), for the controller's price estimator (smetric_lmc.prices).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # aiohttp is imported when the poller first polls, not on a restart's path
    import aiohttp

from smetric_lmc.backoff import doubled
from smetric_lmc.controller.tasks import cancel_and_wait
from smetric_lmc.load import LoadTracker

log = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
#: vLLM's inter-token latency histogram (v1 engine), and its v0 name: one observation per output
#: token after the first, so an interval's delta sum / delta count is its mean time per output token.
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
#: LMCache's retrieve histogram (seconds per retrieve) and its retrieved-token counter. LMCache sets
#: ``PROMETHEUS_MULTIPROC_DIR`` in the engine's process, so vLLM's /metrics carries them; an interval's
#: delta sum / delta count is the mean time of a retrieve there, delta tokens / delta count its mean size.
RETRIEVE_TIME = "lmcache:time_to_retrieve"
RETRIEVED_TOKENS = "lmcache:num_hit_tokens"
#: vLLM's /metrics is ~100 KiB; anything far larger is not an engine we understand.
MAX_BODY_BYTES = 8 << 20
#: The lines of the families read (their samples, HELP and TYPE), less histogram buckets (only a
#: histogram's sum and count are read). Only these reach the Prometheus parser: its cost is per
#: line, and most of vLLM's body is histograms nothing here reads (bench/engine_metrics.py).
_READ_LINES = tuple(p + f for f in (RUNNING, WAITING, *ITL, RETRIEVE_TIME, RETRIEVED_TOKENS)
                    for p in ("", "# HELP ", "# TYPE "))
_BUCKETS = tuple(f + "_bucket" for f in (*ITL, RETRIEVE_TIME))
RECONCILE_SLICE = 1024  # in-flight entries healed or inferred per slice of the loop (see LoadTracker.reconcile)


class EngineMetricsError(ValueError):
    """The body is not Prometheus text carrying vLLM's request gauges."""


@dataclass(frozen=True, slots=True)
class EngineSample:
    """What one ``/metrics`` body says (summed over engines / data-parallel ranks)."""

    requests: int  # running + waiting
    waiting: int | None
    running: float | None
    itl_sum_s: float | None = None  # the inter-token latency histogram's running sum and count
    itl_count: float | None = None
    retrieve_sum_s: float | None = None  # LMCache's retrieve histogram's running sum and count,
    retrieve_count: float | None = None  # and the tokens those retrieves brought back
    retrieved_tokens: float | None = None


def _pair(sums: Mapping[str, float], total: str, count: str) -> tuple[float | None, float | None]:
    """A histogram's (sum, count), or (None, None) when half of it is missing or either is invalid."""
    a, b = sums.get(total), sums.get(count)
    if a is None or b is None or not (a >= 0 and b >= 0):  # a half or a NaN: ignored
        return None, None
    return a, b


def parse_engine_metrics(text: str) -> EngineSample:
    """The request gauges (required); the inter-token latency histogram and LMCache's retrieve
    histogram and retrieved-token counter when exported (each summed over labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    itl: dict[str, float] = {}
    lmc: dict[str, float] = {}
    wanted = {RETRIEVE_TIME + "_sum", RETRIEVE_TIME + "_count", RETRIEVED_TOKENS + "_total"}
    read = "\n".join(line for line in text.splitlines()
                     if line.startswith(_READ_LINES) and not line.startswith(_BUCKETS))
    try:
        for family in text_string_to_metric_families(read):
            if family.name in (RUNNING, WAITING):
                for sample in family.samples:
                    if sample.name == family.name:
                        totals[family.name] = totals.get(family.name, 0.0) + sample.value
            elif family.name in ITL and not itl.keys() - {family.name + "_sum", family.name + "_count"}:
                for sample in family.samples:  # the first of the two names present is read
                    if sample.name in (family.name + "_sum", family.name + "_count"):
                        itl[sample.name] = itl.get(sample.name, 0.0) + sample.value
            elif family.name in (RETRIEVE_TIME, RETRIEVED_TOKENS):
                for sample in family.samples:
                    if sample.name in wanted:
                        lmc[sample.name] = lmc.get(sample.name, 0.0) + sample.value
    except (ValueError, TypeError, IndexError) as exc:  # the parser's ways of saying "not Prometheus text"
        raise EngineMetricsError(f"unparsable metrics: {exc}") from None
    if not totals:
        raise EngineMetricsError(f"neither {RUNNING} nor {WAITING} present")
    for v in totals.values():
        if v != v or v < 0:  # NaN or negative: an engine would never report that
            raise EngineMetricsError(f"invalid request count {v}")
    waiting = totals.get(WAITING)
    isum, icount = _pair({k.rsplit("_", 1)[1]: v for k, v in itl.items()}, "sum", "count")
    rsum, rcount = _pair(lmc, RETRIEVE_TIME + "_sum", RETRIEVE_TIME + "_count")
    rtok = lmc.get(RETRIEVED_TOKENS + "_total")
    if rsum is None or rtok is None or not rtok >= 0:
        rsum = rcount = rtok = None
    return EngineSample(int(round(sum(totals.values()))), None if waiting is None else int(round(waiting)),
                        totals.get(RUNNING), isum, icount, rsum, rcount, rtok)


def parse_engine_counts(text: str) -> tuple[int, int | None]:
    """(running + waiting, waiting) requests in a vLLM ``/metrics`` body; waiting None if absent."""
    s = parse_engine_metrics(text)
    return s.requests, s.waiting


class _CounterDeltas:
    """Per instance, the growth of some running counters since the previous poll. A counter that
    went backwards (the engine restarted) only resets the baseline; the first poll is one."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, ...]] = {}

    def step(self, instance_id: str, now: tuple[float, ...]) -> tuple[float, ...] | None:
        prev = self._last.get(instance_id)
        self._last[instance_id] = now
        if prev is None:
            return None
        d = tuple(a - b for a, b in zip(now, prev))
        return d if all(x >= 0 for x in d) else None

    def forget(self, instance_id: str) -> None:
        self._last.pop(instance_id, None)


class ItlDeltas(_CounterDeltas):
    """Per instance, the mean time per output token since the previous poll (the histogram's delta
    sum / delta count) and the running requests then: what ``PriceBook.observe_tpot`` learns from."""

    def update(self, instance_id: str, s: EngineSample) -> tuple[float, float] | None:
        if s.itl_sum_s is None or s.itl_count is None or s.running is None:
            return None
        d = self.step(instance_id, (s.itl_sum_s, s.itl_count))
        if d is None or d[1] <= 0 or d[0] <= 0:
            return None
        return d[0] / d[1], s.running


class RetrieveDeltas(_CounterDeltas):
    """Per instance, LMCache's retrieves since the previous poll: (their count, mean seconds, mean
    tokens), what ``PriceBook.observe_retrieve`` learns the retrieve price from."""

    def update(self, instance_id: str, s: EngineSample) -> tuple[float, float, float] | None:
        if s.retrieve_sum_s is None or s.retrieve_count is None or s.retrieved_tokens is None:
            return None
        d = self.step(instance_id, (s.retrieve_sum_s, s.retrieve_count, s.retrieved_tokens))
        if d is None or d[1] <= 0 or d[0] <= 0:
            return None
        return d[1], d[0] / d[1], d[2] / d[1]


@dataclass(slots=True)
class PollState:
    polls: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    healed: int = 0
    ok: bool | None = None  # None until the first poll
    engine_requests: int | None = None
    last_ok: float | None = None  # monotonic
    last_error: str | None = None


class EngineMetricsPoller:
    """Polls every instance's engine metrics; ``on_result(instance_id, ok)`` after each poll."""

    def __init__(
        self,
        targets: Mapping[str, str],
        load: LoadTracker,
        *,
        interval_s: float = 2.0,
        grace_s: float = 30.0,
        timeout_s: float | None = None,
        on_result: Callable[[str, bool], None] | None = None,
        probe_s: float = 0.25,
        on_tpot: Callable[[str, float, float], None] | None = None,
        on_retrieve: Callable[[str, float, float, float], None] | None = None,
    ) -> None:
        self.targets = {iid: url.rstrip("/") + "/metrics" for iid, url in targets.items()}
        self.load = load
        self.interval_s = interval_s
        self.grace_s = grace_s
        # A poll must finish before the next one is due, or slow engines would pile up requests.
        self.timeout_s = timeout_s if timeout_s is not None else max(0.2, min(5.0, interval_s * 0.8))
        self.on_result = on_result
        # (instance, mean s per output token since the last poll, running requests): the price estimator
        self.on_tpot = on_tpot
        # (instance, retrieves since the last poll, their mean seconds, their mean tokens): LMCache's
        # retrieve price, for the price estimator
        self.on_retrieve = on_retrieve
        self._itl = ItlDeltas()
        self._retrieves = RetrieveDeltas()
        self.probe_s = min(probe_s, interval_s)
        self.state: dict[str, PollState] = {iid: PollState() for iid in targets}
        self._due: dict[str, float] = dict.fromkeys(targets, 0.0)  # monotonic time of each next poll
        self._wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    def healthy(self, instance_id: str) -> bool | None:
        st = self.state.get(instance_id)
        return st.ok if st is not None else None

    async def run(self) -> None:
        self._task = asyncio.current_task()
        try:
            while not self._closing:
                now = time.monotonic()
                due = [iid for iid, t in self._due.items() if t <= now]
                if due:
                    await self.poll_once(due)
                    continue
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), min(self._due.values(), default=now + self.interval_s) - now)
        except asyncio.CancelledError:
            if not self._closing:
                raise
        finally:
            await self._close_session()

    def add_target(self, instance_id: str, http_url: str) -> None:
        """Poll one more engine (an instance joining a running controller), first at the next turn."""
        self.targets[instance_id] = http_url.rstrip("/") + "/metrics"
        self.state[instance_id] = PollState()
        self._due[instance_id] = 0.0
        self._wake.set()

    def remove_target(self, instance_id: str) -> None:
        """Stop polling an engine; a poll of it in flight ends without being rescheduled."""
        self.targets.pop(instance_id, None)
        self._due.pop(instance_id, None)
        self._itl.forget(instance_id)
        self._retrieves.forget(instance_id)

    def probe_now(self, instance_id: str) -> None:
        """Poll ``instance_id`` at once (the next loop turn) instead of at its scheduled time."""
        if instance_id in self._due:
            self._due[instance_id] = 0.0
            self._wake.set()

    def _schedule(self, instance_id: str, st: PollState) -> None:
        # A failing instance is re-probed soon (doubling), a healthy one every interval.
        delay = self.interval_s
        if st.consecutive_failures:
            delay = doubled(self.probe_s, st.consecutive_failures - 1, self.interval_s)
        self._due[instance_id] = time.monotonic() + delay

    async def poll_once(self, instance_ids: list[str] | None = None) -> None:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        ids = list(self.targets) if instance_ids is None else instance_ids
        for iid in ids:  # not due again while this poll runs
            self._due[iid] = float("inf")
        await asyncio.gather(*(self._poll(iid, self.targets[iid]) for iid in ids))

    async def _poll(self, instance_id: str, url: str) -> None:
        st = self.state[instance_id]
        try:
            await self._poll_one(instance_id, url, st)
        finally:
            if self._due.get(instance_id) == float("inf"):  # probe_now during the poll wins
                self._schedule(instance_id, st)

    async def _poll_one(self, instance_id: str, url: str, st: PollState) -> None:
        import aiohttp

        st.polls += 1
        try:
            sample = await self._fetch(url)
        except (aiohttp.ClientError, asyncio.TimeoutError, EngineMetricsError, UnicodeDecodeError) as exc:
            self._failed(instance_id, st, f"{type(exc).__name__}: {exc}")
            return
        except Exception as exc:  # an odd peer must not stop polling
            log.exception("engine metrics: unexpected error instance=%s", instance_id)
            self._failed(instance_id, st, f"{type(exc).__name__}: {exc}")
            return
        if st.ok is False:
            log.info("engine metrics: recovered instance=%s", instance_id)
        count, waiting = sample.requests, sample.waiting
        st.ok = True
        st.consecutive_failures = 0
        if self.on_tpot is not None:
            self._learn(self.on_tpot, instance_id, self._itl.update(instance_id, sample))
        if self.on_retrieve is not None:
            self._learn(self.on_retrieve, instance_id, self._retrieves.update(instance_id, sample))
        st.engine_requests = count
        st.last_ok = time.monotonic()
        # Bounded slices (a poll after many lost done reports heals thousands), yielding between.
        healed = self.load.reconcile(instance_id, count, grace_s=self.grace_s, engine_waiting=waiting,
                                     budget=RECONCILE_SLICE)
        while self.load.reconcile_left:
            await asyncio.sleep(0)
            healed += self.load.reconcile(instance_id, count, grace_s=self.grace_s, engine_waiting=waiting,
                                          budget=RECONCILE_SLICE)
        if healed:
            st.healed += healed
            log.info("engine metrics: healed lost done reports instance=%s released=%d engine_requests=%d",
                     instance_id, healed, count)
        self._notify(instance_id, True)

    @staticmethod
    def _learn(callback: Callable[..., None], instance_id: str, got: tuple[float, ...] | None) -> None:
        if got is None:
            return
        try:
            callback(instance_id, *got)
        except Exception:
            log.exception("engine metrics: price callback failed instance=%s", instance_id)

    async def _fetch(self, url: str) -> EngineSample:
        assert self._session is not None
        async with self._session.get(url) as resp:
            if resp.status != 200:
                raise EngineMetricsError(f"HTTP {resp.status}")
            body = await resp.content.read(MAX_BODY_BYTES + 1)
            if len(body) > MAX_BODY_BYTES:
                raise EngineMetricsError(f"body larger than {MAX_BODY_BYTES} bytes")
        return parse_engine_metrics(body.decode("utf-8"))

    def _failed(self, instance_id: str, st: PollState, error: str) -> None:
        st.failures += 1
        st.consecutive_failures += 1
        st.last_error = error[:300]
        if st.ok is not False:
            log.warning("engine metrics: poll failed instance=%s error=%s", instance_id, st.last_error)
        st.ok = False
        self._notify(instance_id, False)

    def _notify(self, instance_id: str, ok: bool) -> None:
        if self.on_result is not None:
            try:
                self.on_result(instance_id, ok)
            except Exception:
                log.exception("engine metrics: result callback failed instance=%s", instance_id)

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await session.close()

    async def close(self) -> None:
        self._closing = True
        await cancel_and_wait(self._task)
        await self._close_session()
