"""The mock's global tier, named in a real Redis as LMCache's ``redis://`` connector names it.

In the real stack the controller learns what the global tier holds from the store itself (Redis
keyspace events and SCAN, ``controller/global_redis.py``): LMCache writes every chunk it puts as
``model@world_size@worker_id@{chunk_hash:x}@dtype`` plus ``kv_bytes`` / ``metadata`` suffixes. The
mock's global tier lives inside the mock process, so without this its contents are invisible to our
controller and a prefix a request could fetch is priced as a miss. :class:`StoreKeys` writes the
same keys to a real redis-server when a put lands in the mock's tier and deletes them when the tier
evicts the chunk, so the controller follows the mock exactly as it follows LMCache.

What is not real: the values. A chunk's KV is ~24 MiB at the profile's size; the keys carry a few
bytes each (the controller reads keys only). The chunk hashes are LMCache 0.5.6's
(``smetric_lmc.hashing.lmcache_chunk_chain``), with the root and algorithm the controller is
configured with, so the gateway's chunk chain of a prompt finds them.

The simulator's tier holds 32-token blocks keyed by the mock's vLLM block hashes and stores whole
256-token chunks; it is a prefix tree, so a chunk is whole exactly while its last block is held.
:meth:`StoreKeys.note_prompt` maps each chunk's last block hash to the chunk's LMCache hash; the
tier's ``global_stored`` / ``global_removed`` calls (on the mock's clock, synchronous) queue key
writes that a background task sends in pipelined batches, so no engine step waits on Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from smetric_lmc.controller.lmcache_keys import REDIS_SUFFIXES, format_key
from smetric_lmc.hashing import lmcache_chunk_chain

log = logging.getLogger(__name__)

MAX_NAMES = 1_000_000  # chunk-end blocks remembered (oldest forgotten first): ~100 MB at most
FLUSH_S = 0.005  # the writer's batching interval


class StoreKeys:
    """The global tier's chunks as LMCache keys in a Redis; the tier's index sink."""

    def __init__(self, url: str, *, model: str, block_size: int, chunk_size: int = 256, root: int = 0,
                 algo: Literal["builtin", "sha256_cbor"] = "builtin", dtype: str = "bfloat16",
                 world_size: int = 1) -> None:
        if chunk_size % block_size:
            raise ValueError(f"the LMCache chunk ({chunk_size}) must be whole blocks of {block_size}")
        self.url = url
        self.model = model
        self.per_chunk = chunk_size // block_size
        self.chunk_size = chunk_size
        self.root = root
        self.algo = algo
        self.dtype = dtype
        self.world_size = world_size
        self._names: dict[int, int] = {}  # a chunk's last block hash -> its LMCache chunk hash
        self._pending: dict[int, bool] = {}  # chunk hash -> present (the latest word wins)
        self._wake = asyncio.Event()
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self.written = 0
        self.deleted = 0
        self.errors = 0

    # ---- the mock's side (synchronous, on the mock's clock) ---------------------------------------
    def note_prompt(self, token_ids: Sequence[int], blocks: np.ndarray) -> None:
        """Remember the LMCache name of each whole chunk of a prompt (``blocks``: its block hashes)."""
        n = min(len(token_ids) // self.chunk_size, len(blocks) // self.per_chunk)
        if n == 0:
            return
        chunks = lmcache_chunk_chain(token_ids[: n * self.chunk_size], self.chunk_size, root=self.root,
                                     algo=self.algo)
        names = self._names
        for k, ch in enumerate(chunks):
            names[int(blocks[(k + 1) * self.per_chunk - 1])] = ch
        while len(names) > MAX_NAMES:
            names.pop(next(iter(names)))

    def global_stored(self, hashes: Iterable[int]) -> None:
        self._note(hashes, True)

    def global_removed(self, hashes: Iterable[int]) -> None:
        self._note(hashes, False)

    def _note(self, hashes: Iterable[int], present: bool) -> None:
        names = self._names
        hit = False
        for h in hashes:
            ch = names.get(int(h))
            if ch is not None:
                self._pending[ch] = present
                hit = True
        if hit:
            self._wake.set()

    # ---- the writer ---------------------------------------------------------------------------------
    def keys(self, chunk_hash: int) -> list[str]:
        """The keys LMCache's redis connector writes for one chunk (every shard, both suffixes)."""
        return [format_key(self.model, self.world_size, w, chunk_hash, self.dtype, suffix=s)
                for w in range(self.world_size) for s in REDIS_SUFFIXES]

    async def start(self) -> None:
        """Connect (raising if the store is not there) and start the background writer."""
        self._client = aioredis.from_url(self.url)
        await self._client.ping()
        self._task = asyncio.get_running_loop().create_task(self._run())
        log.info("global tier keys go to %s (model %r, chunk %d, root %d, %s)", self.url, self.model,
                 self.chunk_size, self.root, self.algo)

    async def flush(self) -> None:
        """Send what is queued now."""
        if not self._pending or self._client is None:
            return
        batch, self._pending = self._pending, {}
        pipe = self._client.pipeline(transaction=False)
        for ch, present in batch.items():
            if present:
                for key in self.keys(ch):
                    pipe.set(key, b"mock")
                self.written += 1
            else:
                pipe.delete(*self.keys(ch))  # one DEL a chunk: a bench counts them (live_peers)
                self.deleted += 1
        try:
            await pipe.execute()
        except RedisError as exc:  # the store is the controller's source, not the mock's: go on
            self.errors += 1
            log.warning("global tier keys: %d chunk updates not written to %s: %s", len(batch), self.url, exc)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(FLUSH_S)
            await self.flush()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None:
            with contextlib.suppress(RedisError, OSError):
                await self.flush()
            await self._client.aclose()
            self._client = None
