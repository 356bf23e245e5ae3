"""The gateway's local tokenizer (tokenizers + jinja2) against transformers' apply_chat_template,
on the tiny test model's directory (a trained byte-level BPE with a ChatML + tools template).

transformers lives in the engine venv (it is vLLM's dependency, not ours), so the reference ids
are computed there.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from smetric_lmc.local_tokenizer import LocalChatTokenizer
from smetric_lmc.workers import launch

pytestmark = pytest.mark.e2e

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Lire un fichier ✓",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
CASES = [
    {"messages": [{"role": "user", "content": "hello there"}], "tools": None, "generation": True},
    {"messages": [{"role": "system", "content": "You are terse.\n\n  Indented."},
                  {"role": "user", "content": "日本語 and émoji 🎉"},
                  # the call as vLLM hands it to templates (its arguments parsed, OpenAI's key order)
                  {"role": "assistant", "content": "ok", "tool_calls": [{"id": "call_0", "function": {
                      "arguments": {"path": "/a b"}, "name": "read_file"}, "type": "function"}]},
                  {"role": "tool", "tool_call_id": "call_0", "content": "{\"lines\": 3}"}],
     "tools": TOOLS, "generation": True},
    {"messages": [{"role": "user", "content": "x" * 3000}, {"role": "assistant", "content": "y"}],
     "tools": TOOLS, "generation": False},
]
PROMPTS = ["plain text prompt", "  leading spaces and <|im_start|> a special token", "ünïcödé\n\ttabs"]

_REFERENCE = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
cases, prompts = json.loads(sys.stdin.read())
out = []
for c in cases:
    ids = tok.apply_chat_template(c["messages"], tools=c["tools"], tokenize=True,
                                  add_generation_prompt=c["generation"])
    out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
print(json.dumps([out, [tok.encode(p) for p in prompts]]))
"""


def test_local_tokenizer_matches_transformers(engine_venv: Path, tiny_model: Path) -> None:
    res = subprocess.run([str(launch.engine_python(engine_venv)), "-c", _REFERENCE, str(tiny_model)],
                         input=json.dumps([CASES, PROMPTS]), capture_output=True, text=True, timeout=300,
                         env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    chats, prompts = json.loads(res.stdout.strip().splitlines()[-1])
    tok = LocalChatTokenizer(tiny_model)
    for case, want in zip(CASES, chats, strict=True):
        assert tok.encode_chat(case["messages"], case["tools"], generation=case["generation"]) == want
    assert [tok.encode_prompt(p) for p in PROMPTS] == prompts
    assert len(chats[2]) > 1000  # the long case really was long


async def test_the_gateway_check_agrees_with_a_real_vllm_tokenize(start_engines: Any, tiny_model: Path) -> None:
    """What the gateway checks at start (a probe chat with tools and a tool call) against a real
    vLLM's /tokenize, and an agent's chat the same way."""
    import aiohttp

    from smetric_lmc.gateway_prompt import PromptReader

    engine = (await asyncio.to_thread(start_engines, 1))[0]
    url = engine.spec.http_url
    async with aiohttp.ClientSession() as http:
        reader = PromptReader([url], http, LocalChatTokenizer(tiny_model))
        assert await reader.check_local(engine.spec.served_model_name) is True and reader.local
        # as a client sends it: the call's arguments a JSON string, keys in any order
        messages = [dict(m) for m in CASES[1]["messages"]]
        call = messages[2]["tool_calls"][0]
        messages[2]["tool_calls"] = [{"type": "function", "id": call["id"], "function": {
            "name": call["function"]["name"], "arguments": json.dumps(call["function"]["arguments"])}}]
        async with http.post(f"{url}/tokenize", json={"model": engine.spec.served_model_name, "messages": messages,
                                                     "tools": TOOLS}) as resp:
            answer = await resp.json()
    assert "tokens" in answer, answer
    assert reader.counters.get("local_tokenizer_checked") == 1
    assert LocalChatTokenizer(tiny_model).encode_chat(messages, TOOLS, generation=True) == answer["tokens"]
