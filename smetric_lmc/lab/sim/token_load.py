"""In-flight token load per instance, time-averaged per window: the load the SMetric paper's
imbalance figures plot.

The paper's load of an instance is the tokens of the requests in flight on it — prompt and decoded
tokens alike, cached or not, queued or running (§3, Fig. 9: "counting all tokens—prefill and
decode—of the requests running on that instance"; §5.2, Fig. 15b and §5.3, Fig. 21b: "inflight
(prefill-)token-load heatmaps"), and its imbalance is the mean over time windows of max/mean across
instances (§4.1). Tokens *computed* per window are capped by the GPU's speed, so a queue piling up
on one instance does not show there; in-flight tokens grow with the queue. Under PD
disaggregation the load is the prompt tokens not yet prefilled (the paper's "prefill token load").
"""

from __future__ import annotations

import math

import numpy as np


class InflightTokens:
    """Per-instance in-flight tokens, integrated over time into fixed windows."""

    def __init__(self, instances: int, window_s: float) -> None:
        self.window_s = window_s
        self.cur = [0] * instances
        self.last = [0.0] * instances
        self.acc: list[np.ndarray] = []  # per window: token-seconds per instance

    def _flush(self, pos: int, t: float) -> None:
        t0, v = self.last[pos], self.cur[pos]
        self.last[pos] = t
        if v <= 0 or t <= t0:
            return
        W = self.window_s
        # an interval ending on a window boundary does not open the next window
        w0, w1 = int(t0 // W), max(int(t0 // W), math.ceil(t / W) - 1)
        acc = self.acc
        while len(acc) <= w1:
            acc.append(np.zeros(len(self.cur)))
        if w0 == w1:
            acc[w0][pos] += v * (t - t0)
            return
        acc[w0][pos] += v * ((w0 + 1) * W - t0)
        for w in range(w0 + 1, w1):
            acc[w][pos] += v * W
        acc[w1][pos] += v * (t - w1 * W)

    def add(self, pos: int, t: float, delta: int) -> None:
        """``delta`` tokens join (or, negative, leave) instance ``pos``'s load at time ``t``."""
        self._flush(pos, t)
        self.cur[pos] += delta

    def windows(self, t_end: float) -> np.ndarray:
        """(windows, instances): mean in-flight tokens per window up to ``t_end``."""
        for pos in range(len(self.cur)):
            self._flush(pos, max(t_end, self.last[pos]))
        if not self.acc:
            return np.zeros((0, len(self.cur)))
        return np.stack(self.acc) / self.window_s
