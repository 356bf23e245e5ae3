"""Replays a workload against an OpenAI-compatible endpoint as live agent sessions.

Sessions start as the simulator places them (``sim.cluster.place_sessions``: Poisson starts at
``rate``, seeded order; sub-agents start when the parent request that spawned them completes).
Closed loop: a session's next request goes out after the reply plus its recorded think time;
open loop: every request at its recorded offset. Both are scaled by ``time_scale``. Each request
resends the session's whole context as token ids (``replay.prompts``) to ``/v1/completions`` with
``max_tokens`` = recorded output, ``ignore_eos`` and streaming, and yields one ``Record``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp

from smetric_lmc.lab.replay.prompts import TokenSpace, prompt_tokens
from smetric_lmc.lab.sim.cluster import chained_lcp, place_sessions
from smetric_lmc.lab.workload.model import TraceRequest, TraceSession, Workload

log = logging.getLogger(__name__)


@dataclass
class ReplayConfig:
    url: str  # base URL of the endpoint (a gateway or one engine), e.g. http://127.0.0.1:8080
    model: str = "tiny"
    rate: float = 0.5  # root sessions started per second
    arrival: Literal["closed", "open"] = "closed"
    time_scale: float = 1.0  # multiplies think times (closed) and recorded offsets (open)
    max_think_s: float = 600.0  # recorded think times are clipped here first, as in the simulator
    sessions: int | None = None  # replay only this many root sessions (with their sub-agents)
    seed: int = 0
    concurrency: int = 256  # requests in flight at most
    context_scale: float = 1.0  # prompt lengths (and shared prefixes) times this
    output_scale: float = 1.0
    max_output: int | None = None
    max_model_len: int | None = None  # requests longer than this are skipped and counted as rejected
    tokens: TokenSpace = field(default_factory=TokenSpace)
    timeout_s: float = 600.0
    records: Path | None = None  # JSON lines, one per request
    # Closed loop: a request that continues its predecessor resends the predecessor's prompt and the
    # tokens the engine actually generated (vLLM's return_token_ids), as an agent does, so the answer's
    # blocks can hit too; off: the recorded tokens stand in for the answer and never hit.
    feedback: bool = True
    # Send each prompt as the text whose characters are its token ids (ids below 128: ASCII), for
    # routers that take only text prompts (SGLang's); the mock engine's byte tokenizer maps it back.
    text_prompts: bool = False
    # Stop with ReplayAborted after this many connection failures in a row (nothing answered
    # between them): a wrong --url fails fast instead of failing every request of the trace.
    max_connect_failures: int = 5
    # Headers that carry each replayed session's key (vllm-router's x-session-id, SGLang's
    # X-SMG-Routing-Key, ours X-SMetric-Session), for routers with session affinity; a key is unique
    # to one replayed session of one run (sub-agents are sessions of their own).
    session_headers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.text_prompts and self.tokens.vocab_size > 128:
            raise ValueError("text_prompts needs token ids below 128 (tokens.vocab_size <= 128)")
        for name in ("rate", "time_scale", "context_scale", "output_scale", "concurrency", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.context_scale > 1:
            raise ValueError("context_scale must be <= 1 (prompts can only shrink)")


@dataclass
class Record:
    session: int  # index of the replayed session
    session_id: str  # the trace's session id
    request: int  # index of the request in its session
    turn: int
    input: int
    output: int
    arrival: float = float("nan")  # seconds since the replay started (sent)
    first_token: float = float("nan")
    finish: float = float("nan")
    status: int = 0
    ok: bool = False
    rejected: bool = False
    error: str = ""
    prompt_tokens: int = 0  # from the engine's usage
    completion_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    instance: str = ""  # X-SMetric-Instance (empty when the endpoint is an engine)
    reason: str = ""  # X-SMetric-Reason
    local_hit: int | None = None  # X-SMetric-Local-Hit: the controller's predicted cached tokens
    answer_reused: int = 0  # tokens of the predecessor's generated answer resent in this prompt
    est_hit: int = 0  # sent as X-SMetric-Est-Hit: the prefix shared with the session's previous request
    policy: str = ""


class ReplayAborted(RuntimeError):
    """The endpoint could not be reached ``max_connect_failures`` times in a row."""


class Replay:
    def __init__(self, workload: Workload, cfg: ReplayConfig, progress: Callable[[int], None] | None = None,
                 on_total: Callable[[int], None] | None = None) -> None:
        self.wl = workload
        self.cfg = cfg
        self.records: list[Record] = []
        self._progress = progress
        self._on_total = on_total  # told the number of requests the run will send, once known
        self._connect_failures = 0
        self._aborted: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._sem = asyncio.Semaphore(cfg.concurrency)
        self._n_sessions = 0
        self._t0 = 0.0
        self._http: aiohttp.ClientSession | None = None
        self._out: Any = None
        self.placed_requests = 0
        self._last_prompt: dict[int, list[int]] = {}
        self._run_key = uuid.uuid4().hex[:8]

    # ---- run -------------------------------------------------------------------------------------
    async def run(self) -> list[Record]:
        cfg = self.cfg
        pl = place_sessions(self.wl, cfg.rate, cfg.seed, cfg.sessions)
        self._children: dict[tuple[str, int], list[TraceSession]] = {}
        for pid, kids in pl.children.items():
            for j, child, _ in kids:
                self._children.setdefault((pid, j), []).append(child)
        roots = {s.session_id for s, *_ in pl.roots}
        rel = self.wl.absolute_start()
        root_of = self.wl.root_of()
        self.placed_requests = sum(len(s.requests) for s in self.wl.sessions if root_of[s.session_id] in roots)
        if self._on_total is not None:
            self._on_total(self.placed_requests)
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=10.0)
        connector = aiohttp.TCPConnector(limit=cfg.concurrency + 8)
        self._out = cfg.records.open("w") if cfg.records else None
        try:
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
                self._http = http
                if cfg.max_model_len is None:
                    cfg.max_model_len = await self._served_max_len()
                self._t0 = time.monotonic()
                start_of = {s.session_id: t for s, t, *_ in pl.roots}
                for s, t, *_ in pl.roots:
                    self._spawn(self._session(s, t))
                if cfg.arrival == "open":
                    for kids in pl.children.values():
                        for _, child, _ in kids:
                            root = root_of[child.session_id]
                            t = start_of[root] + max(0.0, rel[child.session_id] - rel[root]) * cfg.time_scale
                            self._spawn(self._session(child, t))
                try:
                    while self._tasks and self._aborted is None:
                        await asyncio.wait(list(self._tasks), return_when=asyncio.FIRST_COMPLETED)
                finally:  # aborted, or cancelled (Ctrl-C): stop the sessions while the HTTP session is open
                    for t in list(self._tasks):
                        t.cancel()
                    await asyncio.gather(*list(self._tasks), return_exceptions=True)
                if self._aborted is not None:
                    raise ReplayAborted(self._aborted)
        finally:
            if self._out is not None:
                self._out.close()
        return self.records

    async def _served_max_len(self) -> int | None:
        """vLLM's /v1/models card says how long a request may be; longer ones are skipped as rejected."""
        assert self._http is not None
        try:
            async with self._http.get(self.cfg.url.rstrip("/") + "/v1/models") as resp:
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("replay: /v1/models unavailable (%s); not checking request lengths", exc)
            return None
        for card in data.get("data") or () if isinstance(data, dict) else ():
            if card.get("id") == self.cfg.model and isinstance(card.get("max_model_len"), int):
                log.info("replay: %s serves up to %d tokens per request", self.cfg.model, card["max_model_len"])
                return int(card["max_model_len"])
        log.warning("replay: /v1/models does not list %r with a max_model_len", self.cfg.model)
        return None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _now(self) -> float:
        return time.monotonic() - self._t0

    async def _sleep_until(self, t: float) -> None:
        dt = t - self._now()
        if dt > 0:
            await asyncio.sleep(dt)

    # ---- sessions --------------------------------------------------------------------------------
    async def _session(self, trace: TraceSession, start: float) -> None:
        if not trace.requests:
            return
        idx = self._n_sessions
        self._n_sessions += 1
        cfg = self.cfg
        if cfg.arrival == "open":
            for k in range(len(trace.requests)):
                at = start + trace.requests[k].arrival * cfg.time_scale
                self._spawn(self._open_request(trace, idx, k, at))
            return
        await self._sleep_until(start)
        sent: tuple[list[int], list[int]] | None = None  # the previous request's prompt and answer
        for k, tr in enumerate(trace.requests):
            if k:
                await asyncio.sleep(min(max(0.0, tr.think_time), cfg.max_think_s) * cfg.time_scale)
            prefix = None
            if cfg.feedback and sent is not None and continues(trace.requests[k - 1], tr):
                prefix = sent[0] + sent[1]
            sent = await self._request(trace, idx, k, prefix)
            for child in self._children.get((trace.session_id, k), ()):
                self._spawn(self._session(child, self._now()))

    async def _open_request(self, trace: TraceSession, idx: int, k: int, at: float) -> None:
        await self._sleep_until(at)
        await self._request(trace, idx, k)

    # ---- one request ------------------------------------------------------------------------------
    def prompt(self, trace: TraceSession, idx: int, k: int) -> list[int]:
        """The token ids replayed for request ``k`` of ``trace`` (replayed as session ``idx``)."""
        return prompt_tokens(trace.requests[k], self.wl.block_size, self.cfg.tokens, scale=self.cfg.context_scale,
                             salt=(idx << 20) | k)

    async def _request(self, trace: TraceSession, idx: int, k: int,
                       prefix: list[int] | None = None) -> tuple[list[int], list[int]] | None:
        """Send request ``k``; returns (prompt, generated ids) when it succeeded."""
        cfg = self.cfg
        tr = trace.requests[k]
        ids = self.prompt(trace, idx, k)
        reused = 0
        if prefix is not None and len(prefix) <= len(ids):
            reused = len(prefix) - len(self._last_prompt.get(idx, ()))
            ids = prefix + ids[len(prefix):]
        out = max(1, round(tr.output_tokens * cfg.output_scale))
        if cfg.max_output is not None:
            out = min(out, cfg.max_output)
        rec = Record(idx, trace.session_id, k, tr.turn, len(ids), out)
        # What the session's previous request should have left cached, as the simulator computes it.
        if tr.turn > 0 and k > 0:
            shared = chained_lcp(trace.requests[k - 1].block_ids, tr.block_ids) * self.wl.block_size
            rec.est_hit = min(len(ids), round(shared * cfg.context_scale))
        rec.answer_reused = reused
        if cfg.max_model_len is not None and len(ids) + out > cfg.max_model_len:
            rec.rejected = True
            rec.error = f"longer than max_model_len {cfg.max_model_len}"
            rec.arrival = rec.finish = self._now()
            self._done(rec)
            return None
        prompt: list[int] | str = "".join(map(chr, ids)) if cfg.text_prompts else ids
        body = {"model": cfg.model, "prompt": prompt, "max_tokens": out, "ignore_eos": True, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        # With text prompts the answer's text is its ids (the byte tokenizer): no return_token_ids,
        # a field vllm-router's kv_aware does not model and so gives such a request no cache credit.
        if cfg.feedback and not cfg.text_prompts:
            body["return_token_ids"] = True
        generated: list[int] = []
        async with self._sem:
            rec.arrival = self._now()
            try:
                await self._send(body, rec, generated)
                self._connect_failures = 0
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
                    self._connect_failures += 1
                    if self._connect_failures >= cfg.max_connect_failures and self._aborted is None:
                        self._aborted = (f"cannot reach {cfg.url}: {self._connect_failures} connection failures "
                                         f"in a row ({exc.__class__.__name__}: {exc}); is --url right and the "
                                         "endpoint up?")
                        for t in list(self._tasks):  # sessions sleeping between turns too
                            t.cancel()
            rec.finish = self._now()
        self._done(rec)
        if not rec.ok:
            return None
        self._last_prompt[idx] = ids
        return ids, generated

    async def _send(self, body: dict[str, Any], rec: Record, generated: list[int]) -> None:
        assert self._http is not None
        headers = {"X-SMetric-Turn": str(rec.turn), "X-SMetric-Est-Hit": str(rec.est_hit)}
        for name in self.cfg.session_headers:
            headers[name] = f"{self._run_key}-{rec.session}"
        async with self._http.post(self.cfg.url.rstrip("/") + "/v1/completions", json=body, headers=headers) as resp:
            rec.status = resp.status
            rec.instance = resp.headers.get("X-SMetric-Instance", "")
            rec.reason = resp.headers.get("X-SMetric-Reason", "")
            rec.policy = resp.headers.get("X-SMetric-Policy", "")
            hit = resp.headers.get("X-SMetric-Local-Hit")
            rec.local_hit = int(hit) if hit and hit.isdigit() else None
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj or obj.get("object") == "error":
                    rec.error = f"stream error: {json.dumps(obj)[:300]}"
                    return
                choices = obj.get("choices") or ()
                # A token whose text the detokenizer holds back (part of a character, a special
                # token) arrives with empty text but its id: it is the first token all the same.
                if any(c.get("text") or c.get("token_ids") for c in choices) and rec.first_token != rec.first_token:
                    rec.first_token = self._now()
                for c in choices:
                    ids = c.get("token_ids")
                    if ids is None and self.cfg.text_prompts:
                        ids = [ord(ch) for ch in c.get("text") or ""]  # a router that drops token_ids
                    generated.extend(ids or ())
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens")
                    rec.cached_tokens = int(cached) if cached is not None else None
            if not done:
                rec.error = "stream ended without [DONE]"
                return
            rec.ok = True

    def _done(self, rec: Record) -> None:
        self.records.append(rec)
        if self._out is not None:
            self._out.write(json.dumps(asdict(rec)) + "\n")
        if rec.error and not rec.rejected:
            log.warning("replay: session %d request %d failed: %s", rec.session, rec.request, rec.error)
        if self._progress is not None:
            self._progress(1)


def continues(prev: TraceRequest, cur: TraceRequest) -> bool:
    """The trace says ``cur``'s prompt is ``prev``'s prompt followed by more (its answer, then new input)."""
    n = len(prev.block_ids)
    return len(cur.block_ids) > n and (n == 0 or cur.block_ids[n - 1] == prev.block_ids[n - 1])


def replay(workload: Workload, cfg: ReplayConfig, progress: Callable[[int], None] | None = None) -> list[Record]:
    """Run a replay to completion (its own event loop)."""
    return asyncio.run(Replay(workload, cfg, progress).run())
