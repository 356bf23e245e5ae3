"""What the gateway learns from a request body before routing it, and from a response after.

* :class:`PromptReader` turns an OpenAI request into the prompt's token ids, its turn and its
  est_hit (DESIGN.md §1), either with the served model's own tokenizer and chat template, local
  (``LocalChatTokenizer`` from ``tokenizers`` + ``jinja2``, or ``HFChatTokenizer`` with
  ``transformers``), or by asking an engine's ``POST /tokenize``, which applies the same chat
  template the engine will apply (a round trip per request).
* :class:`UsageSniffer` reads a *copy* of the bytes streamed back to the client (SSE or JSON) to
  pick up ``usage`` for the done report; the client's bytes are never touched.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from smetric_lmc.backoff import Backoff
from smetric_lmc.gateway_metrics import GatewayMetrics
from smetric_lmc.session import ChatTokenEstimator, ChatTokenizer, Message, history_of, turn_of

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]

# Request fields that change how the chat template renders; /tokenize accepts the same names.
_EXPLORE = 16
_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                    "chat_template", "chat_template_kwargs")

# Prompts up to this many (estimated) tokens are tokenized on the event loop (well under a
# millisecond); longer ones in a worker thread, whose hand-off costs more than a short prompt's
# whole tokenization but keeps a long one from stalling other requests.
_INLINE_TOKENS = 2048

# What the local tokenizer is checked on: roles, tools, a tool call, digits, spacing and non-ASCII
# text, where tokenizer pipelines (normalizer, split rules, template) tend to differ.
_PROBE_TOOLS = [{"type": "function", "function": {"name": "grep", "description": "Search files ✓",
                 "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}}}}]
_PROBE_CHAT: list[Message] = [
    {"role": "system", "content": "You are a coding agent.  Two spaces, a tab\tand 1234567 digits."},
    {"role": "user", "content": "Trouve « l'erreur » dans main.py:42 — 日本語 🎉\n\n  indented"},
    {"role": "assistant", "content": "Looking.", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "grep", "arguments": "{\"pattern\": \"def main\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "main.py:42: def main() -> None:"},
]


class BadRequest(ValueError):
    """The client's request cannot be routed as sent (answered with HTTP 400)."""


@dataclass(frozen=True, slots=True)
class PromptInfo:
    token_ids: list[int] | None  # None: no tokenizer reachable; routing then falls back to load only
    turn: int | None  # None: unknown (a completion without an explicit turn)
    est_hit_tokens: int | None
    approx_tokens: int  # used for load accounting when token_ids is None


def parse_turn_header(value: str | None, name: str = "X-SMetric-Turn") -> int | None:
    """A non-negative integer header (``X-SMetric-Turn``, ``X-SMetric-Est-Hit``), None when absent."""
    if value is None or value.strip() == "":
        return None
    try:
        turn = int(value)
    except ValueError:
        raise BadRequest(f"{name} must be a non-negative integer, got {value!r}") from None
    if turn < 0:
        raise BadRequest(f"{name} must be a non-negative integer, got {value!r}")
    return turn


