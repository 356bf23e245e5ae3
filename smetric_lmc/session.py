"""Session logic from the request alone (stateless routing): turn and est_hit.

* ``turn`` = number of assistant messages the request carries (0 = the session's first request).
* ``est_hit`` = chat-templated token length of the carried history — messages up to and including
  the last assistant message, plus ``tools`` — i.e. what the session's earlier turns should have
  left cached; the router rounds it down to the index's block size.

Token counts come from a pluggable ``ChatTokenizer``: the served model's HF tokenizer and chat
template when ``transformers`` is installed (``HFChatTokenizer``), otherwise ``ApproxChatTokenizer``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Message = dict[str, Any]


class ChatTokenizer(Protocol):
    def count(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> int:
        """Token length of ``messages`` (and ``tools``) rendered by the chat template, no generation prompt."""
        ...


def turn_of(messages: Sequence[Message]) -> int:
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def history_of(messages: Sequence[Message]) -> list[Message]:
    """Messages up to and including the last assistant message (what earlier turns cached)."""
    last = -1
    for k, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant":
            last = k
    return list(messages[: last + 1])


@dataclass(frozen=True, slots=True)
class SessionInfo:
    turn: int
    est_hit_tokens: int


def session_info(
    messages: Sequence[Message],
    tools: Sequence[dict] | None,
    tokenizer: ChatTokenizer,
    explicit_turn: int | None = None,
) -> SessionInfo:
    """Turn and est_hit of a chat request; an explicit turn from the caller overrides the count."""
    turn = turn_of(messages) if explicit_turn is None else explicit_turn
    hist = history_of(messages)
    est = tokenizer.count(hist, tools) if hist and turn > 0 else 0
    return SessionInfo(turn, est)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content, ensure_ascii=False)


class ApproxChatTokenizer:
    """No-dependency estimate: UTF-8 bytes / ``bytes_per_token`` + a fixed per-message overhead.

    BPE vocabularies of current chat models average 3.5–4.5 bytes per token on English and code; the
    ChatML-style wrappers cost ~4–6 tokens a message. The error bound the tests check is ±25% of the
    true count on natural text for the reference tokenizer (and it only feeds est_hit, which SMetric
    compares against with HIT_RATIO = 0.5, so a 25% error does not flip the evicted test).
    """

    def __init__(self, bytes_per_token: float = 4.0, per_message: int = 5, tools_overhead: int = 10) -> None:
        self.bytes_per_token = bytes_per_token
        self.per_message = per_message
        self.tools_overhead = tools_overhead

    def count(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> int:
        nbytes = 0
        for m in messages:
            nbytes += len(_content_text(m.get("content")).encode())
            if m.get("tool_calls"):
                nbytes += len(json.dumps(m["tool_calls"], ensure_ascii=False).encode())
        n = int(nbytes / self.bytes_per_token) + self.per_message * len(messages)
        if tools:
            n += self.tools_overhead + int(len(json.dumps(list(tools), ensure_ascii=False).encode()) / self.bytes_per_token)
        return n


class HFChatTokenizer:
    """The served model's own tokenizer and chat template (optional extra ``smetric-lmc[hf]``)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer  # heavy, optional

        self.tok = AutoTokenizer.from_pretrained(model_dir)

    def encode_chat(self, messages: Sequence[Message], tools: Sequence[dict] | None, *, generation: bool) -> list[int]:
        ids = self.tok.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, tokenize=True, add_generation_prompt=generation
        )
        if isinstance(ids, dict):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def count(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> int:
        return len(self.encode_chat(messages, tools, generation=False))
