"""Checks shared by the replay tests (unit and e2e)."""

from __future__ import annotations


def check_feedback(records: list, block: int) -> int:
    """A follow-up that resent its predecessor's answer hits the predecessor's prompt and answer, in
    whole blocks: the engine cached the generated tokens too. Returns how many were checked."""
    by_key = {(r.session, r.request): r for r in records}
    checked = 0
    for r in records:
        if r.answer_reused and r.ok:
            prev = by_key[(r.session, r.request - 1)]
            assert r.answer_reused == prev.completion_tokens
            expect = min((prev.input + prev.completion_tokens) // block * block, (r.input - 1) // block * block)
            assert r.cached_tokens == expect, (r.session, r.request, r.cached_tokens, expect)
            checked += 1
    return checked
