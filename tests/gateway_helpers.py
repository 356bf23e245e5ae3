"""Fake HTTP engines, an in-process controller and gateway stack (the make_stack fixture), and request builders, shared by the gateway tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from smetric_lmc.config import parse_config
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.gateway import Gateway
from smetric_lmc.wire import DoneReport
from smetric_lmc.workers.launch import free_ports

BLOCK = 16

SSE_EVENTS = [
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":70,'
    b'"completion_tokens":2,"total_tokens":72,"prompt_tokens_details":{"cached_tokens":48}}}\n\n',
    b"data: [DONE]\n\n",
]

def render(messages: list[dict[str, Any]], generation: bool) -> str:
    """ChatML, as the tiny model's template renders it (tools omitted)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation else "")

def tokens_of(text: str) -> list[int]:
    return list(text.encode())  # a byte-level "tokenizer": prefixes of text are prefixes of ids

@dataclass
class FakeEngine:
    """An HTTP peer standing in for a vLLM server (see the module docstring)."""

    name: str
    fail_status: int | None = None
    release_stream: asyncio.Event = field(default_factory=asyncio.Event)
    hold_stream: bool = False
    hold_after_done: bool = False  # everything up to [DONE] is sent, the end of the body waits
    die_mid_stream: bool = False
    die_mid_body: bool = False  # a JSON answer's headers and first bytes go out, then the process dies
    padding: int = 0  # bytes of filler in a JSON answer (a large non-streamed answer)
    tokenize_broken: bool = False
    tokenize_delay_s: float = 0.0  # a saturated engine's API server: /tokenize answers late
    received: list[dict[str, Any]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_ports(1)[0]
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def tokenize(self, request: web.Request) -> web.Response:
        if self.tokenize_broken:
            return web.json_response({"error": "tokenizer unavailable"}, status=503)
        await asyncio.sleep(self.tokenize_delay_s)
        body = await request.json()
        if "messages" in body:
            text = render(body["messages"], body.get("add_generation_prompt", True))
        else:
            text = body["prompt"]
        toks = tokens_of(text)
        return web.json_response({"tokens": toks, "count": len(toks), "max_model_len": 4096})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        if self.fail_status:
            return web.json_response({"error": {"message": "engine broken"}}, status=self.fail_status)
        if not body.get("stream"):
            n = len(tokens_of(render(body["messages"], True)))
            answer = web.json_response({
                "id": f"{self.name}-1", "object": "chat.completion", "model": body.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"from {self.name}"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3,
                          "prompt_tokens_details": {"cached_tokens": 32}},
                **({"padding": "x" * self.padding} if self.padding else {}),
            })
            if not self.die_mid_body:
                return answer
            assert isinstance(answer.body, bytes) and request.transport is not None
            cut = web.StreamResponse(headers={"Content-Type": "application/json",
                                              "Content-Length": str(len(answer.body))})
            await cut.prepare(request)
            await cut.write(answer.body[:20])
            await asyncio.sleep(0.01)
            request.transport.abort()
            return cut
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(SSE_EVENTS[0])
        if self.hold_stream:  # the test reads the first event before the rest exists
            await self.release_stream.wait()
        if self.die_mid_stream:  # the engine process dies after its first event
            assert request.transport is not None
            request.transport.abort()
            return resp
        rest = b"".join(SSE_EVENTS[1:])
        for k in range(0, len(rest), 37):  # odd write sizes split events across chunks
            await resp.write(rest[k : k + 37])
            await asyncio.sleep(0.002)
        if self.hold_after_done:
            await self.release_stream.wait()
            await resp.write(b"\n")
        await resp.write_eof()
        return resp

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append(body)
        n = len(tokens_of(body["prompt"]))
        return web.json_response({"id": "cmpl-1", "object": "text_completion",
                                  "choices": [{"index": 0, "text": " x", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

@dataclass
class Stack:
    engines: list[FakeEngine]
    controller: ControllerApp | None
    gateway: Gateway
    http: aiohttp.ClientSession
    base: str
    dones: list[DoneReport]

    async def chat(self, messages: list[dict[str, Any]], **kw: Any) -> aiohttp.ClientResponse:
        headers = kw.pop("headers", {})
        body = {"model": "tiny", "messages": messages, **kw}
        return await self.http.post(f"{self.base}/v1/chat/completions", json=body, headers=headers)

    async def wait_dones(self, n: int, timeout_s: float = 5.0) -> list[DoneReport]:
        deadline = time.monotonic() + timeout_s
        while len(self.dones) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(self.dones) >= n, f"expected {n} done reports, got {self.dones}"
        return self.dones

StackFactory = Callable[..., Any]

@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    cleanups: list[Any] = []

    async def _make(n_engines: int = 2, *, controller: bool = True, dead_instance: bool = False,
                    extra: dict[str, Any] | None = None, gateway_hashing: dict[str, Any] | None = None,
                    dead_replica: bool = False, gateway_kw: dict[str, Any] | None = None,
                    in_process: bool = False) -> Stack:
        engines = [FakeEngine(f"e{i}") for i in range(n_engines)]
        for e in engines:
            await e.start()
            cleanups.append(e.stop)
        instances = [{"id": e.name, "http": e.url} for e in engines]
        if dead_instance:  # nothing listens there: connect errors
            instances.insert(0, {"id": "dead", "http": f"http://127.0.0.1:{free_ports(1)[0]}"})
        route_port = free_ports(1)[0]
        raw = {
            "model": "tiny",
            "hashing": {"block_size": BLOCK},
            "instances": instances,
            "server": {"route_url": f"tcp://127.0.0.1:{route_port}"},
            "load": {"metrics_poll_s": 0},
            **(extra or {}),
        }
        cfg = parse_config(raw)
        app = None
        if controller:
            app = ControllerApp(cfg, enable_metrics_http=False)
            await app.start()
            cleanups.append(app.close)
        dones: list[DoneReport] = []
        if app is not None:
            original = app.core._done  # a spy on the real handler: what the gateway reported

            def spy(req: DoneReport) -> Any:
                dones.append(req)
                return original(req)

            app.core._done = spy  # type: ignore[method-assign]
        gw_cfg = parse_config({**raw, "hashing": gateway_hashing}) if gateway_hashing is not None else cfg
        # dead_replica: the gateway lists a controller replica nobody answers at, before the real one.
        urls = f"tcp://127.0.0.1:{free_ports(1)[0]},{cfg.server.route_url}" if dead_replica else None
        gw = Gateway(gw_cfg, urls, **{"route_timeout_s": 0.3, "controller_retry_s": 30.0, **(gateway_kw or {})})
        if in_process:
            assert app is not None
            gw.in_process = app.core.handle
        runner = web.AppRunner(gw.app(), access_log=None)
        await runner.setup()
        port = free_ports(1)[0]
        await web.TCPSite(runner, "127.0.0.1", port).start()
        cleanups.append(runner.cleanup)
        http = aiohttp.ClientSession()
        cleanups.append(http.close)
        return Stack(engines, app, gw, http, f"http://127.0.0.1:{port}", dones)

    yield _make
    for close in reversed(cleanups):
        await close()

MSGS = [{"role": "system", "content": "You are terse. " * 4}, {"role": "user", "content": "Say hello, please."}]
