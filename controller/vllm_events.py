"""Local-tier ingest: one subscriber per vLLM engine mirrors its KV-event stream into the index.

The wire format and its decoders are ``vllm_wire``; turning a decoded batch into index operations
is ``vllm_plan``. This module receives (ZMQ SUB), detects sequence gaps and engine restarts, and
replays: a DEALER sends ``[b"", start_seq u64 BE]`` to the engine's ROUTER and receives
``[b"", topic, seq, payload]`` per buffered batch, then ``[b"", b"", 0xff..ff, b""]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from smetric_lmc.controller.offload import OFFLOAD_BYTES
from smetric_lmc.controller.tasks import LoopBudget, cancel_and_wait
from smetric_lmc.controller.vllm_plan import (
    GpuBlockSink,
    Op,
    Planned,
    add_counts,
    cut_op,
    plan_payload,
    run_op,
)
from smetric_lmc.controller.vllm_wire import (
    END_SEQ,
    peek_event_count,
)

if TYPE_CHECKING:
    from smetric_lmc.controller.offload import OffloadWorker

log = logging.getLogger(__name__)

#: Batches received between two yields to the other tasks on the loop.
LOOP_BUDGET = LoopBudget()
#: Applying one large batch yields on time alone (its slices are already bounded in size).
SLICE_BUDGET = LoopBudget(items=1 << 62, nbytes=1 << 62, seconds=LOOP_BUDGET.seconds)
#: Stores and removals larger than this are applied in slices, with loop turns between them.
SLICE_BLOCKS = 4096


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
        # A queued batch is returned without a trip through the event loop: a backlog would
        # otherwise hold the loop until it is drained.
        meter = LOOP_BUDGET.meter()
        nbytes = 0
        try:
            if self._resume:
                await self._catch_up()
            while not self._closing:
                if meter.spend(nbytes):  # no coroutine per batch: this runs for every one
                    await asyncio.sleep(0)
                    meter.reset()
                nbytes = 0
                try:
                    frames = await self._sub.recv_multipart()
                except zmq.ZMQError:
                    if self._closing:
                        return
                    log.exception("vLLM events %s: receive failed", self.instance_id)
                    await asyncio.sleep(0.1)
                    continue
                nbytes = len(frames[-1]) if frames else 0
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
        the loop a turn whenever ``SLICE_BUDGET``'s time has passed (a legal 65,536-block store is
        far more index work than one turn should hold). This subscriber applies nothing else meanwhile, so the engine's
        order holds; a route meanwhile sees the first part of the batch, as if vLLM had sent it
        as several events. A snapshot taken meanwhile records the batch before as its position,
        and a restart replays this one whole (stores are idempotent)."""
        sink, iid = self._sink, self.instance_id
        meter = SLICE_BUDGET.meter()
        for op in ops:
            for piece in cut_op(op, SLICE_BLOCKS):
                run_op(piece, sink, iid)
                if meter.spend():
                    await asyncio.sleep(0)
                    meter.reset()

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
