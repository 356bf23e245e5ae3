"""A route service on a thread, a route core over registered instances, and request builders, shared by the route-service tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import zmq
from kit.route_core import BS, ROOT, make_core  # noqa: F401  (re-exported to the tests)

from smetric_lmc.controller.service import RouteCore, RouteService
from smetric_lmc.hashing import fast_chain
from smetric_lmc.wire import (
    RouteRequest,
)

PROMPT = list(range(1000, 1000 + 40 * BS + 7))  # 40 full blocks and a partial one

class ServiceThread:
    """A RouteService on its own event loop in a thread, so blocking test clients can call it."""

    def __init__(self, core: RouteCore, url: str = "tcp://127.0.0.1:*", **kw: object) -> None:
        self.core = core
        self.url = url
        self.kw = kw
        self.endpoint = ""
        self.service: RouteService | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        ctx = zmq.asyncio.Context()
        try:
            self.service = RouteService(self.core, self.url, ctx=ctx, **self.kw)  # type: ignore[arg-type]
            self.endpoint = self.service.bind()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_until_complete(self.service.run())
        finally:
            loop.run_until_complete(self.service.close())
            ctx.destroy(linger=0)
            loop.close()

    def __enter__(self) -> ServiceThread:
        self._thread.start()
        self._ready.wait(5)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self._loop is not None and self.service is not None
        fut = asyncio.run_coroutine_threadsafe(self.service.close(), self._loop)
        fut.result(5)
        self._thread.join(5)


def seed(core: RouteCore, instance: str, tokens: list[int]) -> None:
    core.index.gpu_stored_hashes(instance, fast_chain(tokens, BS, root=ROOT))

@contextlib.contextmanager
def connect_dealer(endpoint: str) -> Iterator[zmq.Socket]:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 3000)
    s.connect(endpoint)
    try:
        yield s
    finally:
        s.close(linger=0)

def route_req(rid: str = "r1", **kw: object) -> RouteRequest:
    kw.setdefault("token_ids", PROMPT)
    return RouteRequest(request_id=rid, turn=2, est_hit_tokens=len(PROMPT) - 50, **kw)  # type: ignore[arg-type]
