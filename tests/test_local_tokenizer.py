"""The gateway's local tokenizer (tokenizers + jinja2), on the mock engine's tokenizer directory.

Against transformers on a real model's directory: tests/e2e/test_local_tokenizer_hf.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smetric_lmc.lab.mock_engine.server import encode_text, render_chat
from smetric_lmc.lab.mock_engine.tokenizer_dir import write_tokenizer_dir
from smetric_lmc.local_tokenizer import LocalChatTokenizer, TokenizerDirError


@pytest.fixture(scope="module")
def mock_tok(tmp_path_factory: pytest.TempPathFactory) -> LocalChatTokenizer:
    return LocalChatTokenizer(write_tokenizer_dir(tmp_path_factory.mktemp("tok")))


CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Tu es ✓ un agent.\n  indented"}, {"role": "user", "content": "日本語\t"}],
    [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "image_url"}, {"type": "text", "text": "b"}]},
     {"role": "assistant", "content": None}, {"content": "no role"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "  {% raw %} {{ not a template }}  "}],
]


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("generation", [True, False])
def test_mock_directory_tokenizes_chats_as_the_mock_engine(mock_tok: LocalChatTokenizer, chat: list,
                                                           generation: bool) -> None:
    assert mock_tok.encode_chat(chat, None, generation=generation) == encode_text(render_chat(chat, generation))


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_mock_directory_tokenizes_any_text_as_its_bytes(mock_tok: LocalChatTokenizer, text: str) -> None:
    assert mock_tok.encode_prompt(text) == encode_text(text)
    chat = [{"role": "user", "content": text}]
    assert mock_tok.encode_chat(chat, None, generation=True) == encode_text(render_chat(chat))


def _dir(tmp_path: Path, config: dict | None, *, tokenizer_json: bool = True) -> Path:
    src = write_tokenizer_dir(tmp_path / "src")
    out = tmp_path / "dir"
    out.mkdir()
    if tokenizer_json:
        (out / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    if config is not None:
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_a_directory_it_cannot_serve_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerDirError, match="no tokenizer.json"):
        LocalChatTokenizer(_dir(tmp_path / "a", {"chat_template": "x"}, tokenizer_json=False))
    with pytest.raises(TokenizerDirError, match="no chat template"):
        LocalChatTokenizer(_dir(tmp_path / "b", {}))
    with pytest.raises(TokenizerDirError, match="does not parse"):
        LocalChatTokenizer(_dir(tmp_path / "c", {"chat_template": "{% for %}"}))


def test_templates_see_special_tokens_named_templates_and_the_jinja_file(tmp_path: Path) -> None:
    # transformers passes the special tokens as variables, picks the template named "default"
    # from a list, and prefers chat_template.jinja where newer versions write it.
    cfg = {"bos_token": {"content": "B", "lstrip": False}, "eos_token": "E",
           "chat_template": [{"name": "tool_use", "template": "T"},
                             {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"}]}
    tok = LocalChatTokenizer(_dir(tmp_path / "a", cfg))
    assert tok.render([{"role": "user", "content": "x"}], None, generation=True) == "BxE"
    d = _dir(tmp_path / "b", cfg)
    (d / "chat_template.jinja").write_text("{{ messages | length }}{{ add_generation_prompt }}{{ 'é' | tojson }}")
    assert LocalChatTokenizer(d).render([{}, {}], None, generation=False) == '2False"é"'


def test_a_template_that_raises_says_why(tmp_path: Path) -> None:
    import jinja2

    tok = LocalChatTokenizer(_dir(tmp_path, {"chat_template": "{{ raise_exception('roles must alternate') }}"}))
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        tok.encode_chat([{"role": "user", "content": "x"}], None, generation=True)


def test_tool_calls_reach_the_template_as_vllm_passes_them(tmp_path: Path) -> None:
    # vLLM parses a call's JSON arguments and orders its keys as OpenAI's message types declare them
    tok = LocalChatTokenizer(_dir(tmp_path, {"chat_template": "{{ messages[0]['tool_calls'] | tojson }}"}))
    msg = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}, "id": "c1"},
        {"type": "function", "function": {"name": "g", "arguments": "not json"}, "id": "c2"}]}
    before = json.dumps(msg)
    assert json.loads(tok.render([msg], None, generation=False)) == [
        {"id": "c1", "function": {"arguments": {"a": 1}, "name": "f"}, "type": "function"},
        {"id": "c2", "function": {"arguments": "not json", "name": "g"}, "type": "function"}]
    assert tok.render([msg], None, generation=False).startswith('[{"id": "c1", "function": {"arguments": {"a"')
    assert json.dumps(msg) == before  # the request itself is untouched
