"""turn / est_hit from OpenAI messages, and the one est_hit estimate's error against a real tokenizer."""


import pytest
from kit.lmcache_venv import lmcache_python

from smetric_lmc.session import ChatTokenEstimator, history_of, text_bytes, turn_of

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


def test_estimate_counts_text_tool_calls_and_tools():
    est = ChatTokenEstimator(bytes_per_token=4.0, per_message=5)
    msgs = [{"role": "user", "content": "x" * 400},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert text_bytes(msgs, tools) == 400 + len('[{"id": "c", "function": {"name": "f"}}]') + len(
        '[{"type": "function", "function": {"name": "f"}}]')
    assert est.count(msgs, tools) == int(text_bytes(msgs, tools) / 4.0) + 5 * 3
    assert est.count([{"role": "user", "content": [{"type": "text", "text": "abcd" * 25}]}]) == 25 + 5


def test_observing_exact_counts_moves_the_rate_to_the_served_tokenizer():
    est = ChatTokenEstimator()
    msgs = [{"role": "user", "content": "y" * 2000}]
    for _ in range(30):  # the served tokenizer: 2 bytes a token
        est.observe(msgs, None, 1000 + 5)
    assert est.bytes_per_token == pytest.approx(2.0, rel=0.01) and est.observations == 30
    assert est.count(msgs) == pytest.approx(1005, rel=0.01)
    before = est.bytes_per_token
    est.observe([{"role": "user", "content": "tiny"}], None, 3)  # too little text to learn from
    assert est.bytes_per_token == before


@pytest.mark.integration
def test_error_against_a_real_tokenizer_on_held_out_conversations():
    if lmcache_python() is None:
        pytest.skip("engine venv (transformers + the tiny model's tokenizer) not built: run .ci/engine-venv.sh")
    from kit import token_estimate as bench
    convs = bench.conversations(60, seed=1)  # another seed than the README's figures
    truth = bench.exact_counts(convs)
    train, test = convs[:15], convs[15:]
    est = ChatTokenEstimator()
    for c, t in zip(train, truth[:15]):
        est.observe(c["history"], c["tools"], t)
    calibrated = bench.summary(bench.errors(est, test, truth[15:]))
    fresh = bench.summary(bench.errors(ChatTokenEstimator(), test, truth[15:]))
    # Calibrated on exact counts, the estimate follows the served tokenizer on text it never saw.
    assert calibrated["mean_abs"] <= 0.15 and calibrated["p90_abs"] <= 0.25, calibrated
    assert calibrated["mean_abs"] < fresh["mean_abs"]
