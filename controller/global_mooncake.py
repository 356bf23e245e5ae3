"""Global tier view for LMCache's Mooncake Store backend: master KV events + reconciliation.

The master publishes KV events only when built with ``-DENABLE_KV_EVENTS=ON``
(the PyPI wheel's master is not: it accepts ``--enable_kv_events`` but binds
nothing), and bulk removes or a client that dies with its segment publish
nothing. So events only keep the view fresh; periodic reconciliation is the
source of truth: the master's admin ``GET /get_all_keys`` listing when
reachable, otherwise ``batch_is_exist`` through a store client on the keys
believed present.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from smetric_lmc.backoff import Backoff
from smetric_lmc.controller.global_common import GlobalTierView, TransitionBatch
from smetric_lmc.controller.lmcache_keys import BARE_SUFFIXES, GlobalTierSink
from smetric_lmc.controller.tasks import cancel_and_wait

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 * 1024 * 1024
_LEGACY_TYPES = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}


class ExistenceProbe(Protocol):
    """The part of ``mooncake.store.MooncakeDistributedStore`` reconciliation uses."""

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...


def open_store_probe(
    master_addr: str, metadata_server: str, *, local_hostname: str = "127.0.0.1", protocol: str = "tcp"
) -> ExistenceProbe:
    """A Mooncake store client that contributes no memory, only for ``batch_is_exist``.

    Needs the ``mooncake`` extra (``mooncake-transfer-engine-non-cuda``). The caller
    owns it and should ``close()`` it after the tier is closed.
    """
    from mooncake.store import MooncakeDistributedStore  # optional dependency

    store = MooncakeDistributedStore()
    rc = store.setup(local_hostname, metadata_server, 0, 0, protocol, "", master_addr)
    if rc != 0:
        raise RuntimeError(f"mooncake store client setup failed (rc={rc}) for master {master_addr}")
    return store  # type: ignore[no-any-return]


class MooncakeGlobalTier(GlobalTierView):
    """Keeps ``sink`` informed of which LMCache chunks of ``model`` are complete in Mooncake Store.

    ``events_endpoint``: the master's ``--kv_events_bind_endpoint`` (ZMQ PUB).
    ``master_http_url``: the master's admin HTTP (``--metrics_port``), e.g. ``http://127.0.0.1:9003``.
    ``store``: an already set-up store client used for ``batch_is_exist`` when no listing is available.
    Start with ``asyncio.create_task(tier.run())``; stop with ``await tier.close()``.
    """

    def __init__(
        self,
        sink: GlobalTierSink,
        *,
        model: str,
        world_size: int = 1,
        events_endpoint: str | None,
        master_http_url: str | None,
        reconcile_interval_s: float = 30.0,
        store: ExistenceProbe | None = None,
        open_store: Callable[[], ExistenceProbe] | None = None,
        num_layers: int | None = None,
        clear_on_outage: bool = True,
        http_timeout_s: float = 5.0,
        probe_batch: int = 1024,
        backoff_max_s: float = 5.0,
    ) -> None:
        super().__init__(
            sink,
            model=model,
            world_size=world_size,
            suffixes=BARE_SUFFIXES,
            num_layers=num_layers,
            clear_on_outage=clear_on_outage,
            counters=(
                "messages", "events", "bad_frames", "bad_events", "unknown_events", "seq_gaps",
                "seq_restarts", "reconciles", "reconcile_errors", "http_errors", "probe_errors",
                "zmq_errors", "sink_errors", "stored", "removed", "cleared", "last_listing_keys",
            ),
        )
        self.events_endpoint = events_endpoint
        self.master_http_url = master_http_url.rstrip("/") if master_http_url else None
        self.reconcile_interval_s = reconcile_interval_s
        self._store = store
        self._open_store = open_store  # opened off the loop when run() starts (a blocking C++ setup)
        self._http_timeout_s = http_timeout_s
        self._probe_batch = probe_batch
        self._backoff_max_s = backoff_max_s
        self._closing = False
        self._last_seq: int | None = None
        self._reconciling = False
        self._reconcile_lock = asyncio.Lock()
        self._pending: list[list[Any]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._decoder = msgspec.msgpack.Decoder()
        self.master_kv_events: bool | None = None  # what the master's /kv_events/status says

    @property
    def stats(self) -> dict[str, Any]:
        return {**super().stats, "last_seq": self._last_seq, "master_kv_events": self.master_kv_events}

    @property
    def _can_reconcile(self) -> bool:
        return self.master_http_url is not None or self._store is not None

    def request_reconcile(self) -> None:
        self._wake.set()

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def run(self) -> None:
        self._task = asyncio.current_task()
        if self._store is None and self._open_store is not None:
            try:
                self._store = await asyncio.to_thread(self._open_store)
                log.info("mooncake global tier for %s: store client up for batch_is_exist", self.model)
            except Exception as exc:  # noqa: BLE001 - a peer's failure: log, count, go on without it
                self._counters["probe_errors"] += 1
                log.error("mooncake global tier for %s: store client setup failed (%s): no batch_is_exist "
                          "reconciliation", self.model, exc)
        loops = []
        if self.events_endpoint:
            loops.append(self._events_loop())
        if self._can_reconcile:
            loops.append(self._reconcile_loop())
        if not loops:
            log.warning("mooncake global tier for %s has neither events nor a reconcile source", self.model)
            return
        try:
            await asyncio.gather(*loops)
        except asyncio.CancelledError:
            if not self._closing:
                raise
        finally:
            self._available = False
            if self._http is not None:
                await self._http.close()
                self._http = None

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self._open_store is not None and self._store is not None:  # ours: opened in run()
            store, self._store = self._store, None
            close = getattr(store, "close", None)
            if close is not None:
                await asyncio.to_thread(close)

    # ---- events --------------------------------------------------------------------------------------

    async def _events_loop(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        backoff = Backoff(0.1, max(0.1, self._backoff_max_s))
        while not self._closing:
            sock = ctx.socket(zmq.SUB)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                # Oversize messages make ZMQ drop the peer's connection instead of buffering them.
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(self.events_endpoint)  # type: ignore[arg-type]
                while not self._closing:
                    frames = await sock.recv_multipart(copy=True)
                    self.handle_message(frames)
                    backoff.reset()
            except zmq.ZMQError as e:
                self._counters["zmq_errors"] += 1
                log.warning("mooncake events %s: %s", self.events_endpoint, e)
                await asyncio.sleep(backoff.next())
            finally:
                sock.close(linger=0)

    def handle_message(self, frames: Sequence[bytes]) -> None:
        """Apply one PUB message ``[topic, seq u64 BE, msgpack [ts, [events], dp_rank]]``; never raises."""
        events = self._decode(frames)
        if events is None:
            return
        self._counters["messages"] += 1
        seq = int.from_bytes(frames[1], "big")
        if self._last_seq is not None and seq != self._last_seq + 1:
            if seq <= self._last_seq:
                # Counter went back: the master restarted and lost its objects.
                self._counters["seq_restarts"] += 1
                log.warning("mooncake events seq %d after %d: master restarted", seq, self._last_seq)
            else:
                self._counters["seq_gaps"] += 1
                log.warning("mooncake events gap: seq %d after %d", seq, self._last_seq)
            self._resync()
        self._last_seq = seq
        if not self._can_reconcile:
            self._available = True
        if self._reconciling:
            self._pending.append(events)
        else:
            self._apply_events(events)

    def _decode(self, frames: Sequence[bytes]) -> list[Any] | None:
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ValueError(f"expected [topic, 8-byte seq, payload], got {len(frames)} frames")
            payload = self._decoder.decode(frames[2])
            if not isinstance(payload, list) or len(payload) < 2 or not isinstance(payload[1], list):
                raise ValueError("payload is not [timestamp, [events], ...]")
        except (ValueError, TypeError, msgspec.DecodeError) as e:
            self._counters["bad_frames"] += 1
            log.debug("dropping bad mooncake event message: %s", e)
            return None
        return payload[1]

    def _resync(self) -> None:
        if self._can_reconcile:
            self.request_reconcile()
        else:
            log.warning("mooncake events lost and no reconcile source configured; view may be stale")

    def _apply_events(self, events: Iterable[Any]) -> None:
        transitions = TransitionBatch(self._emit)
        for ev in events:
            self._counters["events"] += 1
            if not isinstance(ev, dict):
                self._counters["bad_events"] += 1
                continue
            kind = ev.get("event_type")
            if not isinstance(kind, str):
                kind = _LEGACY_TYPES.get(ev.get("type"))  # type: ignore[arg-type]
            if kind == "cleared":
                transitions.flush()
                self._counters["cleared"] += 1
                self._presence.clear()
                self._call_sink(self._sink.global_reset, ())
                continue
            key = ev.get("object_key")
            if kind not in ("stored", "removed"):
                self._counters["unknown_events"] += 1
                continue
            if not isinstance(key, str):
                self._counters["bad_events"] += 1
                continue
            chunk = self._presence.add(key) if kind == "stored" else self._presence.remove(key)
            if chunk is not None:
                transitions.add(kind, chunk)
        transitions.flush()

    # ---- reconciliation ------------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        backoff = Backoff(0.2, max(0.2, self._backoff_max_s))
        while not self._closing:
            self._wake.clear()
            ok = await self.reconcile()
            if ok:
                backoff.reset()
                delay = self.reconcile_interval_s
            else:
                delay = min(backoff.next(), self.reconcile_interval_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)

    async def reconcile(self) -> bool:
        """One reconciliation pass; True if the store answered. Never raises on peer errors."""
        async with self._reconcile_lock:
            return await self._reconcile_locked()

    async def _reconcile_locked(self) -> bool:
        self._reconciling = True
        try:
            if self.master_http_url is not None:
                keys = await self._list_keys()
                if keys is not None:
                    fresh = self._new_presence()
                    fresh.reset(keys)
                    self._adopt(fresh)
                    self._counters["last_listing_keys"] = len(keys)
                    return self._reconciled()
            if self._store is not None and await self._probe():
                return self._reconciled()
            self._counters["reconcile_errors"] += 1
            self._set_unavailable("mooncake global tier unreachable")
            return False
        finally:
            self._reconciling = False
            pending, self._pending = self._pending, []
            for events in pending:
                self._apply_events(events)

    def _reconciled(self) -> bool:
        self._counters["reconciles"] += 1
        if not self._available:
            log.info("mooncake global tier for %s available", self.model)
        self._available = True
        self._call_sink(self._sink.global_reset, self._presence.present())
        return True

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._http_timeout_s))
        return self._http

    async def _list_keys(self) -> list[str] | None:
        url = f"{self.master_http_url}/get_all_keys"
        try:
            async with self._session().get(url) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                body = await resp.read()
            if self.master_kv_events is None and self.events_endpoint:
                await self._check_master_events()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._counters["http_errors"] += 1
            # One warning per outage; repeated failures while it lasts go to debug.
            first = self._available or self._counters["http_errors"] == 1
            log.log(logging.WARNING if first else logging.DEBUG,
                    "mooncake master %s: %s", url, e or type(e).__name__)
            return None
        text = body.decode("utf-8", errors="replace")
        return [line for line in text.splitlines() if line]

    async def _check_master_events(self) -> None:
        url = f"{self.master_http_url}/kv_events/status"
        try:
            async with self._session().get(url) as resp:
                status = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return
        if isinstance(status, dict) and isinstance(status.get("enabled"), bool):
            self.master_kv_events = status["enabled"]
            if not self.master_kv_events:
                log.warning(
                    "mooncake master at %s publishes no KV events (not built with ENABLE_KV_EVENTS "
                    "or not enabled); the global view is refreshed only every %.0fs",
                    self.master_http_url, self.reconcile_interval_s,
                )

    async def _probe(self) -> bool:
        """batch_is_exist on every key believed present; drops the ones that are gone."""
        assert self._store is not None
        keys = list(self._presence.keys())
        gone: list[str] = []
        for i in range(0, len(keys), self._probe_batch):
            batch = keys[i : i + self._probe_batch]
            try:
                # The store client is blocking C++; keep it off the event loop.
                results = await asyncio.to_thread(self._store.batch_is_exist, batch)
            except Exception as e:
                self._counters["probe_errors"] += 1
                log.warning("mooncake batch_is_exist failed: %s", e)
                return False
            if not isinstance(results, list) or len(results) != len(batch):
                self._counters["probe_errors"] += 1
                return False
            for key, r in zip(batch, results, strict=True):
                if r == 0:
                    gone.append(key)
                elif r != 1:
                    self._counters["probe_errors"] += 1  # unknown: keep believing it
        for key in gone:
            self._presence.remove(key)
        return True

