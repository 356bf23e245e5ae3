"""turn / est_hit from OpenAI messages, and the approximate tokenizer's bounded error."""

import pytest

from smetric_lmc.session import ApproxChatTokenizer, history_of, session_info, turn_of


class WordTokenizer:
    """A stand-in that counts whitespace words: enough to check what session_info feeds it."""

    def __init__(self):
        self.seen = None

    def count(self, messages, tools):
        self.seen = (messages, tools)
        return sum(len(str(m.get("content", "")).split()) for m in messages) + (3 if tools else 0)


CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hi"},
    {"role": "tool", "content": "output of a tool call"},
    {"role": "assistant", "content": "done now"},
    {"role": "user", "content": "next question please"},
]


def test_turn_counts_assistant_messages():
    assert turn_of(CHAT) == 2
    assert turn_of(CHAT[:2]) == 0


def test_history_ends_at_the_last_assistant_message():
    assert history_of(CHAT) == CHAT[:5]
    assert history_of(CHAT[:2]) == []


def test_session_info_uses_history_and_tools():
    tok = WordTokenizer()
    info = session_info(CHAT, [{"type": "function"}], tok)
    assert info.turn == 2
    assert info.est_hit_tokens == 2 + 2 + 1 + 5 + 2 + 3
    assert tok.seen[0] == CHAT[:5]


def test_first_turn_and_dropped_history():
    tok = WordTokenizer()
    assert session_info(CHAT[:2], None, tok).est_hit_tokens == 0
    assert session_info([{"role": "user", "content": "fresh start"}], None, tok).turn == 0


def test_explicit_turn_overrides():
    assert session_info(CHAT, None, WordTokenizer(), explicit_turn=0).turn == 0
    assert session_info(CHAT, None, WordTokenizer(), explicit_turn=0).est_hit_tokens == 0


def test_approximation_error_is_bounded_against_a_real_bpe_tokenizer():
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package provides the reference BPE")
    import sysconfig
    from pathlib import Path

    # Train a byte-level BPE on local Python sources (no model hub here), ~8k vocabulary.
    src = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in src.glob("*.py"))[:120]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train(files, tokenizers.trainers.BpeTrainer(vocab_size=8192, show_progress=False,
                                                    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    approx = ApproxChatTokenizer()
    texts = [Path(f).read_text(errors="ignore")[:4000] for f in files[120:] or files[-20:]]
    for text in texts[:20]:
        msgs = [{"role": "user", "content": text}]
        true = len(tok.encode(text).ids) + 5  # + ChatML wrapper tokens
        assert abs(approx.count(msgs, None) - true) <= 0.25 * true
