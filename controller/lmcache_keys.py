"""LMCache 0.5.6 object keys as they appear in a global KV store, and chunk presence.

LMCache names every stored chunk ``model@world_size@worker_id@{chunk_hash:x}@dtype``
(``CacheEngineKey.to_string``), optionally followed by ``@layer_id`` (layerwise
``LayerCacheEngineKey``) and ``@tag%value`` request tags. The hex is Python's ``:x``:
lowercase, unpadded, ``-`` for negative hashes. Store connectors may append a
suffix: LMCache's ``redis://`` connector writes two keys per chunk,
``<key>kv_bytes`` and ``<key>metadata``; Mooncake, ``resp://`` and Valkey write the
bare key.

A chunk is usable from the global tier only when every tensor-parallel shard
(``worker_id`` in ``range(world_size)``), every layer (layerwise mode) and every
suffix is present; :class:`ChunkPresence` turns per-key add/remove into per-chunk
appear/disappear transitions.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

REDIS_SUFFIXES: tuple[str, ...] = ("kv_bytes", "metadata")
"""Key suffixes of LMCache's ``redis://`` (RedisConnector / Sentinel / Cluster) layout."""
BARE_SUFFIXES: tuple[str, ...] = ("",)
"""Mooncake Store, ``resp://`` and Valkey connectors store one bare key per chunk."""

# dtype names LMCache 0.5.6 writes (TORCH_DTYPE_TO_STR_DTYPE, fp8 variants included).
LMCACHE_DTYPES: frozenset[str] = frozenset(
    {
        "half", "bfloat16", "float", "double", "int8", "uint8", "int16", "int32", "int64", "bool",
        "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2", "fp8_e5m2fnuz",
    }
)

# Strict on purpose: int(x, 16) would also accept "0x1f", " 1f" or "1_f", which
# LMCache never writes, and exact round-tripping lets reconciliation re-derive keys.
_HEX_RE = re.compile(r"(?:0|-?[1-9a-f][0-9a-f]*)\Z")
_DEC_RE = re.compile(r"(?:0|[1-9][0-9]*)\Z")


class GlobalTierSink(Protocol):
    """Receiver of global-tier chunk presence (implemented by the index)."""

    def global_stored(self, chunk_hashes: Iterable[int]) -> None: ...

    def global_removed(self, chunk_hashes: Iterable[int]) -> None: ...

    def global_reset(self, chunk_hashes: Iterable[int]) -> None:
        """``chunk_hashes`` is the complete current set; anything else is gone."""
        ...


@dataclass(frozen=True, slots=True)
class LMCacheKey:
    model: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str
    layer_id: int | None = None
    tags: tuple[tuple[str, str], ...] = ()
    suffix: str = ""


def format_key(
    model: str,
    world_size: int,
    worker_id: int,
    chunk_hash: int,
    dtype: str,
    *,
    layer_id: int | None = None,
    tags: Iterable[tuple[str, str]] = (),
    suffix: str = "",
) -> str:
    """The exact string LMCache 0.5.6 writes for this chunk (plus a store suffix)."""
    s = f"{model}@{world_size}@{worker_id}@{chunk_hash:x}@{dtype}"
    if layer_id is not None:
        s += f"@{layer_id}"
    tag_list = list(tags)
    if tag_list:
        s += "@" + "@".join(f"{k}%{v}" for k, v in tag_list)
    return s + suffix


def key_to_string(key: LMCacheKey) -> str:
    return format_key(
        key.model, key.world_size, key.worker_id, key.chunk_hash, key.dtype,
        layer_id=key.layer_id, tags=key.tags, suffix=key.suffix,
    )


def parse_key(raw: str | bytes, suffixes: tuple[str, ...] = BARE_SUFFIXES) -> LMCacheKey | None:
    """Parse one store key; ``None`` for anything LMCache would not have written.

    ``suffixes`` lists the store suffixes to accept ("" = bare key). Longer
    suffixes are tried first so that "" never shadows a real one.
    """
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(raw, str):
        return None
    for suffix in sorted(suffixes, key=len, reverse=True):
        if raw.endswith(suffix):
            body = raw[: len(raw) - len(suffix)] if suffix else raw
            parsed = _parse_body(body, suffix)
            if parsed is not None:
                return parsed
    return None


def _parse_body(body: str, suffix: str) -> LMCacheKey | None:
    parts = body.split("@")
    if len(parts) < 5:
        return None
    model, ws, wid, hx, dtype = parts[:5]
    if not model or dtype not in LMCACHE_DTYPES:
        return None
    if not (_DEC_RE.match(ws) and _DEC_RE.match(wid) and _HEX_RE.match(hx)):
        return None
    world_size, worker_id = int(ws), int(wid)
    if world_size < 1 or worker_id >= world_size:
        return None
    rest = parts[5:]
    layer_id: int | None = None
    # Same rule as LMCache's parse_cache_key: a bare number right after dtype is a layer id.
    if rest and _DEC_RE.match(rest[0]):
        layer_id = int(rest[0])
        rest = rest[1:]
    tags: list[tuple[str, str]] = []
    for item in rest:
        k, sep, v = item.partition("%")
        if not sep:
            return None
        tags.append((k, v))
    return LMCacheKey(model, world_size, worker_id, int(hx, 16), dtype, layer_id, tuple(tags), suffix)


