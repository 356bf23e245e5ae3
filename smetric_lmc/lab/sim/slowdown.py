"""Instances that run slower for a while: each instance's step times are multiplied by a factor
drawn afresh every ``period_s`` of simulated time (log-normal, mean 1, coefficient of variation
``cv``). Off (cv 0) by default: the profile's step times are deterministic, so a queue builds on an
instance only when a policy sends it more than it serves; with this on, an instance that slows for
a while builds one whatever the policy, and a policy that does not read load keeps feeding it.

The draws depend on the seed and the instance only, not on the policy or on when the instance
asks: every policy of a comparison meets the same slow periods on the same instances.
"""

from __future__ import annotations

import math

import numpy as np

_BLOCK = 256  # epochs drawn at a time


class Slowdown:
    """One instance's speed factor over time (1.0 throughout when ``cv`` is 0)."""

    def __init__(self, cv: float, period_s: float, seed: int, pos: int) -> None:
        if cv < 0 or not period_s > 0:
            raise ValueError("slowdown: cv must be >= 0 and period_s > 0")
        self.cv = cv
        self.period_s = period_s
        self._sigma = math.sqrt(math.log1p(cv * cv))
        self._rng = np.random.default_rng([seed, pos, 0x51C0])
        self._factors = np.empty(0)

    def factor(self, now: float) -> float:
        if self.cv == 0:
            return 1.0
        epoch = int(now // self.period_s)
        while epoch >= len(self._factors):
            more = self._rng.lognormal(-self._sigma * self._sigma / 2, self._sigma, _BLOCK)
            self._factors = np.concatenate([self._factors, more])
        return float(self._factors[epoch])
