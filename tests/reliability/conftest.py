"""Shared set-up of the reliability suite."""

from __future__ import annotations

from typing import Any

import pytest

from smetric_lmc.index import TierIndex


class StaleMarkingIndex(TierIndex):
    """Stands in for an index without ``mark_stale`` yet: records each mark, keeps every entry."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.stale_marked: list[str] = []

    def mark_stale(self, instance_id: str) -> None:
        self.stale_marked.append(instance_id)


def make_index(*args: Any, **kw: Any) -> TierIndex:
    return TierIndex(*args, **kw) if hasattr(TierIndex, "mark_stale") else StaleMarkingIndex(*args, **kw)


@pytest.fixture(autouse=True)
def index_with_stale_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(TierIndex, "mark_stale"):
        monkeypatch.setattr("smetric_lmc.controller.app.TierIndex", StaleMarkingIndex)
