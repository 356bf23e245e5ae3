"""The mock engine's HTTP face: the parts of vLLM's OpenAI server a gateway and a replay use.

``/v1/completions`` and ``/v1/chat/completions`` (streaming or not, ``usage`` with
``prompt_tokens_details.cached_tokens``), ``/v1/models``, ``/health``, ``/tokenize``, ``/metrics``
with vLLM's metric names, and the dev endpoint ``POST /reset_prefix_cache``. Completions take a prompt as token ids (what a trace replay sends) or as
text; text and chat messages go through the engine's own tokenizer: UTF-8 bytes as token ids
(0-255) after a ChatML rendering, so any client can reproduce them without a model download.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import asdict
from typing import Any

import msgspec
from aiohttp import web

from smetric_lmc.lab.mock_engine.core import Handle, MockEngineCore, RequestTooLong

log = logging.getLogger(__name__)


# ---- the shipped tokenizer ------------------------------------------------------------------------
def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """ChatML, as Qwen-family chat templates render it."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|im_start|>{m.get('role', 'user')}\n{content or ''}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def output_text(k: int, start: int) -> str:
    """Deterministic generated text, one byte (= one token) per output token."""
    return "".join(chr(97 + (start + j) % 26) for j in range(k))


class BadRequest(ValueError):
    pass


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return encode_text(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return prompt
    raise BadRequest("'prompt' must be a string or a non-empty list of non-negative token ids (one prompt)")


def _chat_ids(body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of objects")
    return encode_text(render_chat(messages, bool(body.get("add_generation_prompt", True))))


async def _json_body(request: web.Request) -> Any:
    """The request's JSON body, decoded with msgspec: the prompt-carrying endpoints run on the
    event loop that times the modelled steps, where the standard library's decoder and encoder
    cost ~6x as much (vLLM's router renders each prompt on every worker, and all the instances of
    a mock process share its loop: those calls would land on the modelled GPUs' clock, where in
    vLLM they run in each API server's process)."""
    return msgspec.json.decode(await request.read())


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": kind, "param": None, "code": status},
                             status=status)


class MockEngineServer:
    """One engine's aiohttp application."""

    def __init__(self, core: MockEngineCore, served_model_name: str = "tiny") -> None:
        self.core = core
        self.model = served_model_name
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        # What routers' worker discovery reads (SGLang's router tries the first name of each pair).
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self._server_info)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/chat/completions/render", self._render_chat)
        app.router.add_post("/v1/completions/render", self._render_completion)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/mock/cache", self._cache)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_get("/mock/stats", self._stats)
        app.router.add_get("/mock/retrieve", self._retrieve)
        app.router.add_post("/mock/retrieve", self._retrieve)
        return app

    # ---- small endpoints ------------------------------------------------------------------------
    async def _health(self, _r: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _model_info(self, _r: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model, "tokenizer_path": None, "is_generation": True,
                                  "served_model_name": self.model})

    async def _server_info(self, _r: web.Request) -> web.Response:
        c = self.core
        return web.json_response({"model_id": self.model, "model_path": self.model, "served_model_name": self.model,
                                  "instance_id": c.instance_id, "worker_type": "regular",
                                  "kv_block_size": c.block_size, "effective_attention_block_size": c.block_size,
                                  "max_model_len": c.max_model_len, "num_gpu_blocks": c.num_gpu_blocks,
                                  "prefix_caching_hash_algo": c.hash_algo})

    async def _models(self, _r: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "vllm", "root": self.model,
                "parent": None, "max_model_len": self.core.max_model_len, "permission": []}
        return web.json_response({"object": "list", "data": [card]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            ids = _chat_ids(body) if "messages" in body else _prompt_ids(body)
        except (ValueError, BadRequest) as exc:
            return _error(400, str(exc))
        return _json({"count": len(ids), "max_model_len": self.core.max_model_len, "tokens": ids, "token_strs": None})

    def _generate_request(self, body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        """vLLM's ``GenerateRequest`` (what its render endpoints answer): the prompt's token ids and
        the sampling parameters the request carried."""
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        return {"request_id": uuid.uuid4().hex, "token_ids": ids, "token_offsets": None, "features": None,
                "content_parts": None, "sampling_params": {"max_tokens": max_tokens}, "model": self.model,
                "stream": bool(body.get("stream")), "cache_salt": body.get("cache_salt"), "priority": 0,
                "kv_transfer_params": None}

    async def _render_chat(self, request: web.Request) -> web.Response:
        """``POST /v1/chat/completions/render`` (vLLM 0.32): the rendered chat prompt's token ids,
        which vLLM's router tokenizes requests with."""
        return await self._render(request, chat=True)

    async def _render_completion(self, request: web.Request) -> web.Response:
        """``POST /v1/completions/render``: one ``GenerateRequest`` per prompt (here: one)."""
        return await self._render(request, chat=False)

    async def _render(self, request: web.Request, chat: bool) -> web.Response:
        try:
            body = await _json_body(request)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            ids = _chat_ids(body) if chat else _prompt_ids(body)
        except (ValueError, BadRequest) as exc:
            return _error(400, str(exc))
        req = self._generate_request(body, ids)
        return _json(req if chat else [req])

    async def _metrics(self, _r: web.Request) -> web.Response:
        return web.Response(text=render_metrics(self.core, self.model), content_type="text/plain")

    async def _reset_prefix_cache(self, _r: web.Request) -> web.Response:
        """vLLM's dev endpoint (``VLLM_SERVER_DEV_MODE=1`` there): ``{"success": bool}``."""
        return web.json_response({"success": self.core.reset_prefix_cache()})

    async def _cache(self, _r: web.Request) -> web.Response:
        """Not a vLLM endpoint: what the mock's prefix cache holds, for checking a controller's mirror."""
        c = self.core
        return web.json_response({"block_hashes": sorted(c.cached_block_hashes()), "running": c.running,
                                  "waiting": c.waiting, "evicted_blocks": c.counters.evicted_blocks,
                                  "kv_batches": c.publisher.batches if c.publisher else 0})

    async def _stats(self, _r: web.Request) -> web.Response:
        """Not a vLLM endpoint: this engine's counters (where its prompt tokens came from) and, when
        it has tiers, the process's tier counters and retrieve costs."""
        c = self.core
        doc: dict[str, Any] = {"instance": c.instance_id, "counters": asdict(c.counters), "running": c.running,
                               "waiting": c.waiting}
        if c.tiers is not None:
            sh = c.tiers.shared
            doc["tiers"] = asdict(sh.counters)
            doc["retrieve"] = sh.costs.to_dict()
        return web.json_response(doc)

    async def _retrieve(self, request: web.Request) -> web.Response:
        """Not a vLLM endpoint: GET the retrieve costs of this instance's process; POST a JSON object
        of changes (e.g. ``{"scale": 4}`` or ``{"global": {"gbps": 1.6}}``), applied to every
        instance of the process for fetches that start from now on."""
        tiers = self.core.tiers
        if tiers is None:
            return _error(404, "this mock engine has no KV tier beyond its GPU (start it with --global-gib or "
                               "--local-cpu-gib)", "NotFoundError")
        if request.method == "POST":
            try:
                tiers.shared.set_costs(await request.json())
            except ValueError as exc:  # a JSON decode error included
                return _error(400, str(exc))
        return web.json_response(tiers.shared.costs.to_dict())

    # ---- generation -----------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            if body.get("model", self.model) != self.model:
                return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
            ids = _chat_ids(body) if chat else _prompt_ids(body)
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
                raise BadRequest("max_tokens must be an integer")
            handle = self.core.add_request(ids, max_tokens)
        except (ValueError, BadRequest, RequestTooLong) as exc:
            return _error(400, str(exc))
        prefix = "chatcmpl" if chat else "cmpl"
        ctx = _Reply(f"{prefix}-{uuid.uuid4().hex}", self.model, chat, len(ids), bool(body.get("return_token_ids")))
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, handle, ctx, include_usage)
            return await self._whole(handle, ctx)
        except (asyncio.CancelledError, ConnectionResetError):
            self.core.abort(handle)  # the client went away: free the engine's slot as vLLM does
            raise

    async def _whole(self, h: Handle, ctx: _Reply) -> web.Response:
        n = 0
        while True:
            kind, value = await h.queue.get()
            if kind == "tokens":
                n += value
            elif kind == "end":
                break
        return web.json_response(ctx.whole(n, h.cached_tokens))

    async def _stream(self, request: web.Request, h: Handle, ctx: _Reply, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if ctx.chat:
            await resp.write(ctx.sse(ctx.chunk({"role": "assistant", "content": ""}, None)))
        n = 0
        while True:
            kind, value = await h.queue.get()
            if kind == "tokens":
                text = output_text(value, n)
                n += value
                # The last chunk carries finish_reason, as vLLM's does.
                done = n >= h.sim.output
                await resp.write(ctx.sse(ctx.chunk(text, "length" if done else None)))
            elif kind == "end":
                break
        if include_usage:
            await resp.write(ctx.sse(ctx.usage_chunk(n, h.cached_tokens)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class _Reply:
    """OpenAI response shapes for one request."""

    def __init__(self, rid: str, model: str, chat: bool, prompt_tokens: int, token_ids: bool = False) -> None:
        self.rid = rid
        self.model = model
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.token_ids = token_ids  # vLLM's return_token_ids: each choice carries its tokens' ids
        self.created = int(time.time())

    def usage(self, n: int, cached: int) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + n, "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def chunk(self, text: Any, finish: str | None) -> dict[str, Any]:
        if self.chat:
            delta = text if isinstance(text, dict) else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            obj = "text_completion"
        if self.token_ids and isinstance(text, str):
            choice["token_ids"] = encode_text(text)
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, n: int, cached: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage(n, cached)}

    def whole(self, n: int, cached: int) -> dict[str, Any]:
        text = output_text(n, 0)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": "length"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            obj = "text_completion"
        if self.token_ids:
            choice["token_ids"] = encode_text(text)
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(n, cached)}

    @staticmethod
    def sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def render_metrics(core: MockEngineCore, model: str) -> str:
    """Prometheus text with the vLLM 0.32 names a controller or dashboard reads."""
    c = core.counters
    lab = f'engine="0",model_name="{model}"'
    rows = [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", core.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", core.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", core.kv_usage),
        ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
         c.prefix_queries),
        ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", c.prefix_hits),
        ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", c.prompt_tokens),
        ("vllm:generation_tokens", "counter", "Number of generation tokens processed.", c.generation_tokens),
    ]
    out: list[str] = []
    for name, kind, doc, value in rows:
        sample = f"{name}_total" if kind == "counter" else name
        out += [f"# HELP {sample} {doc}", f"# TYPE {sample} {kind}", f"{sample}{{{lab}}} {float(value)}"]
    itl = "vllm:inter_token_latency_seconds"
    out += [f"# HELP {itl} Histogram of inter-token latency in seconds.", f"# TYPE {itl} histogram",
            f'{itl}_bucket{{{lab},le="+Inf"}} {float(c.itl_count)}', f"{itl}_sum{{{lab}}} {c.itl_sum_s}",
            f"{itl}_count{{{lab}}} {float(c.itl_count)}"]
    # LMCache's own names and labels (lmcache.observability, 0.5.6), as vLLM's /metrics carries them
    rt, lml = "lmcache:time_to_retrieve", f'model_name="{model}",worker_id="0"'
    out += [f"# HELP {rt} Time to retrieve from lmcache (seconds)", f"# TYPE {rt} histogram",
            f'{rt}_bucket{{le="+Inf",{lml}}} {float(c.retrieves)}', f"{rt}_sum{{{lml}}} {c.retrieve_sum_s}",
            f"{rt}_count{{{lml}}} {float(c.retrieves)}",
            "# HELP lmcache:num_hit_tokens_total Total number of tokens hit in lmcache",
            "# TYPE lmcache:num_hit_tokens_total counter",
            f"lmcache:num_hit_tokens_total{{{lml}}} {float(c.retrieved_tokens)}"]
    out += ["# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{{lab},finished_reason="length"}} {float(c.requests_ok)}',
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{core.block_size}",enable_prefix_caching="True",engine="0",'
            f'num_gpu_blocks="{core.num_gpu_blocks}",prefix_caching_hash_algo="{core.hash_algo}"}} 1.0']
    return "\n".join(out) + "\n"
