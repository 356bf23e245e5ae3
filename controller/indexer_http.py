"""The KV-indexer HTTP API of Dynamo's standalone indexer and the Mooncake KV Indexer RFC, read-only.

Served by the controller when ``peer_apis.http_port`` is set (off by default). Both APIs follow the
Mooncake KV Indexer RFC (kvcache-ai/Mooncake issue 1403); they differ in field names, and the
request's own fields say which one a client speaks:

``POST /query`` with ``model_name`` (Dynamo): ``{"token_ids": [...], "model_name": "m",
"lora_name": null}`` ->
``{"scores": {iid: {"0": gpu}}, "frequencies": [], "instances": {iid: {"longest_matched", "gpu",
"dp": {"0": gpu}, "cpu", "disk", "global"}}}``. All counts in matched tokens; ``cpu`` and ``disk``
cumulative through ``gpu`` as Dynamo's are (``disk`` = ``cpu``: LMCache reports its CPU and disk
chunks as one local tier here), ``global`` the prefix the global store holds (reachable by all).

``POST /query`` with ``model`` (Mooncake RFC): ``{"model": "m", "lora_name": "", "token_ids":
[...], "tenant_id": "default", "instance_id": null}`` -> ``{tenant: {iid: {"longest_matched",
"GPU", "DP": {"0": gpu}, "CPU", "DISK", "GLOBAL"}}}``.

``POST /query_by_hash``: the same, with ``block_hashes`` (Dynamo) or ``seq_hashes`` /
``block_hash`` (RFC). The hashes are OUR ``fast`` chain at the index's block size (the scheme, root
and block size are in ``GET /hashing`` and the route service's ``stats``): neither Dynamo's local
block hashes nor the RFC's rolling hash is what this index stores, so a client computes ours.

Every registered instance is listed, holders and non-holders alike (every holder of a prefix, not
the first: LMCache's controller credits only the first). ``GET /workers`` lists the instances,
``GET /health`` answers ``OK``. Errors are ``{"error": message}`` with 400 (bad input), 413 (too
many tokens, or a body longer than the longest valid query); nothing here writes to the index.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from aiohttp import web

from smetric_lmc.controller.index_query import IndexQuery, Overlap, QueryError

log = logging.getLogger(__name__)



class QueryBody(msgspec.Struct):
    """The fields of Dynamo's and the RFC's query bodies this index reads; others are ignored."""

    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    seq_hashes: list[int] | None = None
    block_hash: list[int] | None = None
    model_name: str | None = None  # Dynamo
    model: str | None = None  # Mooncake RFC
    lora_name: str | None = None
    tenant_id: str | None = None
    instance_id: str | int | None = None
    cache_salt: str | None = None


def dynamo_answer(ov: Overlap) -> dict[str, Any]:
    return {
        "scores": {h.instance_id: {"0": h.gpu} for h in ov.hits},
        "frequencies": [],
        "instances": {
            h.instance_id: {"longest_matched": h.longest, "gpu": h.gpu, "dp": {"0": h.gpu}, "cpu": h.cpu,
                            "disk": h.cpu, "global": h.global_}
            for h in ov.hits
        },
    }


def mooncake_answer(ov: Overlap, tenant: str) -> dict[str, Any]:
    return {
        tenant: {
            h.instance_id: {"longest_matched": h.longest, "GPU": h.gpu, "DP": {"0": h.gpu}, "CPU": h.cpu,
                            "DISK": h.cpu, "GLOBAL": h.global_}
            for h in ov.hits
        }
    }


class IndexerHttp:
    """aiohttp application of the read-only indexer API over one :class:`IndexQuery`."""

    def __init__(self, query: IndexQuery) -> None:
        self.query = query
        # every id at its widest (20 digits and a comma), plus room for the other fields
        self.max_body_bytes = query.max_query_tokens * 21 + (64 << 10)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.add_routes([web.post("/query", self._query), web.post("/query_by_hash", self._query_by_hash),
                        web.get("/workers", self._workers), web.get("/hashing", self._hashing),
                        web.get("/health", self._health)])
        return app

    async def _body(self, request: web.Request) -> QueryBody:
        # Checked before anything is decoded: a body longer than the longest valid query (every id
        # at its widest) is refused unread, so decoding costs at most that bound.
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise QueryError(f"body of {request.content_length} bytes; at most {limit} here", 413)
        chunks, size = [], 0
        while chunk := await request.content.readany():  # the whole body, or refused past the limit
            size += len(chunk)
            if size > limit:
                raise QueryError(f"body over {limit} bytes", 413)
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            # msgspec decodes typed, in C: lists of integers at tens of MB/s, and a wrong type
            # (a float or bool among token ids, a number as the model) is refused with its path
            return msgspec.json.decode(raw, type=QueryBody)
        except msgspec.ValidationError as exc:
            raise QueryError(f"bad query: {exc}") from None
        except msgspec.DecodeError:
            raise QueryError("the body must be a JSON object") from None

    async def _query(self, request: web.Request) -> web.Response:
        return await self._answer(request, by_hash=False)

    async def _query_by_hash(self, request: web.Request) -> web.Response:
        return await self._answer(request, by_hash=True)

    async def _answer(self, request: web.Request, *, by_hash: bool) -> web.Response:
        try:
            body = await self._body(request)
            rfc = body.model_name is None and body.model is not None
            model = body.model if rfc else body.model_name
            instances = None if body.instance_id is None else [str(body.instance_id)]
            if body.cache_salt:
                # A salted prompt is hashed under a salt this index does not apply: say so rather
                # than answer with overlaps that cannot hold for it.
                raise QueryError("cache_salt is not supported by this index")
            if by_hash:
                hashes = next((h for h in (body.block_hashes, body.seq_hashes, body.block_hash) if h is not None),
                              None)
                if hashes is None:
                    raise QueryError("query_by_hash needs block_hashes (or seq_hashes)")
                ov = await self.query.by_hashes(hashes, model or "", body.lora_name or None, instances)
            else:
                if body.token_ids is None:
                    raise QueryError("query needs token_ids")
                ov = await self.query.by_tokens(body.token_ids, model or "", body.lora_name or None, instances)
        except QueryError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        if rfc:
            return web.json_response(mooncake_answer(ov, body.tenant_id or "default"))
        return web.json_response(dynamo_answer(ov))

    async def _workers(self, _request: web.Request) -> web.Response:
        core = self.query.core
        routable = set(core.routable_ids())
        return web.json_response([
            {"instance_id": iid, "status": "active" if iid in routable else "paused",
             "block_size": self.query.block_size, "endpoint": core.endpoint_of(iid)}
            for iid in core.index.instances
        ])

    async def _hashing(self, _request: web.Request) -> web.Response:
        hs = self.query.core.hashing
        return web.json_response({"scheme": "fast", "block_size": hs.block_size, "root": hs.fast_root})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="OK")
