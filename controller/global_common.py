"""What the Redis and Mooncake global-tier views share: the chunk presence view and how its
changes reach the index sink."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal

from smetric_lmc.controller.lmcache_keys import ChunkPresence, GlobalTierSink

Transition = Literal["stored", "removed"]


class TransitionBatch:
    """Collects chunk transitions and hands each run of one direction to ``emit`` as one call.

    A run is flushed whenever the direction changes, so the sink sees the transitions in the
    order they happened even though it gets them in batches.
    """

    def __init__(self, emit: Callable[[Transition, list[int]], None]) -> None:
        self._emit = emit
        self._kind: Transition = "stored"
        self._chunks: list[int] = []

    def add(self, kind: Transition, chunk: int) -> None:
        if kind != self._kind and self._chunks:
            self.flush()
        self._kind = kind
        self._chunks.append(chunk)

    def flush(self) -> None:
        if self._chunks:
            chunks, self._chunks = self._chunks, []
            self._emit(self._kind, chunks)


class GlobalTierView:
    """Base of the global tiers: the presence view of ``model``'s complete chunks and the sink.

    Subclasses own the connection to the store and call ``_emit`` / ``_adopt`` /
    ``_set_unavailable`` as the store reports changes; the sink is never allowed to raise
    into them (its errors are counted in ``sink_errors``).
    """

    def __init__(
        self,
        sink: GlobalTierSink,
        *,
        model: str,
        world_size: int,
        suffixes: tuple[str, ...],
        num_layers: int | None,
        clear_on_outage: bool,
        counters: Iterable[str],
    ) -> None:
        self._sink = sink
        self.model = model
        self.world_size = world_size
        self._suffixes = suffixes
        self._num_layers = num_layers
        self._presence = self._new_presence()
        self._clear_on_outage = clear_on_outage
        self._available = False
        self._counters: dict[str, int] = dict.fromkeys(counters, 0)
        # Log under the concrete tier's module so its messages keep their logger name.
        self._log = logging.getLogger(type(self).__module__)

    def _new_presence(self) -> ChunkPresence:
        return ChunkPresence(self.model, self.world_size, suffixes=self._suffixes, num_layers=self._num_layers)

    @property
    def available(self) -> bool:
        return self._available

    @property
    def stats(self) -> dict[str, Any]:
        return {**self._counters, **self._presence.stats(), "available": self._available}

    def present(self) -> set[int]:
        return self._presence.present()

    def _adopt(self, fresh: ChunkPresence) -> None:
        """Replace the view with a freshly listed one; the bad/foreign key tallies keep counting."""
        fresh.bad_keys = self._presence.bad_keys
        fresh.foreign_keys = self._presence.foreign_keys
        self._presence = fresh

    def _set_unavailable(self, what: str) -> None:
        if not self._available:
            return
        self._available = False
        self._log.warning("%s; routing without it until it returns", what)
        if self._clear_on_outage:
            self._presence.clear()
            self._call_sink(self._sink.global_reset, ())

    def _emit(self, kind: Transition, chunks: list[int]) -> None:
        if kind == "stored":
            self._counters["stored"] += len(chunks)
            self._call_sink(self._sink.global_stored, chunks)
        else:
            self._counters["removed"] += len(chunks)
            self._call_sink(self._sink.global_removed, chunks)

    def _call_sink(self, fn: Callable[[Iterable[int]], None], chunks: Iterable[int]) -> None:
        try:
            fn(chunks)
        except Exception:
            self._counters["sink_errors"] += 1
            self._log.exception("global tier sink raised")
