"""Read-only per-instance, per-tier overlap queries on the controller's index.

One query core for the index APIs other stacks already call (``indexer_http.py``: Dynamo's
standalone KV indexer and the Mooncake KV Indexer RFC; ``indexer_grpc.py``: llm-d's
``IndexerService.GetPodScores``). A query hashes its token ids (or takes our ``fast`` chain hashes)
exactly as a ``route`` does (``RouteCore.route_inputs``: same roots, same LoRA roots, same bounds),
looks them up once, and reports for every instance:

* ``gpu``: the instance's GPU-tier prefix hit (vLLM KV events) in tokens;
* ``cpu``: its LMCache local-tier hit (CPU/disk chunks), cumulative through ``gpu`` as Dynamo's
  tiers are (``max(gpu, lmcache)``), which is the local hit a ``route`` credits the instance with;
* ``global``: the prefix the global tier (Mooncake Store / Redis) holds, reachable from any instance.

Nothing here changes the index or the load: a query adds no pending credit and counts nothing in
flight. Work is bounded by ``max_query_tokens`` (hashing is linear in it) and the lookup itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from smetric_lmc.controller.service import RouteCore
from smetric_lmc.wire import HashChain, RouteRequest, WireError

#: Queries of more tokens than this are checked and hashed on a thread, not on the event loop.
OFFLOAD_TOKENS = 16_384


def _check_tokens(req: RouteRequest) -> str | None:
    if not all(type(t) is int and 0 <= t < (1 << 32) for t in req.token_ids or ()):
        return "token_ids must be integers in [0, 2^32)"
    return None


def _check_hashes(req: RouteRequest) -> str | None:
    if not all(type(h) is int and 0 <= h < (1 << 64) for h in req.hashes[0].hashes):
        return "block hashes must be integers in [0, 2^64)"
    return None


class QueryError(ValueError):
    """A query the API refuses: ``status`` is the HTTP status it maps to (400 or 413)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TierHit:
    instance_id: str
    gpu: int  # tokens
    cpu: int  # tokens, cumulative through gpu (the local hit route credits)
    global_: int  # tokens the global tier holds of this prefix
    stale: int  # tokens of the gpu hit from entries marked stale (instance out of routing)

    @property
    def longest(self) -> int:
        return max(self.gpu, self.cpu, self.global_)


@dataclass(frozen=True)
class Overlap:
    block_size: int
    prompt_tokens: int
    hits: list[TierHit]

    def by_id(self) -> dict[str, TierHit]:
        return {h.instance_id: h for h in self.hits}


class IndexQuery:
    """Answers overlap queries on a controller's ``RouteCore`` (its index, hashing and limits)."""

    def __init__(self, core: RouteCore, *, max_query_tokens: int = 262_144) -> None:
        self.core = core
        self.max_query_tokens = max_query_tokens
        self.counters = {"queries": 0, "refused": 0}

    @property
    def block_size(self) -> int:
        return self.core.hashing.block_size

    async def by_tokens(self, token_ids: object, model: str, lora_name: str | None = None,
                        instances: Sequence[str] | None = None) -> Overlap:
        if not isinstance(token_ids, list):
            raise self._refuse("token_ids must be a list of integers")
        if len(token_ids) > self.max_query_tokens:
            raise self._refuse(f"{len(token_ids)} token ids; at most {self.max_query_tokens} per query", 413)
        req = RouteRequest(request_id="index-query", model=self._model(model, lora_name), token_ids=token_ids)
        return await self._run(req, len(token_ids), instances, _check_tokens)

    async def by_hashes(self, hashes: object, model: str, lora_name: str | None = None,
                        instances: Sequence[str] | None = None) -> Overlap:
        """``hashes``: our ``fast`` chain at the index's block size (``stats.hashing`` publishes the
        scheme, root and block size; ``smetric_lmc.hashing.fast_chain`` computes it)."""
        if not isinstance(hashes, list):
            raise self._refuse("block hashes must be a list of integers")
        if len(hashes) * self.block_size > self.max_query_tokens:
            raise self._refuse(f"{len(hashes)} block hashes; at most {self.max_query_tokens // self.block_size}", 413)
        model = self._model(model, lora_name)
        chain = HashChain(scheme="fast", block_size=self.block_size, hashes=hashes, root=self.core.fast_root_for(model))
        return await self._run(RouteRequest(request_id="index-query", model=model, hashes=[chain]),
                               len(hashes) * self.block_size, instances, _check_hashes)

    def _model(self, model: object, lora_name: object) -> str:
        if not isinstance(model, str) or not model:
            raise self._refuse("model name must be a non-empty string")
        if lora_name is not None and not isinstance(lora_name, str):
            raise self._refuse("lora_name must be a string or null")
        # A LoRA adapter's blocks chain from the adapter's root: the index maps the name to it.
        return lora_name or model

    async def _run(self, req: RouteRequest, size: int, instances: Sequence[str] | None,
                   check: Callable[[RouteRequest], str | None]) -> Overlap:
        # Checking and hashing are linear in the query: past OFFLOAD_TOKENS they run on a thread
        # (they touch no controller state), so the loop keeps serving routes and events meanwhile.
        try:
            if size > OFFLOAD_TOKENS:
                why, prepared = await asyncio.to_thread(self._prepare, req, check)
            else:
                why, prepared = self._prepare(req, check)
        except WireError as exc:
            raise self._refuse(str(exc)) from None
        if why is not None:
            raise self._refuse(why)
        assert prepared is not None
        fast, chunks, n_tokens = prepared
        index = self.core.index
        found = index.lookup(fast, chunks)
        self.counters["queries"] += 1
        order = index.instances
        bs, cs = index.block_size, index.chunk_size
        gpu, lmc, stale = found.gpu_blocks, found.lmcache_chunks, found.stale_hit_tokens()
        local = found.local_hit_tokens()  # includes pending credit, as a route sees it
        glob = found.global_hit_tokens
        wanted = None if not instances else set(instances)
        hits = []
        for k, iid in enumerate(order):
            if wanted is not None and iid not in wanted:
                continue
            g = gpu[k] * bs
            hits.append(TierHit(iid, g, max(g, lmc[k] * cs, local[k]), glob, stale[k]))
        return Overlap(bs, n_tokens, hits)

    def _prepare(self, req: RouteRequest, check: Callable[[RouteRequest], str | None]) -> tuple[str | None, Any]:
        why = check(req)
        return (why, None) if why is not None else (None, self.core.route_inputs(req))

    def _refuse(self, message: str, status: int = 400) -> QueryError:
        self.counters["refused"] += 1
        return QueryError(message, status)
