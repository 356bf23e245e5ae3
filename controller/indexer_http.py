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
many tokens) or 415 (not JSON); nothing here writes to the index.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from .index_query import IndexQuery, Overlap, QueryError

log = logging.getLogger(__name__)

#: A body past this is refused by aiohttp before it is read whole (413).
MAX_BODY_BYTES = 8 << 20


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

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/query", self._query)
        app.router.add_post("/query_by_hash", self._query_by_hash)
        app.router.add_get("/workers", self._workers)
        app.router.add_get("/hashing", self._hashing)
        app.router.add_get("/health", self._health)
        return app

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise QueryError(f"body over {MAX_BODY_BYTES} bytes", 413) from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
            raise QueryError("the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise QueryError("the body must be a JSON object")
        return body

    async def _query(self, request: web.Request) -> web.Response:
        return await self._answer(request, by_hash=False)

    async def _query_by_hash(self, request: web.Request) -> web.Response:
        return await self._answer(request, by_hash=True)

    async def _answer(self, request: web.Request, *, by_hash: bool) -> web.Response:
        try:
            body = await self._body(request)
            rfc = "model_name" not in body and "model" in body
            model = body.get("model" if rfc else "model_name")
            lora = body.get("lora_name") or None
            only = body.get("instance_id")
            if only is not None and not isinstance(only, str | int):
                raise QueryError("instance_id must be a string")
            instances = None if only is None else [str(only)]
            if body.get("cache_salt") not in (None, ""):
                # A salted prompt is hashed under a salt this index does not apply: say so rather
                # than answer with overlaps that cannot hold for it.
                raise QueryError("cache_salt is not supported by this index")
            if by_hash:
                key = next((k for k in ("block_hashes", "seq_hashes", "block_hash") if k in body), None)
                if key is None:
                    raise QueryError("query_by_hash needs block_hashes (or seq_hashes)")
                ov = await self.query.by_hashes(body[key], model, lora, instances)  # type: ignore[arg-type]
            else:
                if "token_ids" not in body:
                    raise QueryError("query needs token_ids")
                ov = await self.query.by_tokens(body["token_ids"], model, lora, instances)  # type: ignore[arg-type]
        except QueryError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        if rfc:
            tenant = body.get("tenant_id") if isinstance(body.get("tenant_id"), str) else "default"
            return web.json_response(mooncake_answer(ov, tenant or "default"))
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
