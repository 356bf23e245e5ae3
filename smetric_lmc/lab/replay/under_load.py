"""The engines and the request path under the live stack, fitted on calibration replays.

The simulator models the engines' iterations only. A calibration replay (a workload replayed through
the gateway like the validation's, under a neutral policy) gives three numbers the idle-engine
probes miss: how much slower the engines' iterations run while the whole stack shares the machine
(``fit_under_load``: decode time per token, live over simulated), the request path before the first
token under that load, and how that path grows with the requests in flight on the serving engine
(``fit_contention``). A replay between two calibration replays is simulated with their mean
(``bracketed``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from smetric_lmc.lab.replay.calibrate import robust_line
from smetric_lmc.lab.replay.compare import simulate_like
from smetric_lmc.lab.sim.metrics import SimResult
from smetric_lmc.lab.sim.profile import Profile
from smetric_lmc.lab.workload.model import TraceSession, Workload


@dataclass
class RequestPath:
    """The request path around the engine's iterations, measured (seconds)."""

    pre: float  # send -> first token, beyond the first iteration
    post: float  # last token -> end of the stream at the client

    @property
    def turnaround(self) -> float:
        return self.pre + self.post


@dataclass
class Contention:
    """The request path before the first token as it grows with the requests already in flight on the
    serving engine: ``base + per_inflight * k`` (seconds). On a CPU engine the API server, which streams
    every in-flight request's tokens, shares a core with the engine's iterations, so a request arriving
    behind ``k`` others waits longer for its first token than the iterations alone explain."""

    base: float
    per_inflight: float

    def ttft(self, res: SimResult) -> np.ndarray:
        """Simulated TTFT per request: the engine's, plus the path at the simulated concurrency."""
        c = res.cols
        return c["first_token"] - c["arrival"] + self.base + self.per_inflight * inflight_on_instance(res)


def inflight_on_instance(res: SimResult) -> np.ndarray:
    """For each request, how many others were in flight on its instance when it arrived."""
    c = res.cols
    a, f, ins = c["arrival"], c["finish"], c["instance"]
    with np.errstate(invalid="ignore"):
        busy = (a[None, :] <= a[:, None]) & (f[None, :] > a[:, None]) & (ins[None, :] == ins[:, None])
    return np.maximum(busy.sum(axis=1) - 1, 0)


def run_tps(res: SimResult, tail_s: float = 0.0) -> float:
    """Input + output tokens of served requests over first arrival .. last finish (both runs alike;
    ``tail_s``: time from the last token to the client that the run does not model)."""
    c = res.cols
    ok = ~c["rejected"].astype(bool)
    if not ok.any():
        return 0.0
    dur = float(np.nanmax(c["finish"][ok]) - np.nanmin(c["arrival"][ok])) + tail_s
    return float((c["input"][ok] + c["output"][ok]).sum() / max(dur, 1e-9))


def with_turnaround(wl: Workload, seconds: float, max_think_s: float) -> Workload:
    """The workload as the simulator should see a closed-loop client whose next request reaches the
    engine ``seconds`` after the previous reply left it: think times (clipped as the replay clips
    them) plus the request path."""
    def session(s: TraceSession) -> TraceSession:
        return dataclasses.replace(s, requests=[
            dataclasses.replace(r, think_time=min(max(0.0, r.think_time), max_think_s) + (seconds if k else 0.0))
            for k, r in enumerate(s.requests)])

    return dataclasses.replace(wl, sessions=[session(s) for s in wl.sessions])


def decode_s_per_token(res: SimResult) -> float:
    """Time from first to last token over the tokens after the first, served requests pooled."""
    c = res.cols
    ok = ~c["rejected"].astype(bool) & (c["output"] > 1)
    steps = float((c["output"][ok] - 1).sum())
    return float((c["finish"][ok] - c["first_token"][ok]).sum()) / steps if steps else float("nan")


def slowed(profile: Profile, factor: float) -> Profile:
    """Every iteration ``factor`` times longer (compute, memory and overhead alike)."""
    return profile.with_overrides(peak_flops=profile.peak_flops / factor, hbm_bw=profile.hbm_bw / factor,
                                  iter_overhead_s=profile.iter_overhead_s * factor)


@dataclass
class LoadedFit:
    """The profile and request path as a calibration replay saw them (see ``fit_under_load``)."""

    profile: Profile
    slowdown: float  # engine iterations during the replay / on the idle engine (calibration probes)
    pre: float  # request path before the first token, under the replay's concurrency (s)
    live: SimResult
    sim: SimResult
    contention: Contention  # the same path as it grows with the requests in flight on the engine
    run_share: dict[str, float] = dataclasses.field(default_factory=dict)  # per engine (``schedstat``)
    sched: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # every schedstat signal


