"""Build a tiny random Qwen2 model and a byte-level BPE tokenizer for end-to-end tests.

No model hub is reachable where the tests run, so the engine is served a model made here:
a ~0.9 M-parameter Qwen2 with random weights and a ~4k-token BPE trained on the Python
standard library's sources, wrapped with a ChatML chat template (eos ``<|im_end|>``).

This file runs inside the engine venv (transformers, tokenizers, torch) where the project
itself is not installed, so it imports nothing from the project:

    ENGINE_PY workers/tinymodel.py OUTDIR [--seed 0] [--vocab-size 4096]

It is idempotent: a stamp records the build parameters, and a matching stamp skips the work.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

log = logging.getLogger("tinymodel")

STAMP_NAME = ".smetric-tinymodel.json"
# Bump when the recipe changes so that cached builds are redone.
RECIPE_VERSION = 2  # 2: Qwen2's pre-tokenizer and normalizer in tokenizer.json
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Enough text for a stable 4k-token vocabulary while keeping the build to a few seconds.
MAX_CORPUS_BYTES = 6 * 1024 * 1024

# Qwen2-style ChatML. `tools` are rendered as a system block so that requests carrying tools
# produce a deterministic, tokenizable prompt (the router counts them in the carried history).
# Qwen2's pre-tokenizer split (its published tokenizer.json)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- if message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}{{- '\\n<tool_call>' + (call | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def recipe(seed: int, vocab_size: int) -> dict[str, object]:
    return {
        "recipe": RECIPE_VERSION,
        "seed": seed,
        "vocab_size": vocab_size,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def is_built(outdir: Path, seed: int = 0, vocab_size: int = 4096) -> bool:
    stamp = outdir / STAMP_NAME
    try:
        return json.loads(stamp.read_text()) == recipe(seed, vocab_size)
    except (OSError, ValueError):
        return False


def _corpus_files() -> list[Path]:
    # The stdlib of the running interpreter: present everywhere, no download, stable per version.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def _corpus() -> Iterator[str]:
    total = 0
    for path in _corpus_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text
        if total >= MAX_CORPUS_BYTES:
            return


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2's own pipeline (NFC, its split regex, then bytes), as in published Qwen2/Qwen3
    # tokenizer.json files: transformers >= 5 rebuilds a qwen2 model's tokenizer with it whatever
    # tokenizer.json says, so a file that says otherwise would tokenize one way in vLLM and
    # another in any reader of the file (the gateway's local tokenizer).
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )


def build_model(vocab_size: int, eos_id: int, pad_id: int, seed: int) -> Qwen2ForCausalLM:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    return model


def build(outdir: Path, seed: int = 0, vocab_size: int = 4096) -> Path:
    """Build the model into `outdir` unless a matching build is already there."""
    outdir = outdir.resolve()
    if is_built(outdir, seed, vocab_size):
        log.info("tiny model already built at %s", outdir)
        return outdir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    outdir.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent reader never sees half a model.
    tmp = Path(tempfile.mkdtemp(prefix=outdir.name + ".tmp-", dir=outdir.parent))
    try:
        tokenizer = build_tokenizer(vocab_size)
        eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        model = build_model(len(tokenizer), eos_id, pad_id, seed)
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        (tmp / STAMP_NAME).write_text(json.dumps(recipe(seed, vocab_size)))
        # Another builder may have finished first; its result is identical (same seed).
        if not is_built(outdir, seed, vocab_size):
            if outdir.exists():
                shutil.rmtree(outdir)
            tmp.rename(outdir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("built tiny model at %s", outdir)
    return outdir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    build(args.outdir, seed=args.seed, vocab_size=args.vocab_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
