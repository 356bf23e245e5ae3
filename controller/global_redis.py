"""Global tier view for LMCache's Redis backend: keyspace notifications + SCAN reconciliation.

Redis pub/sub is fire-and-forget (no sequence numbers, no replay) and FLUSHALL /
FLUSHDB / a restart emit no per-key events, so notifications only keep the view
fresh between periodic SCAN reconciliations, which are the source of truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from smetric_lmc.backoff import Backoff
from smetric_lmc.controller.global_common import GlobalTierView, Transition, TransitionBatch
from smetric_lmc.controller.lmcache_keys import REDIS_SUFFIXES, ChunkPresence, GlobalTierSink
from smetric_lmc.controller.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Keyevent names after which the key exists / no longer exists in this db.
# "expire" (TTL set) and "persist" leave the key in place, so they are ignored.
_ADD_EVENTS = frozenset(
    {"set", "setrange", "append", "incrby", "incrbyfloat", "rename_to", "move_to", "copy_to", "restore"}
)
_REMOVE_EVENTS = frozenset({"del", "expired", "evicted", "rename_from", "move_from"})
_KEYEVENT_RE = re.compile(r"__keyevent@(\d+)__:(.+)\Z")

# K/E select the channel families; g = generic (del, expired, rename...), $ = string
# commands (set), x = expired, e = evicted. We only listen on keyevent (E).
_REQUIRED_FLAGS = "Eg$xe"

Action = Literal["add", "remove"]


def _text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, (bytes, bytearray)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def keyevent_action(channel: str | bytes) -> Action | None:
    """``"add"`` / ``"remove"`` for a ``__keyevent@<db>__:<event>`` channel, None if irrelevant."""
    text = _text(channel)
    m = _KEYEVENT_RE.match(text) if text is not None else None
    if m is None:
        return None
    event = m.group(2)
    if event in _ADD_EVENTS:
        return "add"
    if event in _REMOVE_EVENTS:
        return "remove"
    return None


def apply_keyevent(
    presence: ChunkPresence, channel: str | bytes, key: str | bytes
) -> tuple[Transition, int] | None:
    """Apply one notification to ``presence``; returns the chunk transition it caused.

    A chunk disappears when EITHER of its two keys goes (allkeys-lru evicts the
    halves independently) and appears when the second one is written.
    """
    action = keyevent_action(channel)
    if action == "add":
        chunk = presence.add(key)
        return ("stored", chunk) if chunk is not None else None
    if action == "remove":
        chunk = presence.remove(key)
        return ("removed", chunk) if chunk is not None else None
    return None


def scan_pattern(model: str) -> str:
    """SCAN MATCH pattern for one model's keys (glob metacharacters escaped)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", model) + "@*"


def merged_notify_flags(current: str) -> str:
    """``current`` notify-keyspace-events flags plus what this adapter needs."""
    have = set(current)
    if "A" in have:  # alias for g$lshzxetd...: covers g $ x e
        have |= set("g$xe")
    missing = [c for c in _REQUIRED_FLAGS if c not in have]
    return current + "".join(missing)


