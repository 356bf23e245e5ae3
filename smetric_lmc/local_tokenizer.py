"""The served model's tokenizer and chat template, read from its directory without ``transformers``.

The gateway needs a prompt's token ids before it routes. Asking an engine's ``/tokenize`` costs a
round trip per request (and a second for est_hit); ``transformers`` answers locally but is a heavy
install. A tokenizer directory already holds all that is needed: ``tokenizer.json`` (the Rust
``tokenizers`` library encodes it) and the chat template (``tokenizer_config.json`` or
``chat_template.jinja``, a Jinja2 program). :class:`LocalChatTokenizer` renders the template the way
transformers' ``apply_chat_template`` does (a sandboxed, immutable Jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` that keeps non-ASCII,
``raise_exception`` and ``strftime_now``; the tokenizer's special tokens as variables) and encodes
the text without adding special tokens, as transformers does for a chat. vLLM's Rust router
tokenizes the same way (the ``tokenizers`` crate and a Jinja engine).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

Message = dict[str, Any]

# The special-token names transformers passes to a chat template as variables.
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerDirError(ValueError):
    """A tokenizer directory this class cannot serve (the message says what is missing)."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(directory: Path, config: dict[str, Any]) -> str:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():  # what newer transformers write beside the config
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise TokenizerDirError(f"{directory}: no chat template (tokenizer_config.json 'chat_template' "
                                "or chat_template.jinja)")
    return template


def _parsed_tool_calls(message: Message) -> Message:
    """The message as vLLM hands it to the template: each tool call's JSON ``arguments`` string
    parsed into an object, and its keys in the order of OpenAI's message types (``id``,
    ``function`` with ``arguments`` then ``name``, ``type``), which vLLM validates messages with; a
    template that writes a whole call with ``tojson`` sees that order. The caller's message is not
    changed."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_openai_order(c) if isinstance(c, dict) else c for c in calls]}


def _openai_order(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if isinstance(fn, dict):
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # not JSON: rendered as the string it is
                args = json.loads(args)
        fn = _ordered({**fn, "arguments": args} if "arguments" in fn else fn, ("arguments", "name"))
        call = {**call, "function": fn}
    return _ordered(call, ("id", "function", "type"))


def _ordered(d: dict[str, Any], first: tuple[str, ...]) -> dict[str, Any]:
    return {**{k: d[k] for k in first if k in d}, **{k: v for k, v in d.items() if k not in first}}


class LocalChatTokenizer:
    """Token ids of chats and texts from a tokenizer directory (``tokenizers`` + ``jinja2``)."""

    def __init__(self, directory: str | Path) -> None:
        try:
            import jinja2.ext
            import jinja2.sandbox
            from tokenizers import Tokenizer
        except ImportError as exc:  # the `tokenizer` extra
            raise ImportError(f"{exc}; install smetric-lmc[tokenizer] for a local tokenizer") from exc
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            raise TokenizerDirError(f"{directory}: no tokenizer.json (a fast tokenizer); "
                                    "transformers can still read it (smetric-lmc[hf])")
        config_path = directory / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        except (OSError, ValueError) as exc:
            raise TokenizerDirError(f"{config_path}: {exc}") from None
        self.tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.special = {name: text for name in _SPECIAL if (text := _token_text(config.get(name))) is not None}

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(_chat_template(directory, config))
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerDirError(f"{directory}: chat template does not parse: {exc}") from None

    def render(self, messages: Sequence[Message], tools: Sequence[dict] | None, *, generation: bool) -> str:
        return self.template.render(messages=[_parsed_tool_calls(m) for m in messages],
                                    tools=list(tools) if tools else None, add_generation_prompt=generation,
                                    **self.special)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion's prompt: special tokens added unless asked not to, as vLLM does."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: Sequence[Message], tools: Sequence[dict] | None, *, generation: bool) -> list[int]:
        # the template already wrote the special tokens a chat needs
        return self.tok.encode(self.render(messages, tools, generation=generation), add_special_tokens=False).ids

    def count(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> int:
        return len(self.encode_chat(messages, tools, generation=False))
