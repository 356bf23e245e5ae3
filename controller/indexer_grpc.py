"""llm-d's ``indexer.v1.IndexerService.GetPodScores`` over gRPC, answered from our tiered index.

Served by the controller when ``peer_apis.grpc_port`` is set (off by default; needs the ``indexer``
extra: grpcio + grpcio-tools). The contract is ``proto/indexer.proto`` (same package, service,
messages and field numbers as llm-d-kv-cache's ``api/indexerpb/indexer.proto``). Its Python
modules are generated from that file with grpcio-tools when first needed, into a private temporary
folder: the shipped ``.proto`` stays the one source of truth, and no generated code pins the
protobuf runtime to the generator's version (protobuf refuses gencode newer than its runtime).

A request carries the prompt as text: it is tokenized by the ``tokenize`` callable (by default an
engine's ``/tokenize``), then scored like a ``route``: a pod's score is its local tiered hit (the
longest of its GPU-tier and LMCache-tier prefix) in blocks of the index's block size. The global
tier is reachable from every pod alike, so it moves no pod's rank and is left out.

Bad requests get ``INVALID_ARGUMENT`` (empty prompt, too long), a tokenizer that fails
``UNAVAILABLE``; messages over ``MAX_MESSAGE_BYTES`` are refused by gRPC itself.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from smetric_lmc.controller.index_query import IndexQuery, QueryError

log = logging.getLogger(__name__)

PROTO = Path(__file__).with_name("proto") / "indexer.proto"
SERVICE = "indexer.v1.IndexerService"
MAX_MESSAGE_BYTES = 8 << 20
#: A prompt longer than this many characters per allowed token is refused before tokenizing.
MAX_CHARS_PER_TOKEN = 16

Tokenize = Callable[[str, str], Awaitable[list[int]]]

_modules: tuple[ModuleType, ModuleType] | None = None


def load_proto() -> tuple[ModuleType, ModuleType]:
    """(indexer_pb2, indexer_pb2_grpc) generated from :data:`PROTO` (once per process)."""
    global _modules
    if _modules is not None:
        return _modules
    from grpc_tools import protoc  # the `indexer` extra

    out = Path(tempfile.mkdtemp(prefix="smetric-indexer-proto-"))
    include = str(Path(protoc.__file__).parent / "_proto")
    rc = protoc.main(["protoc", f"-I{PROTO.parent}", f"-I{include}", f"--python_out={out}",
                      f"--grpc_python_out={out}", str(PROTO)])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO.name} (exit {rc})")
    mods = []
    for name in ("indexer_pb2", "indexer_pb2_grpc"):
        spec = importlib.util.spec_from_file_location(name, out / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # the _grpc module imports the _pb2 one by this name
        spec.loader.exec_module(mod)
        mods.append(mod)
    _modules = (mods[0], mods[1])
    return _modules


class IndexerGrpc:
    """A grpc.aio server answering ``GetPodScores`` from one :class:`IndexQuery`."""

    def __init__(self, query: IndexQuery, tokenize: Tokenize) -> None:
        self.query = query
        self.tokenize = tokenize
        self.server: Any = None
        self.port = 0
        self.counters = {"calls": 0, "invalid": 0, "tokenize_failures": 0}

    async def start(self, host: str, port: int) -> int:
        import grpc

        pb2, _ = load_proto()
        self._pb2 = pb2
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self.server = grpc.aio.server(options=opts)
        # The method is registered by hand (not the generated servicer) so that a request that does
        # not parse is answered INVALID_ARGUMENT by us, instead of an UNKNOWN and a logged traceback.
        handler = grpc.unary_unary_rpc_method_handler(
            self._get_pod_scores, request_deserializer=self._parse,
            response_serializer=pb2.GetPodScoresResponse.SerializeToString)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"GetPodScores": handler}),))
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"gRPC indexer: cannot bind {host}:{port}")
        await self.server.start()
        log.info("llm-d IndexerService (GetPodScores) on %s:%d", host, self.port)
        return self.port

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)

    def _parse(self, data: bytes) -> Any:
        from google.protobuf.message import DecodeError

        try:
            return self._pb2.GetPodScoresRequest.FromString(data)
        except DecodeError:
            return None

    async def _get_pod_scores(self, request: Any, context: Any) -> Any:
        import grpc

        self.counters["calls"] += 1
        if request is None:
            return await self._invalid(context, "the request is not a GetPodScoresRequest")
        prompt, model = request.prompt, request.model_name
        limit = self.query.max_query_tokens
        if not prompt:
            return await self._invalid(context, "prompt is empty")
        if not model:
            return await self._invalid(context, "model_name is empty")
        if len(prompt) > limit * MAX_CHARS_PER_TOKEN:
            return await self._invalid(context, f"prompt of {len(prompt)} characters is over the limit")
        try:
            tokens = await self.tokenize(model, prompt)
        except Exception as exc:  # any tokenizer failure is the caller's UNAVAILABLE, not our crash
            self.counters["tokenize_failures"] += 1
            log.warning("GetPodScores: tokenizing failed: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot tokenize the prompt: {exc}")
        try:
            ov = await self.query.by_tokens(tokens, model, None, list(request.pod_identifiers) or None)
        except QueryError as exc:
            return await self._invalid(context, str(exc))
        bs = ov.block_size
        pb2 = self._pb2
        return pb2.GetPodScoresResponse(scores=[pb2.PodScore(pod=h.instance_id, score=h.cpu / bs) for h in ov.hits])

    async def _invalid(self, context: Any, message: str) -> Any:
        import grpc

        self.counters["invalid"] += 1
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
