"""Doubling retry delays, one definition for every reconnect, restart and re-probe loop."""

from __future__ import annotations


def doubled(first: float, times: int, most: float = float("inf"), *, max_doublings: int = 16) -> float:
    """``first`` doubled ``times`` times (at most ``max_doublings``), capped at ``most``."""
    return min(most, first * 2 ** max(0, min(times, max_doublings)))


class Backoff:
    """A delay that doubles on each ``next()`` up to ``most``; ``reset()`` starts over at ``first``."""

    __slots__ = ("first", "most", "current")

    def __init__(self, first: float, most: float) -> None:
        if first < 0 or most < first:
            raise ValueError(f"backoff needs 0 <= first <= most, got first={first} most={most}")
        self.first = first
        self.most = most
        self.current = first

    def next(self) -> float:
        """The delay to wait now; the following one is twice as long (capped)."""
        delay = self.current
        self.current = min(self.current * 2, self.most)
        return delay

    def reset(self) -> None:
        self.current = self.first

    @property
    def at_first(self) -> bool:
        """True while no failure has been counted since the last reset."""
        return self.current == self.first
