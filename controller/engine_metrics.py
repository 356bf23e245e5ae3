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
#: vLLM's /metrics is ~100 KiB; anything far larger is not an engine we understand.
MAX_BODY_BYTES = 8 << 20
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


def parse_engine_metrics(text: str) -> EngineSample:
    """The request gauges (required) and the inter-token latency histogram (when exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    itl: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in (RUNNING, WAITING):
                for sample in family.samples:
                    if sample.name == family.name:
                        totals[family.name] = totals.get(family.name, 0.0) + sample.value
            elif family.name in ITL and not itl.keys() - {family.name + "_sum", family.name + "_count"}:
                for sample in family.samples:  # the first of the two names present is read
                    if sample.name in (family.name + "_sum", family.name + "_count"):
                        itl[sample.name] = itl.get(sample.name, 0.0) + sample.value
    except (ValueError, TypeError, IndexError) as exc:  # the parser's ways of saying "not Prometheus text"
        raise EngineMetricsError(f"unparsable metrics: {exc}") from None
    if not totals:
        raise EngineMetricsError(f"neither {RUNNING} nor {WAITING} present")
    for v in totals.values():
        if v != v or v < 0:  # NaN or negative: an engine would never report that
            raise EngineMetricsError(f"invalid request count {v}")
    waiting = totals.get(WAITING)
    isum = next((v for k, v in itl.items() if k.endswith("_sum")), None)
    icount = next((v for k, v in itl.items() if k.endswith("_count")), None)
    if isum is None or icount is None or not (isum >= 0 and icount >= 0):  # a half or a NaN: ignored
        isum = icount = None
    return EngineSample(int(round(sum(totals.values()))), None if waiting is None else int(round(waiting)),
                        totals.get(RUNNING), isum, icount)


def parse_engine_counts(text: str) -> tuple[int, int | None]:
    """(running + waiting, waiting) requests in a vLLM ``/metrics`` body; waiting None if absent."""
    s = parse_engine_metrics(text)
    return s.requests, s.waiting


class ItlDeltas:
    """Per instance, the mean time per output token since the previous poll (the histogram's delta
    sum / delta count) and the running requests then: what ``PriceBook.observe_tpot`` learns from.
    A counter that went backwards (the engine restarted) only resets the baseline."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}

    def update(self, instance_id: str, s: EngineSample) -> tuple[float, float] | None:
        if s.itl_sum_s is None or s.itl_count is None or s.running is None:
            return None
        prev = self._last.get(instance_id)
        self._last[instance_id] = (s.itl_sum_s, s.itl_count)
        if prev is None:
            return None
        d_sum, d_count = s.itl_sum_s - prev[0], s.itl_count - prev[1]
        if d_count <= 0 or d_sum <= 0:
            return None
        return d_sum / d_count, s.running

    def forget(self, instance_id: str) -> None:
        self._last.pop(instance_id, None)


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
        self._itl = ItlDeltas()
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
            got = self._itl.update(instance_id, sample)
            if got is not None:
                try:
                    self.on_tpot(instance_id, *got)
                except Exception:
                    log.exception("engine metrics: tpot callback failed instance=%s", instance_id)
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
