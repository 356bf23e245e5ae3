"""The one doubling-delay helper every retry loop uses, and the one loop budget."""

from __future__ import annotations

import pytest

from smetric_lmc.backoff import Backoff, doubled
from smetric_lmc.controller.tasks import LoopBudget


def test_backoff_doubles_to_its_cap_and_starts_over() -> None:
    b = Backoff(0.5, 3.0)
    assert b.at_first
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert not b.at_first
    b.reset()
    assert b.at_first and b.next() == 0.5


def test_backoff_refuses_a_cap_below_its_first_step() -> None:
    with pytest.raises(ValueError, match="first <= most"):
        Backoff(2.0, 1.0)


def test_doubled_caps_both_the_doublings_and_the_delay() -> None:
    assert doubled(1.0, 0) == 1.0
    assert doubled(1.0, 3) == 8.0
    assert doubled(1.0, 30, max_doublings=6) == 64.0
    assert doubled(0.25, 10, 2.0) == 2.0
    assert doubled(1.0, -1) == 1.0  # a first failure counted from zero never shortens the step


def test_loop_budget_is_spent_by_count_or_bytes() -> None:
    meter = LoopBudget(items=3, nbytes=100, seconds=3600).meter()
    assert not meter.spend() and not meter.spend()
    assert meter.spend()  # the third item
    meter.reset()
    assert meter.spend(100)  # one item of the whole byte budget



def test_loop_budget_is_spent_by_time() -> None:
    meter = LoopBudget(items=1 << 30, nbytes=1 << 30, seconds=0.0).meter()
    assert meter.spend()
    meter.reset()
    assert meter.items == 0 and meter.nbytes == 0
