"""Sweeps: many simulations over policies x one knob, each point maximised over offered load.

"Max TPS within SLO" of a policy = the best TPS within SLO it reaches over the offered-load sweep
(the load at which it peaks differs per policy).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from tqdm import tqdm

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.cluster import simulate
from smetric_lmc.lab.sim.config import SimConfig
from smetric_lmc.lab.sim.metrics import SATURATED_BUSY, SimResult
from smetric_lmc.lab.sim.profile import Profile, load_profile
from smetric_lmc.lab.workload.model import Workload

log = logging.getLogger(__name__)

KNOBS = ("load", "global", "overload", "hit_ratio", "instances")
GLOBAL_POINTS = ("none", "0.4", "0.8", "1.6", "full")
OVERLOAD_POINTS = (1.0, 1.5, 2.0, 4.0, math.inf)
HIT_RATIO_POINTS = (0.0, 0.25, 0.5, 0.75)


@dataclass(frozen=True)
class Point:
    """One simulation: a label for the knob's value, the sim config and the policy config."""

    knob: str
    value: str
    cfg: SimConfig
    policy: PolicyConfig


@dataclass
class Outcome:
    point: Point
    result: SimResult

    @property
    def policy(self) -> str:
        return self.point.policy.name


@dataclass
class SweepResult:
    knob: str
    outcomes: list[Outcome] = field(default_factory=list)

    def best(self) -> dict[tuple[str, str], Outcome]:
        """(knob value, policy) -> the outcome with the highest score over the load points."""
        out: dict[tuple[str, str], Outcome] = {}
        for o in self.outcomes:
            key = (o.point.value, o.policy)
            if key not in out or o.result.score > out[key].result.score:
                out[key] = o
        return out

    def values(self) -> list[str]:
        seen: dict[str, None] = {}
        for o in self.outcomes:
            seen.setdefault(o.point.value, None)
        return list(seen)

    def policies(self) -> list[str]:
        seen: dict[str, None] = {}
        for o in self.outcomes:
            seen.setdefault(o.policy, None)
        return list(seen)


@dataclass(frozen=True)
class PeakRow:
    """A policy's best point over the offered-load sweep (at one knob value), with what says
    whether the sweep reached its saturation knee: the GPUs' busy share there, the request rate per
    instance, and ``below_knee`` when the peak sits under ``SATURATED_BUSY`` (the sweep ran out of
    load before the policy saturated: its "max TPS" is a lower bound, not a maximum)."""

    value: str
    policy: str
    rate: float
    score: float
    gpu_busy_share: float
    req_per_min_per_instance: float
    below_knee: bool
    at_top_rate: bool  # the best point is the sweep's highest load: the knee may lie beyond it
    knee_reached: bool  # some run of this policy (here) kept the GPUs >= SATURATED_BUSY busy


def _group(o: Outcome) -> tuple[str, str]:
    """Runs that differ only in offered load: a load sweep's values *are* the loads."""
    return ("" if o.point.knob == "load" else o.point.value, o.policy)


def peak_rows(sr: SweepResult) -> list[PeakRow]:
    """One row per (knob value, policy) — per policy for a load sweep — at its best score over the
    offered loads, flagged when below the saturation knee."""
    top: dict[tuple[str, str], float] = {}
    busiest: dict[tuple[str, str], float] = {}
    best: dict[tuple[str, str], Outcome] = {}
    for o in sr.outcomes:
        key = _group(o)
        top[key] = max(top.get(key, 0.0), o.point.cfg.rate)
        busiest[key] = max(busiest.get(key, 0.0), float(o.result.summary.get("gpu_busy_share", 0.0)))
        if key not in best or o.result.score > best[key].result.score:
            best[key] = o
    rows = []
    for key, o in best.items():
        s = o.result.summary
        busy = float(s.get("gpu_busy_share", 0.0))
        rows.append(PeakRow(
            o.point.value, o.policy, o.point.cfg.rate, o.result.score, busy,
            float(s.get("req_per_min_per_instance", 0.0)), busy < SATURATED_BUSY, o.point.cfg.rate >= top[key],
            busiest[key] >= SATURATED_BUSY,
        ))  # fmt: skip
    for r in rows:
        if r.below_knee:
            why = ("more load lost SLO before the GPUs saturated" if r.knee_reached
                   else "the sweep did not reach its saturation knee")  # fmt: skip
            log.warning("%s at %s: peak at %.1f%% GPU busy (< %.0f%%): %s",
                        r.policy, r.value, 100 * r.gpu_busy_share, 100 * SATURATED_BUSY, why)  # fmt: skip
    return rows


_WORKLOAD: Workload | None = None
_PROFILE: Profile | None = None


def _init(workload: Workload, profile: Profile | None) -> None:
    global _WORKLOAD, _PROFILE
    _WORKLOAD, _PROFILE = workload, profile


def _run_point(point: Point) -> SimResult:
    assert _WORKLOAD is not None
    res = simulate(_WORKLOAD, point.cfg, point.policy, _PROFILE)
    res.cols = {}  # per-request columns stay in the worker: summaries, CDF samples and heatmaps travel
    return res