def fit_under_load(cal_wl: Workload, live: SimResult, profile: Profile, path: RequestPath, policy: str,
                   engines: int, rate: float, seed: int, max_think_s: float, rounds: int = 3) -> LoadedFit:
    """Fit two numbers on a calibration replay (another workload, replayed like the validation's):
    how much slower the engines' iterations run while the whole stack shares the machine (decode
    time per token, live over simulated) and the request path before the first token under that
    concurrency (live TTFT p50 minus the simulated engine's). The idle-engine probes miss both: on a
    CPU the API servers, gateway, controller and client take the cores the iterations run on.

    Well posed where a decode step is mostly fixed cost (this CPU engine: the fit recovers a known
    slowdown within a few percent); where long prefill chunks share steps with decodes (a large
    model), decode time per token jumps with which requests overlap and the fit is ill posed."""
    d_live = decode_s_per_token(live)
    ttft_live = float(live.summary["ttft_p50"])
    if not (np.isfinite(d_live) and np.isfinite(ttft_live)):
        # A served request without a first-token time would make the fit chase NaN to its bracket's end.
        raise ValueError(f"calibration replay has no decode time or TTFT to fit (decode {d_live}, TTFT p50 "
                         f"{ttft_live}): a served request lacks a first-token time")

    def run(factor: float, pre: float) -> SimResult:
        return simulate_like(with_turnaround(cal_wl, pre + path.post, max_think_s), slowed(profile, factor), policy,
                             engines, rate, seed, 1e9)

    factor, pre = 1.0, path.pre
    for _ in range(rounds):
        # Bisection on a log scale: decode time per token grows with the factor, but in steps (which
        # decodes share an iteration with a prefill changes), so a fixed-point iteration oscillates.
        lo, hi = np.log(1 / 16), np.log(64.0)
        for _ in range(16):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if decode_s_per_token(run(float(np.exp(mid)), pre)) < d_live else (lo, mid)
        factor = float(np.exp((lo + hi) / 2))
        pre = max(0.0, ttft_live - float(run(factor, pre).summary["ttft_p50"]))
    sim = run(factor, pre)
    return LoadedFit(slowed(profile, factor), factor, pre, live, sim, fit_contention(live, sim, pre))


def fit_contention(live: SimResult, sim: SimResult, pre: float) -> Contention:
    """The path before the first token against the requests in flight on the serving engine, from a
    calibration replay and its simulation: per request, live TTFT minus the simulated engine's (the
    same request: session, turn, length), a Theil-Sen line over the live in-flight count. Bounded to
    a path that does not shrink with load; falls back to the constant ``pre`` with too few requests."""
    def key(c: dict[str, np.ndarray], i: int) -> tuple[int, int, int]:
        return int(c["session"][i]), int(c["turn"][i]), int(c["input"][i])

    lc, sc = live.cols, sim.cols
    at = {key(sc, i): i for i in range(len(sc["input"]))}
    pairs = [(i, at[key(lc, i)]) for i in range(len(lc["input"])) if key(lc, i) in at]
    li = np.array([p[0] for p in pairs], dtype=np.int64)
    si = np.array([p[1] for p in pairs], dtype=np.int64)
    if len(pairs) < 8:
        return Contention(pre, 0.0)
    resid = (lc["first_token"] - lc["arrival"])[li] - (sc["first_token"] - sc["arrival"])[si]
    k = inflight_on_instance(live)[li].astype(float)
    ok = np.isfinite(resid)
    if ok.sum() < 8 or np.ptp(k[ok]) == 0:
        return Contention(pre, 0.0)
    slope, base = robust_line(k[ok], resid[ok])
    if slope < 0:  # a path that shortens under load is noise: keep the constant
        return Contention(pre, 0.0)
    return Contention(max(0.0, base), slope)


def bracketed(before: LoadedFit, after: LoadedFit, idle: Profile) -> tuple[Profile, float, float, Contention]:
    """The engines during a replay, from the calibration replays just before and just after it: the
    geometric mean of their slowdowns, the mean of their request paths. The machine's load drifts
    within seconds here; a replay lies between its two calibrations in time."""
    factor = float(np.sqrt(before.slowdown * after.slowdown))
    cb, ca = before.contention, after.contention
    return (slowed(idle, factor), factor, (before.pre + after.pre) / 2,
            Contention((cb.base + ca.base) / 2, (cb.per_inflight + ca.per_inflight) / 2))