# (dtype, layer-mode, tags): chunks written with different dtypes or tags are
# different objects; one complete variant is enough for the chunk to be usable.
_Variant = tuple[str, bool, tuple[tuple[str, str], ...]]


class ChunkPresence:
    """Which chunks of one model are complete in a global store.

    Feed it raw store keys with :meth:`add` / :meth:`remove` (or a full listing
    with :meth:`reset`); each returns the chunk hash whose presence flipped.
    Keys of other models or other world sizes are ignored; malformed keys are
    counted, never raised.
    """

    def __init__(
        self,
        model: str,
        world_size: int = 1,
        *,
        suffixes: tuple[str, ...] = BARE_SUFFIXES,
        num_layers: int | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        if num_layers is not None and num_layers < 1:
            raise ValueError("num_layers must be >= 1 or None")
        if not suffixes:
            raise ValueError("suffixes must not be empty")
        self.model = model
        self.world_size = world_size
        self.suffixes = tuple(suffixes)
        self.num_layers = num_layers
        self._suffix_index = {s: i for i, s in enumerate(self.suffixes)}
        self._layers = num_layers or 1
        self._full_mask = (1 << (world_size * self._layers * len(self.suffixes))) - 1
        self._masks: dict[tuple[int, _Variant], int] = {}
        self._complete: dict[int, int] = {}  # chunk hash -> number of complete variants
        self.bad_keys = 0
        self.foreign_keys = 0

    def __contains__(self, chunk_hash: object) -> bool:
        return chunk_hash in self._complete

    def __len__(self) -> int:
        return len(self._complete)

    def present(self) -> set[int]:
        return set(self._complete)

    def stats(self) -> dict[str, int]:
        return {
            "chunks_present": len(self._complete),
            "partial_entries": len(self._masks),
            "bad_keys": self.bad_keys,
            "foreign_keys": self.foreign_keys,
        }

    def _locate(self, raw: str | bytes) -> tuple[int, tuple[int, _Variant], int] | None:
        """``(chunk hash, mask slot, mask bit)`` of a key of this view, None for any other key."""
        key = parse_key(raw, self.suffixes)
        if key is None:
            self.bad_keys += 1
            return None
        layered = key.layer_id is not None
        if (
            key.model != self.model
            or key.world_size != self.world_size
            or layered != (self.num_layers is not None)
            or (layered and key.layer_id >= self._layers)  # type: ignore[operator]
        ):
            self.foreign_keys += 1
            return None
        layer = key.layer_id or 0
        bit = ((key.worker_id * self._layers) + layer) * len(self.suffixes) + self._suffix_index[key.suffix]
        return key.chunk_hash, (key.chunk_hash, (key.dtype, layered, key.tags)), 1 << bit

    def add(self, raw: str | bytes) -> int | None:
        """Record that ``raw`` exists; returns the chunk hash if the chunk just became present."""
        loc = self._locate(raw)
        if loc is None:
            return None
        chunk, slot, bit = loc
        old = self._masks.get(slot, 0)
        new = old | bit
        if new == old:
            return None
        self._masks[slot] = new
        if new != self._full_mask:
            return None
        n = self._complete.get(chunk, 0)
        self._complete[chunk] = n + 1
        return chunk if n == 0 else None

    def remove(self, raw: str | bytes) -> int | None:
        """Record that ``raw`` is gone; returns the chunk hash if the chunk just stopped being present."""
        loc = self._locate(raw)
        if loc is None:
            return None
        chunk, slot, bit = loc
        old = self._masks.get(slot, 0)
        new = old & ~bit
        if new == old:
            return None
        if new:
            self._masks[slot] = new
        else:
            del self._masks[slot]
        if old != self._full_mask:
            return None
        n = self._complete[chunk] - 1
        if n:
            self._complete[chunk] = n
            return None
        del self._complete[chunk]
        return chunk

    def reset(self, keys: Iterable[str | bytes]) -> set[int]:
        """Replace the state with a complete key listing; returns the present chunk hashes."""
        self._masks.clear()
        self._complete.clear()
        for raw in keys:
            self.add(raw)
        return self.present()

    def clear(self) -> None:
        self._masks.clear()
        self._complete.clear()

    def keys(self) -> Iterator[str]:
        """Every store key currently believed to exist (complete or partial chunks)."""
        per_worker = self._layers * len(self.suffixes)
        for (chunk, (dtype, layered, tags)), mask in list(self._masks.items()):
            bit = 0
            while mask:
                if mask & 1:
                    worker, rem = divmod(bit, per_worker)
                    layer, sfx = divmod(rem, len(self.suffixes))
                    yield format_key(
                        self.model, self.world_size, worker, chunk, dtype,
                        layer_id=layer if layered else None, tags=tags, suffix=self.suffixes[sfx],
                    )
                mask >>= 1
                bit += 1