def run_points(
    workload: Workload,
    points: Sequence[Point],
    profile: Profile | None = None,
    jobs: int = 1,
    desc: str = "sim",
    keep_columns: bool = False,
) -> list[SimResult]:
    """Run every point (in worker processes when ``jobs`` > 1) behind one progress bar."""
    out: list[SimResult] = []
    bar = tqdm(total=len(points), desc=desc, unit="run", disable=len(points) <= 1)
    if jobs <= 1 or len(points) <= 1:
        for p in points:
            res = simulate(workload, p.cfg, p.policy, profile)
            if not keep_columns:
                res.cols = {}
            out.append(res)
            bar.set_postfix_str(f"{p.policy.name} {p.knob}={p.value}")
            bar.update(1)
    else:
        # fork shares the loaded workload with the workers copy-on-write
        import multiprocessing as mp

        ctx = mp.get_context("fork") if os.name == "posix" else None
        with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init, initargs=(workload, profile)) as ex:
            for res in ex.map(_run_point, points):
                out.append(res)
                bar.update(1)
    bar.close()
    return out


def rates_around(rate: float, n: int = 5, span: float = 4.0) -> list[float]:
    """``n`` offered loads spread geometrically over [rate/sqrt(span), rate*sqrt(span)]."""
    if n <= 1:
        return [rate]
    lo = rate / math.sqrt(span)
    step = span ** (1 / (n - 1))
    return [round(lo * step**k, 6) for k in range(n)]


def build_points(
    knob: str,
    base: SimConfig,
    policies: Iterable[str],
    rates: Sequence[float],
    values: Sequence[Any] | None = None,
    policy_base: PolicyConfig | None = None,
) -> list[Point]:
    """Points of one sweep: every (knob value, policy, rate)."""
    pb = policy_base or PolicyConfig()
    pols = list(policies)
    pts: list[Point] = []

    def add(value: str, cfg: SimConfig, pol: PolicyConfig) -> None:
        for r in rates:
            c = replace_cfg(cfg, rate=r * (cfg.instances / base.instances))
            pts.append(Point(knob, value, c, pol))

    if knob == "load":
        for p in pols:
            for r in rates:
                pts.append(Point(knob, f"{r:g}", replace_cfg(base, rate=r), msgspec.structs.replace(pb, name=p)))
        return pts
    if knob == "global":
        for v in values or GLOBAL_POINTS:
            for p in pols:
                add(str(v), replace_cfg(base, global_tier=str(v)), msgspec.structs.replace(pb, name=p))
    elif knob == "overload":
        for v in values or OVERLOAD_POINTS:
            add(f"{float(v):g}", base, msgspec.structs.replace(pb, name="smetric", overload=float(v)))
    elif knob == "hit_ratio":
        for v in values or HIT_RATIO_POINTS:
            add(f"{float(v):g}", base, msgspec.structs.replace(pb, name="smetric", hit_ratio=float(v)))
    elif knob == "instances":
        for v in values or (base.instances // 2, base.instances, base.instances * 2):
            for p in pols:
                # offered load scales with the cluster (add() multiplies the rate by n / base n)
                add(str(int(v)), replace_cfg(base, instances=int(v)), msgspec.structs.replace(pb, name=p))
    else:
        raise ValueError(f"unknown sweep {knob!r}; one of {KNOBS}")
    return pts


def replace_cfg(cfg: SimConfig, **kw: Any) -> SimConfig:
    return msgspec.structs.replace(cfg, **kw)


def sweep(
    workload: Workload,
    knob: str,
    base: SimConfig,
    policies: Iterable[str],
    rates: Sequence[float],
    values: Sequence[Any] | None = None,
    profile: Profile | None = None,
    jobs: int = 1,
    policy_base: PolicyConfig | None = None,
    extend_to_knee: int = 0,
    extend_factor: float = 2.0,
) -> SweepResult:
    """Run every point. ``extend_to_knee`` > 0: for each (knob value, policy) whose highest-load run
    kept its GPUs under ``SATURATED_BUSY``, add a run at ``extend_factor`` x that load, up to that
    many times, so each policy's peak lies at or past its saturation knee (use ``sampling:
    replace`` so that more load means more sessions, not a finite pool started faster)."""
    prof = profile or load_profile(base.profile)
    points = build_points(knob, base, policies, rates, values, policy_base)
    results = run_points(workload, points, prof, jobs, desc=f"sweep {knob}")
    out = SweepResult(knob, [Outcome(p, r) for p, r in zip(points, results)])
    for _ in range(extend_to_knee):
        more = _below_knee_at_top(out, extend_factor)
        if not more:
            break
        res = run_points(workload, more, prof, jobs, desc=f"sweep {knob} (to the knee)")
        out.outcomes.extend(Outcome(p, r) for p, r in zip(more, res))
    return out


def _below_knee_at_top(sr: SweepResult, factor: float) -> list[Point]:
    """Points one load step beyond each (knob value, policy) whose top-load run was not saturated."""
    top: dict[tuple[str, str], Outcome] = {}
    for o in sr.outcomes:
        key = _group(o)
        if key not in top or o.point.cfg.rate > top[key].point.cfg.rate:
            top[key] = o
    more = []
    for o in top.values():
        if float(o.result.summary.get("gpu_busy_share", 0.0)) < SATURATED_BUSY:
            p = o.point
            more.append(Point(p.knob, p.value if p.knob != "load" else f"{p.cfg.rate * factor:g}",
                              replace_cfg(p.cfg, rate=p.cfg.rate * factor), p.policy))  # fmt: skip
    return more


__all__ = [
    "GLOBAL_POINTS", "HIT_RATIO_POINTS", "KNOBS", "OVERLOAD_POINTS", "Outcome", "PeakRow", "Point", "SweepResult",
    "build_points", "peak_rows", "rates_around", "replace_cfg", "run_points", "sweep",
]  # fmt: skip
