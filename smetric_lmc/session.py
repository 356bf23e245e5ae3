"""Session logic from the request alone (stateless routing): turn and est_hit.

* ``turn`` = number of assistant messages the request carries (0 = the session's first request).
* ``est_hit`` = chat-templated token length of the carried history — messages up to and including
  the last assistant message, plus ``tools`` — i.e. what the session's earlier turns should have
  left cached; the router rounds it down to the index's block size.

The gateway counts est_hit exactly whenever it can: with the served model's tokenizer and chat
template (``HFChatTokenizer``) or an engine's ``/tokenize``. When neither answers, the one estimate
is :class:`ChatTokenEstimator`, which calibrates itself on every exact count the gateway did get
(``observe``), so it follows the served tokenizer rather than a guess. ``python
bench/decide.py --probe est_hit_error`` measures its error against a real tokenizer and chat template on held-out
conversations.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

Message = dict[str, Any]


def turn_of(messages: Sequence[Message]) -> int:
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def history_of(messages: Sequence[Message]) -> list[Message]:
    """Messages up to and including the last assistant message (what earlier turns cached)."""
    last = -1
    for k, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant":
            last = k
    return list(messages[: last + 1])


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content, ensure_ascii=False)


def text_bytes(messages: Sequence[Message], tools: Sequence[dict] | None) -> int:
    """UTF-8 bytes of what a chat template renders as text: contents, tool calls, tool schemas."""
    n = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        n += len(_content_text(m.get("content")).encode())
        if m.get("tool_calls"):
            n += len(json.dumps(m["tool_calls"], ensure_ascii=False).encode())
    if tools:
        n += len(json.dumps(list(tools), ensure_ascii=False).encode())
    return n


class ChatTokenEstimator:
    """Token count of chat-templated messages without a tokenizer: text bytes / bytes-per-token plus
    a fixed cost per message (the template's role markers).

    Starts at 4 bytes a token (BPE vocabularies of current chat models on English and code) and 5
    tokens a message (ChatML-style wrappers); from the first exact count the caller observes on, the
    rate is the served tokenizer's: text bytes over text tokens of the observations, older ones
    weighing less (``decay`` per observation), so it follows a changed model.
    """

    def __init__(self, bytes_per_token: float = 4.0, per_message: int = 5, decay: float = 0.98) -> None:
        self.bytes_per_token = bytes_per_token
        self.per_message = per_message
        self.decay = decay  # weight of the past per observation: adapts over ~1 / (1 - decay) of them
        self.observations = 0
        self._bytes = 0.0
        self._tokens = 0.0

    def count(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> int:
        wrappers = self.per_message * (len(messages) + (1 if tools else 0))
        return int(text_bytes(messages, tools) / self.bytes_per_token) + wrappers

    def count_text(self, text: str) -> int:
        """Tokens of plain text (a completions prompt)."""
        return int(len(text.encode()) / self.bytes_per_token)

    def observe(self, messages: Sequence[Message], tools: Sequence[dict] | None, tokens: int) -> None:
        """Learn from an exact count of ``messages`` (+ ``tools``) rendered by the served template."""
        nbytes = text_bytes(messages, tools)
        text_tokens = tokens - self.per_message * (len(messages) + (1 if tools else 0))
        if nbytes < 64 or text_tokens <= 0:  # too little text to say anything about the rate
            return
        self._bytes = self.decay * self._bytes + nbytes
        self._tokens = self.decay * self._tokens + text_tokens
        self.bytes_per_token = min(8.0, max(0.5, self._bytes / self._tokens))
        self.observations += 1


class ChatTokenizer(Protocol):
    """The served model's tokenizer and chat template, local to the gateway."""

    def encode_chat(self, messages: Sequence[Message], tools: Sequence[dict] | None, *,
                    generation: bool) -> list[int]: ...

    def count(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> int: ...

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class HFChatTokenizer:
    """The served model's own tokenizer and chat template (optional extra ``smetric-lmc[hf]``)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer  # heavy, optional

        self.tok = AutoTokenizer.from_pretrained(model_dir)

    def encode_chat(self, messages: Sequence[Message], tools: Sequence[dict] | None, *, generation: bool) -> list[int]:
        ids = self.tok.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, tokenize=True, add_generation_prompt=generation
        )
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def count(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> int:
        return len(self.encode_chat(messages, tools, generation=False))

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))


#: Session headers the peer ecosystems send, accepted next to ours: production-stack's router reads
#: the header its ``--session-key`` names (added per deployment), NVIDIA Dynamo's frontend
#: ``x-dynamo-session-id``, SGLang's model gateway ``X-SMG-Routing-Key``.
SESSION_HEADERS = ("X-SMetric-Session", "x-dynamo-session-id", "X-SMG-Routing-Key")


class SessionHints:
    """Turn and est_hit for requests that name their session in a header but carry no turn.

    A chat request's turn comes from its messages; a completion's prompt does not say it. With a
    session header, the n-th request of that session is turn n, and its expected hit is what the
    previous request of the session sent (its prompt is cached where it ran). Only sessions are
    remembered, at most ``capacity`` of them, least recently used first out; O(1) per request.
    """

    def __init__(self, headers: Sequence[str] = SESSION_HEADERS, capacity: int = 100_000) -> None:
        self.headers = tuple(dict.fromkeys(h.lower() for h in headers))
        self.capacity = capacity
        self._seen: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (requests, last prompt tokens)
        self.counters = {"hinted": 0, "sessions": 0}

    def add_header(self, name: str) -> None:
        if name and name.lower() not in self.headers:
            self.headers = (*self.headers, name.lower())

    def key(self, headers: Mapping[str, str]) -> str | None:
        for name in self.headers:
            value = headers.get(name)
            if value:
                return value[:256]  # bounded memory per remembered session
        return None

    def observe(self, key: str | None, turn: int | None, est_hit: int | None,
                prompt_tokens: int) -> tuple[int | None, int | None]:
        """(turn, est_hit) for a request of session ``key`` (unchanged when no key or already known)."""
        if key is None:
            return turn, est_hit
        n, last = self._seen.pop(key, (0, 0))
        if n == 0:
            self.counters["sessions"] += 1
        self._seen[key] = (n + 1, prompt_tokens)
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        if turn is not None:
            return turn, est_hit
        self.counters["hinted"] += 1
        return n, est_hit if est_hit is not None else (min(last, prompt_tokens) if n else None)