class PromptReader:
    """Token ids, turn and est_hit of chat and completion requests."""

    def __init__(
        self,
        tokenize_urls: Sequence[str],
        http: aiohttp.ClientSession,
        hf: ChatTokenizer | None = None,
        timeout_s: float = 10.0,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._urls = [u.rstrip("/") for u in tokenize_urls]
        # Tokenizing on a saturated engine can take seconds (its API server shares the CPU with
        # generation), so calls go to the engine that answered fastest lately; every
        # _EXPLORE-th call goes round-robin so a recovered engine's latency is noticed.
        self._latency = dict.fromkeys(self._urls, 0.0)
        self._calls = itertools.count()
        self._http = http
        self._hf = hf
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._metrics = metrics
        # The one estimate for prompts no tokenizer counted, calibrated on the ones that were.
        self.estimator = ChatTokenEstimator()
        self.counters = {"tokenize_calls": 0, "tokenize_failures": 0, "untokenized": 0}

    async def read(self, kind: Kind, body: dict[str, Any], explicit_turn: int | None) -> PromptInfo:
        if kind == "chat":
            return await self._chat(body, explicit_turn)
        return await self._completion(body, explicit_turn)

    # ---- chat -----------------------------------------------------------------------------------
    async def _chat(self, body: dict[str, Any], explicit_turn: int | None) -> PromptInfo:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a list of objects")
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        turn = turn_of(messages) if explicit_turn is None else explicit_turn
        hist = history_of(messages) if turn > 0 else []
        approx = self.estimator.count(messages, tools)
        if self._hf is not None:
            if approx <= _INLINE_TOKENS:
                ids, est = self._hf_counts(messages, hist, tools, body)
            else:
                ids, est = await asyncio.to_thread(self._hf_counts, messages, hist, tools, body)
            return PromptInfo(ids, turn, est, approx)
        extra = {k: body[k] for k in _TEMPLATE_FIELDS if k in body}
        full = self._tokenize({"model": body.get("model"), "messages": messages, "tools": tools, **extra})
        # est_hit is the history rendered on its own: no generation prompt, nothing continued.
        hist_body = {"model": body.get("model"), "messages": hist, "tools": tools, "add_generation_prompt": False}
        if "chat_template_kwargs" in body:
            hist_body["chat_template_kwargs"] = body["chat_template_kwargs"]
        if hist:
            ids, hist_ids = await asyncio.gather(full, self._tokenize(hist_body))
        else:
            ids, hist_ids = await full, []
        if hist_ids:
            self.estimator.observe(hist, tools, len(hist_ids))
        elif ids:
            self.estimator.observe(messages, tools, len(ids))
        est = len(hist_ids) if hist_ids is not None else self.estimator.count(hist, tools)
        return PromptInfo(ids, turn, est, approx)

    def _hf_counts(
        self, messages: list[Message], hist: list[Message], tools: list[dict] | None, body: dict[str, Any]
    ) -> tuple[list[int], int]:
        assert self._hf is not None
        ids = self._hf.encode_chat(messages, tools, generation=bool(body.get("add_generation_prompt", True)))
        est = self._hf.count(hist, tools) if hist else 0
        return ids, est

    # ---- completions --------------------------------------------------------------------------
    async def _completion(self, body: dict[str, Any], explicit_turn: int | None) -> PromptInfo:
        prompt = body.get("prompt")
        # A batch routes as one request: by its first prompt (all of it goes to one instance).
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) and t >= 0 for t in prompt):
            return PromptInfo(list(prompt), explicit_turn, None, len(prompt))
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string, a list of strings or a list of token ids")
        approx = self.estimator.count_text(prompt)
        if self._hf is not None:
            special = bool(body.get("add_special_tokens", True))
            if approx <= _INLINE_TOKENS:
                ids = self._hf.encode_prompt(prompt, special)
            else:
                ids = await asyncio.to_thread(self._hf.encode_prompt, prompt, special)
            return PromptInfo(ids, explicit_turn, None, approx)
        extra = {"add_special_tokens": body["add_special_tokens"]} if "add_special_tokens" in body else {}
        ids = await self._tokenize({"model": body.get("model"), "prompt": prompt, **extra})
        return PromptInfo(ids, explicit_turn, None, approx)

    # ---- the local tokenizer, checked against the engines' --------------------------------------
    @property
    def local(self) -> bool:
        """Whether prompts are tokenized here (a tokenizer directory) rather than by an engine."""
        return self._hf is not None

    async def check_local(self, model: str | None, attempts: int = 20, first_wait_s: float = 0.5) -> bool | None:
        """Tokenize a probe chat here and with an engine's /tokenize; on any difference, log it
        and tokenize with the engines from now on (a tokenizer that disagrees with the engine's
        routes every request on hashes no engine will ever report). True: they agree; False: they
        differ; None: no engine answered in ``attempts`` tries (the local tokenizer stays)."""
        if self._hf is None or not self._urls:
            return None
        mine = self._hf.encode_chat(_PROBE_CHAT, _PROBE_TOOLS, generation=True)
        body = {"model": model, "messages": _PROBE_CHAT, "tools": _PROBE_TOOLS, "add_generation_prompt": True}
        backoff = Backoff(first_wait_s, 30.0)
        for _ in range(attempts):
            for url in self._urls:
                theirs = await self._engine_ids(url, {k: v for k, v in body.items() if v is not None})
                if theirs is None:
                    continue
                if theirs == mine:
                    log.info("gateway: the local tokenizer agrees with %s/tokenize on the probe chat", url)
                    self.counters["local_tokenizer_checked"] = 1
                    return True
                k = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                log.error("gateway: the local tokenizer disagrees with %s/tokenize on the probe chat (%d vs %d "
                          "tokens, first difference at token %d): tokenizing with the engines' /tokenize instead; "
                          "point --tokenizer at the served model's own tokenizer directory", url, len(mine),
                          len(theirs), k)
                self._hf = None
                self.counters["local_tokenizer_mismatch"] = 1
                return False
            await asyncio.sleep(backoff.next())
        log.warning("gateway: no engine answered /tokenize; the local tokenizer was not checked against them")
        return None

    async def _engine_ids(self, url: str, payload: dict[str, Any]) -> list[int] | None:
        """One engine's /tokenize of ``payload`` (a check: neither counted nor timed)."""
        try:
            async with self._http.post(f"{url}/tokenize", json=payload, timeout=self._timeout) as resp:
                data = await resp.json(content_type=None)
                if resp.status == 200 and isinstance(data, dict) and isinstance(data.get("tokens"), list):
                    return [int(t) for t in data["tokens"]]
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError):
            pass
        return None

    # ---- engine /tokenize ---------------------------------------------------------------------
    async def _tokenize(self, payload: dict[str, Any]) -> list[int] | None:
        """Token ids from the first engine that answers; None when none does.

        Every call has its own deadline (``timeout_s``) and every failed one is counted by outcome
        (``smetric_gateway_tokenize_failures_total``) and logged; a prompt none tokenized is
        estimated instead (``smetric_gateway_untokenized_prompts_total``)."""
        if not self._urls:
            return None
        payload = {k: v for k, v in payload.items() if v is not None}
        for url in self._order():
            self.counters["tokenize_calls"] += 1
            t0 = time.monotonic()
            try:
                async with self._http.post(f"{url}/tokenize", json=payload, timeout=self._timeout) as resp:
                    data = await resp.json(content_type=None)
                    self._observe(url, time.monotonic() - t0)
                    if resp.status == 200 and isinstance(data, dict) and isinstance(data.get("tokens"), list):
                        return [int(t) for t in data["tokens"]]
                    if 400 <= resp.status < 500:
                        # The engine rejects the request itself; it will reject the real call too.
                        log.info("tokenize rejected url=%s status=%s: routing on the estimate", url, resp.status)
                        self._failed("rejected")
                        return self._untokenized()
                    log.warning("tokenize failed url=%s status=%s", url, resp.status)
                    self._failed("status")
            except asyncio.TimeoutError:
                self._observe(url, self._timeout.total or 10.0)
                log.warning("tokenize failed url=%s: no answer within %.1f s", url, self._timeout.total or 0.0)
                self._failed("timeout")
            except (aiohttp.ClientError, ValueError) as exc:
                self._observe(url, self._timeout.total or 10.0)
                log.warning("tokenize failed url=%s error=%s", url, exc or type(exc).__name__)
                self._failed("error")
        return self._untokenized()

    def _failed(self, outcome: str) -> None:
        self.counters["tokenize_failures"] += 1
        if self._metrics is not None:
            self._metrics.observe_tokenize_failure(outcome)

    def _untokenized(self) -> None:
        self.counters["untokenized"] += 1
        if self._metrics is not None:
            self._metrics.untokenized.inc()
        return None

    @property
    def urls(self) -> list[str]:
        """The engines' tokenize base URLs in use (a copy)."""
        return list(self._urls)

    def add_url(self, url: str) -> None:
        """Tokenize with one more engine (it joined a running gateway)."""
        url = url.rstrip("/")
        if url not in self._latency:
            self._urls.append(url)
            self._latency[url] = 0.0

    def remove_url(self, url: str) -> None:
        url = url.rstrip("/")
        if self._latency.pop(url, None) is not None:
            self._urls.remove(url)

    def _order(self) -> list[str]:
        k = next(self._calls)
        if k % _EXPLORE == 0:
            start = (k // _EXPLORE) % len(self._urls)
            return self._urls[start:] + self._urls[:start]
        return sorted(self._urls, key=self._latency.__getitem__)

    def _observe(self, url: str, seconds: float) -> None:
        if url in self._latency:  # not when its engine left during the call
            self._latency[url] = 0.7 * self._latency[url] + 0.3 * seconds


class UsageSniffer:
    """Reads ``usage`` (and a rough output count) from a copy of a response body.

    SSE bodies are parsed line by line as they stream; a JSON body is kept (up to ``limit`` bytes)
    and parsed at the end. Only OpenAI's shapes are understood; anything else yields no usage.
    """

    def __init__(self, content_type: str, limit: int = 8 << 20) -> None:
        self.sse = content_type.startswith("text/event-stream")
        self.limit = limit
        self._buf = bytearray()
        self._overflow = False
        self.usage: dict[str, Any] | None = None
        self.content_chunks = 0  # streamed chunks that carried generated text
        self.complete = False  # an SSE stream's ``data: [DONE]`` went by: the answer is whole

    def feed(self, chunk: bytes) -> None:
        if self._overflow:
            return
        self._buf += chunk
        if self.sse:
            *lines, rest = bytes(self._buf).split(b"\n")
            self._buf = bytearray(rest)
            for line in lines:
                self._sse_line(line.strip())
        if len(self._buf) > self.limit:
            self._overflow = True
            self._buf.clear()

    def finish(self) -> None:
        if self._overflow:
            return
        if self.sse:
            self._sse_line(bytes(self._buf).strip())
        else:
            try:
                obj = json.loads(self._buf)
            except ValueError:
                return
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
        self._buf.clear()

    def _sse_line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.complete = True
            return
        if not data:
            return
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                self.content_chunks += 1

    # ---- the done report's numbers ----------------------------------------------------------------
    def prompt_tokens(self) -> int | None:
        return _int(self.usage, "prompt_tokens")

    def output_tokens(self) -> int:
        n = _int(self.usage, "completion_tokens")
        return n if n is not None else self.content_chunks  # vLLM streams about a token a chunk

    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details")
        return _int(details, "cached_tokens")


def _int(obj: Any, key: str) -> int | None:
    if not isinstance(obj, dict):
        return None
    v = obj.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None
