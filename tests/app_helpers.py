"""Engine stand-ins (recorded KV events, a fake HTTP engine) and a base controller config, shared by the controller-app tests."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web
from services import free_port

END = ((1 << 64) - 1).to_bytes(8, "big")

def base_config(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": "tiny",
        "hashing": {"block_size": 32},
        "instances": [
            {"id": "a", "http": "http://127.0.0.1:9"},
            {"id": "b", "http": "http://127.0.0.1:9"},
        ],
        "server": {"route_url": "tcp://127.0.0.1:*", "metrics_port": 0},
        "load": {"metrics_poll_s": 0},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg

class FakeEngine:
    """An aiohttp server standing in for a vLLM engine's /metrics endpoint."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.running = 0
        self.waiting = 0
        self.hits = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, _req: web.Request) -> web.Response:
        self.hits += 1
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {float(self.running)}\n'
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {float(self.waiting)}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

class RecordedEngine:
    """Publishes the recorded vLLM frames on a real XPUB and answers replays from the recording."""

    def __init__(self, frames: list[list[str]], ctx: zmq.asyncio.Context) -> None:
        self.frames = [[bytes.fromhex(x) for x in f] for f in frames]
        self.pub_port, self.replay_port = free_port(), free_port()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # a storm must not be dropped at the publisher
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.replay_requests: list[int] = []
        self.published = -1  # replay serves what the engine has produced so far, lost batches included
        self._task = asyncio.create_task(self._serve_replay())

    async def wait_subscribed(self) -> None:
        # XPUB hands us the subscription: publishing before it would be lost (slow joiner).
        msg = await asyncio.wait_for(self.pub.recv(), 5)
        assert msg[:1] == b"\x01"

    async def publish(self, seq: int) -> None:
        self.published = max(self.published, seq)
        await self.pub.send_multipart(self.frames[seq])

    async def _serve_replay(self) -> None:
        # A test may close the replay before this task first runs. pyzmq then receives through the
        # freed libzmq handle: a socket opened later at that address (the controller's route
        # ROUTER) loses its messages to this task. So never receive on a closed socket.
        while not self.replay.closed:
            ident, empty, start = await self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for topic, seq, payload in self.frames[first : self.published + 1]:
                await self.replay.send_multipart([ident, empty, topic, seq, payload])
            await self.replay.send_multipart([ident, empty, b"", END, b""])

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        self.replay.close(linger=0)
