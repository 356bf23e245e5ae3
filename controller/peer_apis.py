"""Starts the read-only index APIs other stacks query (``peer_apis`` in the config; off by default).

``ControllerApp`` calls :func:`start_peer_apis` once its route core exists and
:meth:`PeerApis.close` at shutdown. ``http_port`` serves Dynamo's / Mooncake's KV-indexer HTTP API
(``indexer_http.py``), ``grpc_port`` llm-d's ``GetPodScores`` (``indexer_grpc.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from smetric_lmc.config import PeerApisConfig
from smetric_lmc.controller.index_query import IndexQuery
from smetric_lmc.controller.indexer_grpc import IndexerGrpc, Tokenize
from smetric_lmc.controller.indexer_http import IndexerHttp
from smetric_lmc.controller.service import RouteCore

log = logging.getLogger(__name__)


def engine_tokenizer(core: RouteCore, timeout_s: float = 10.0) -> Tokenize:
    """Tokenizes with a routable engine's vLLM ``/tokenize`` (``{"model", "prompt"}`` -> ``tokens``)."""
    session: list[aiohttp.ClientSession] = []

    async def tokenize(model: str, prompt: str) -> list[int]:
        if not session:
            session.append(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)))
        errors = []
        for iid in core.routable_ids():
            url = core.endpoint_of(iid)
            if not url:
                continue
            try:
                async with session[0].post(f"{url.rstrip('/')}/tokenize",
                                           json={"model": model, "prompt": prompt}) as r:
                    body = await r.json(content_type=None)
                    if r.status == 200 and isinstance(body, dict) and isinstance(body.get("tokens"), list):
                        return body["tokens"]
                    errors.append(f"{iid}: HTTP {r.status}")
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                errors.append(f"{iid}: {exc!r}")
        raise RuntimeError("no engine tokenized the prompt: " + ("; ".join(errors) or "no routable engine"))

    async def close() -> None:
        if session:
            await session.pop().close()

    tokenize.close = close  # type: ignore[attr-defined]
    return tokenize


class PeerApis:
    def __init__(self, query: IndexQuery) -> None:
        self.query = query
        self.http_runner: web.AppRunner | None = None
        self.http_port = 0
        self.grpc: IndexerGrpc | None = None
        self._closers: list[Callable[[], Any]] = []

    async def close(self) -> None:
        if self.grpc is not None:
            await self.grpc.close()
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        for close in self._closers:
            await close()


async def start_peer_apis(core: RouteCore, cfg: PeerApisConfig, tokenize: Tokenize | None = None) -> PeerApis | None:
    """Start what ``cfg`` turns on; None when both ports are 0."""
    if not cfg.http_port and not cfg.grpc_port:
        return None
    apis = PeerApis(IndexQuery(core, max_query_tokens=cfg.max_query_tokens))
    try:
        if cfg.http_port:
            runner = web.AppRunner(IndexerHttp(apis.query).app(), access_log=None)
            await runner.setup()
            apis.http_runner = runner
            site = web.TCPSite(runner, cfg.host, max(cfg.http_port, 0))  # -1: any free port
            await site.start()
            apis.http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            log.info("KV-indexer HTTP API (Dynamo / Mooncake RFC) on %s:%d", cfg.host, apis.http_port)
        if cfg.grpc_port:
            if tokenize is None:
                tokenize = engine_tokenizer(core)
                apis._closers.append(tokenize.close)  # type: ignore[attr-defined]
            apis.grpc = IndexerGrpc(apis.query, tokenize)
            try:
                await apis.grpc.start(cfg.host, max(cfg.grpc_port, 0))
            except ImportError as exc:
                apis.grpc = None
                log.error("peer_apis.grpc_port set but gRPC is unavailable (%s): pip install 'smetric-lmc[indexer]'",
                          exc)
    except BaseException:
        await apis.close()
        raise
    return apis