class RedisGlobalTier(GlobalTierView):
    """Keeps ``sink`` informed of which LMCache chunks of ``model`` are complete in Redis.

    Start with ``asyncio.create_task(tier.run())``; stop with ``await tier.close()``.
    ``run`` never raises on peer trouble: a down Redis sets ``available`` False,
    empties the sink (when ``clear_on_outage``), and is retried with backoff.
    """

    def __init__(
        self,
        url: str,
        sink: GlobalTierSink,
        *,
        model: str,
        world_size: int = 1,
        reconcile_interval_s: float = 30.0,
        suffixes: tuple[str, ...] = REDIS_SUFFIXES,
        num_layers: int | None = None,
        clear_on_outage: bool = True,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        scan_count: int = 1000,
    ) -> None:
        super().__init__(
            sink,
            model=model,
            world_size=world_size,
            suffixes=suffixes,
            num_layers=num_layers,
            clear_on_outage=clear_on_outage,
            counters=(
                "connects", "connection_errors", "config_refused", "notifications", "notifications_ignored",
                "bad_messages", "reconciles", "reconcile_errors", "sink_errors", "stored", "removed",
                "last_scan_keys", "last_scan_bad_keys",
            ),
        )
        self.url = url
        self.reconcile_interval_s = reconcile_interval_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._connect_timeout_s = connect_timeout_s
        self._scan_count = scan_count
        self._closing = False
        self._reconcile_requested = False
        self._session_connected = False
        self._task: asyncio.Task[None] | None = None
        self._client: aioredis.Redis | None = None
        self._db = int(parse_url(url).get("db", 0) or 0)  # ValueError on a malformed URL: a config error

    def request_reconcile(self) -> None:
        """Reconcile at the next loop turn instead of waiting for the interval."""
        self._reconcile_requested = True

    async def run(self) -> None:
        self._task = asyncio.current_task()
        backoff = Backoff(self._backoff_initial_s, self._backoff_max_s)
        try:
            while not self._closing:
                self._session_connected = False
                try:
                    await self._session()
                except (RedisError, OSError, asyncio.TimeoutError) as e:
                    self._counters["connection_errors"] += 1
                    # One warning per outage; the retries while it lasts go to debug.
                    first = self._session_connected or backoff.at_first
                    level = logging.WARNING if first else logging.DEBUG
                    log.log(level, "redis global tier %s: %s: %s", self.url, type(e).__name__, e)
                except Exception:
                    # A bug here must not take the controller down; keep retrying.
                    self._counters["connection_errors"] += 1
                    log.exception("redis global tier %s: unexpected error", self.url)
                finally:
                    await self._drop_client()
                if self._closing:
                    break
                self._set_unavailable(f"redis global tier {self.url} unavailable")
                if self._session_connected:
                    # The connection had worked: restart the backoff from its shortest step.
                    backoff.reset()
                await asyncio.sleep(backoff.next())
        except asyncio.CancelledError:
            if not self._closing:
                raise
        finally:
            self._available = False

    async def close(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await self._drop_client()

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _session(self) -> None:
        """Connect, subscribe, reconcile, then follow notifications until an error or close."""
        # No silent retries: a reconnect inside redis-py would hide the gap in the
        # notification stream, and every gap must be followed by a reconciliation.
        client = aioredis.Redis.from_url(
            self.url,
            socket_connect_timeout=self._connect_timeout_s,
            socket_timeout=max(10.0, self._connect_timeout_s),
            retry=Retry(NoBackoff(), 0),
        )
        self._client = client
        await client.ping()
        await self._enable_notifications(client)
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.psubscribe(f"__keyevent@{self._db}__:*")
            await self._reconcile(client)
            self._counters["connects"] += 1
            self._available = True
            self._session_connected = True
            log.info("redis global tier %s connected (db %d)", self.url, self._db)
            next_reconcile = time.monotonic() + self.reconcile_interval_s
            while not self._closing:
                wait = min(0.25, max(0.0, next_reconcile - time.monotonic()))
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
                if msg is not None:
                    batch = [msg]
                    # Drain what is already buffered so the sink gets batches, not single calls.
                    while len(batch) < 4096:
                        more = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
                        if more is None:
                            break
                        batch.append(more)
                    self._apply_messages(batch)
                if self._reconcile_requested or time.monotonic() >= next_reconcile:
                    self._reconcile_requested = False
                    await self._reconcile(client)
                    next_reconcile = time.monotonic() + self.reconcile_interval_s
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def _enable_notifications(self, client: aioredis.Redis) -> None:
        try:
            raw = await client.config_get("notify-keyspace-events")
            current = ""
            for k, v in raw.items():
                if _text(k) == "notify-keyspace-events":
                    current = _text(v) or ""
            wanted = merged_notify_flags(current)
            if wanted != current:
                await client.config_set("notify-keyspace-events", wanted)
                log.info("redis %s: notify-keyspace-events %r -> %r", self.url, current, wanted)
        except ResponseError as e:
            # Managed Redis often disables CONFIG; notifications may still be on,
            # and reconciliation covers us if they are not.
            self._counters["config_refused"] += 1
            log.warning("redis %s refused CONFIG for keyspace notifications (%s); relying on SCAN", self.url, e)

    def _apply_messages(self, batch: list[Any]) -> None:
        transitions = TransitionBatch(self._emit)
        for msg in batch:
            if not isinstance(msg, dict) or msg.get("type") != "pmessage":
                self._counters["bad_messages"] += 1
                continue
            self._counters["notifications"] += 1
            change = apply_keyevent(self._presence, msg.get("channel", b""), msg.get("data", b""))
            if change is None:
                self._counters["notifications_ignored"] += 1
                continue
            transitions.add(*change)
        transitions.flush()

    async def _reconcile(self, client: aioredis.Redis) -> None:
        """Rebuild from SCAN. Notifications that arrive meanwhile stay buffered in the
        subscriber socket and are applied afterwards, which is correct because each
        one states the key's existence after the command that produced it."""
        fresh = self._new_presence()
        n = 0
        try:
            async for key in client.scan_iter(match=scan_pattern(self.model), count=self._scan_count):
                fresh.add(key)
                n += 1
        except (RedisError, OSError, asyncio.TimeoutError):
            self._counters["reconcile_errors"] += 1
            raise
        self._counters["reconciles"] += 1
        self._counters["last_scan_keys"] = n
        self._counters["last_scan_bad_keys"] = fresh.bad_keys
        self._adopt(fresh)
        self._call_sink(self._sink.global_reset, fresh.present())
