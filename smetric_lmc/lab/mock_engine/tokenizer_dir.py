"""The mock engine's tokenizer as a tokenizer directory, so a gateway can tokenize locally.

The mock tokenizes text as its UTF-8 bytes and renders chats as ChatML (``server.encode_text``,
``server.render_chat``). Written out as a real Hugging Face tokenizer directory (a byte-level
``tokenizer.json`` whose 256 tokens are the byte values, no merges, and the ChatML template in
``tokenizer_config.json``), it lets ``smetric gateway --tokenizer DIR`` in front of mock engines take
the same local path it takes in front of vLLM, instead of an engine ``/tokenize`` round trip.
"""

from __future__ import annotations

import json
from pathlib import Path

# One line, no whitespace outside the quoted strings, so trim/lstrip settings cannot change it.
CHATML_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + (m.role if m.role is defined else 'user') + '\\n' -}}"
    "{%- if m.content is string -%}{{- m.content -}}"
    "{%- elif m.content is iterable and m.content is not mapping -%}"
    "{%- for p in m.content -%}{%- if p is mapping and p.text is defined -%}{{- p.text -}}{%- endif -%}{%- endfor -%}"
    "{%- elif m.content -%}{{- m.content -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest for 256 + k."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def write_tokenizer_dir(directory: Path) -> Path:
    """Write the mock's tokenizer into ``directory`` (created); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
              "model_max_length": 1 << 20}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory
