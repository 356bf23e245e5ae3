"""bench/proxy_floor.py's measuring proxies forward a completion and its answer unchanged."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web
from helpers import load_bench

pytest.importorskip("httptools")  # the live-peers extra installs it


@pytest.fixture
def engine() -> Iterator[str]:
    """A stand-in engine: echoes the request's JSON with its path, in its own thread and loop."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    url: list[str] = []

    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"path": request.path, "echo": body}, status=201)

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v1/completions", echo)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        return runner

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner = loop.run_until_complete(serve())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(10)
    yield url[0]
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


@pytest.mark.parametrize("kind", ["floor:aiohttp", "floor:aiohttp+httptools", "floor:httptools"])
def test_measuring_proxy_forwards_request_and_answer(engine: str, kind: str) -> None:
    bench = load_bench("proxy_floor")
    proc, url = bench._floor_proxy(kind, engine)

    async def three() -> list[tuple[int, dict]]:
        out = []
        async with aiohttp.ClientSession() as s:  # one connection, reused: keep-alive on both legs
            for k in range(3):
                async with s.post(url + "/v1/completions", json={"prompt": f"p{k}", "max_tokens": k}) as r:
                    out.append((r.status, json.loads(await r.read())))
        return out

    try:
        got = asyncio.run(three())
    finally:
        proc.terminate()
        proc.wait(10)
    assert got == [(201, {"path": "/v1/completions", "echo": {"prompt": f"p{k}", "max_tokens": k}}) for k in range(3)]


def test_bad_arguments_are_refused_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_bench("proxy_floor").main(["--pairs", "3"]) == 2
    assert "--pairs >= 10" in capsys.readouterr().err
