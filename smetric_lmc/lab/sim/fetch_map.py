"""The regime map's fetch axis: per-request retrieve throughput x global-tier provisioning.

Each cell is the ``trace1`` preset at its own context length on the profile's GPUs, with the global
tier's fetch path capped at ``gbs`` GB/s per request (``inf``: the line-rate path, links only); every
policy's peak TPS within SLO comes from the same knee search as the map's (``knee.knee_sweeps``),
over the same arrival seeds. The verdict names, per baseline and tier, the retrieve speeds at which
SMetric beats it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.config import SimConfig
from smetric_lmc.lab.sim.knee import KneeResult, Setting, knee_sweeps
from smetric_lmc.lab.sim.profile import Profile
from smetric_lmc.lab.workload.presets import preset_workload

FETCH_AXIS = (0.5, 1.1, 3.2, 6.64, math.inf)  # GB/s: Redis-like .. Mooncake RDMA .. line rate
FETCH_TIERS = ("0.4", "1.6", "full")


@dataclass
class FetchMapSpec:
    gbs: Sequence[float] = FETCH_AXIS
    tiers: Sequence[str] = FETCH_TIERS
    ours: str = "smetric"
    variant: str = "smetric_ect"
    baselines: Sequence[str] = ("load_balance", "bailian", "lmetric", "dynamo")
    instances: int = 8
    roots: int = 300
    window_s: float = 600.0
    warmup_share: float = 0.4
    factors: Sequence[float] = (1.0, 1.5)
    seeds: Sequence[int] = (0, 1)
    pilots: int = 1
    extend: int = 1


@dataclass
class FetchMap:
    spec: FetchMapSpec
    cells: dict[tuple[str, float], list[KneeResult]] = field(default_factory=dict)  # (tier, gbs) -> per seed

    def ratio(self, tier: str, gbs: float, policy: str, baseline: str) -> float:
        """Mean over seeds of ``policy``'s peak ÷ ``baseline``'s."""
        v = [kr.score(policy) / kr.score(baseline) for kr in self.cells[(tier, gbs)] if kr.score(baseline) > 0]
        return sum(v) / len(v) if v else math.nan

    def vs_best(self, tier: str, gbs: float, policy: str) -> float:
        v = [kr.ratio(policy, self.spec.baselines) for kr in self.cells[(tier, gbs)]]
        v = [x for x in v if x == x]
        return sum(v) / len(v) if v else math.nan


def _g(x: float) -> str:
    return "line rate" if math.isinf(x) else f"{x:g} GB/s"


def run_fetch_map(spec: FetchMapSpec, base: SimConfig, prof: Profile, jobs: int = 1) -> FetchMap:
    limit = int(0.9 * prof.max_context(64))
    wls = {"trace1": preset_workload("trace1", spec.roots, seed=0, context_limit=limit)}
    settings = {}
    for t in spec.tiers:
        for g in spec.gbs:
            for sd in spec.seeds:
                cfg = msgspec.structs.replace(
                    base, instances=spec.instances, global_tier=t, pd=False, sampling="replace", drain=False,
                    arrival_window_s=spec.window_s, max_sessions=None, warmup_share=spec.warmup_share,
                    seed=base.seed + sd, fetch_path="line-rate" if math.isinf(g) else base.fetch_path,
                    fetch_gbs=None if math.isinf(g) else g,
                )  # fmt: skip
                settings[(t, g, sd)] = Setting("trace1", cfg, prof)
    pols = [PolicyConfig(name=p) for p in (spec.ours, spec.variant, *spec.baselines)]  # type: ignore[arg-type]
    res = knee_sweeps(wls, settings, pols, PolicyConfig(name=spec.ours), spec.factors, jobs, spec.pilots,
                      desc="fetch map", extend=spec.extend)  # fmt: skip
    m = FetchMap(spec)
    for t in spec.tiers:
        for g in spec.gbs:
            m.cells[(t, g)] = [res[(t, g, sd)] for sd in spec.seeds]
    return m


def crossover(m: FetchMap, tier: str, baseline: str) -> str:
    """In words: at which retrieve speeds of the axis SMetric beats ``baseline`` on ``tier``."""
    gs = sorted(m.spec.gbs)
    wins = [g for g in gs if m.ratio(tier, g, m.spec.ours, baseline) > 1.0]
    if not wins:
        return "never"
    if len(wins) == len(gs):
        return "at every retrieve speed"
    if wins == gs[: len(wins)]:
        return f"at {_g(wins[-1])} per request and below (loses from {_g(gs[len(wins)])})"
    if wins == gs[-len(wins):]:
        top = "only at line rate" if math.isinf(wins[0]) else f"at {_g(wins[0])} and above"
        return f"{top} (loses at {_g(gs[-len(wins) - 1])} and below)"
    return "at " + ", ".join(_g(g) for g in wins)


def fetch_map_markdown(m: FetchMap) -> str:
    s = m.spec
    head = "| global tier | retrieve / request | " + " | ".join(f"SMetric ÷ {b}" for b in s.baselines)
    head += f" | {s.variant} ÷ best |"
    md = [head, "|" + "---|" * (3 + len(s.baselines))]
    for t in s.tiers:
        for g in s.gbs:
            cells = " | ".join(f"{m.ratio(t, g, s.ours, b):.3f}" for b in s.baselines)
            md.append(f"| {t} | {_g(g)} | {cells} | {m.vs_best(t, g, s.variant):.3f} |")
    md.append("")
    for t in s.tiers:
        parts = [f"{b} {crossover(m, t, b)}" for b in s.baselines]
        md.append(f"- global tier {t}: SMetric beats " + "; ".join(parts) + ".")
    return "\n".join(md) + "\n"


def variant_min(m: FetchMap) -> float:
    v = [m.vs_best(t, g, m.spec.variant) for t in m.spec.tiers for g in m.spec.gbs]
    v = [x for x in v if x == x]
    return min(v) if v else math.nan


def parse_axis(text: str) -> tuple[float, ...]:
    """``0.5,1.1,line`` -> (0.5, 1.1, inf); ValueError on anything else."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        v = math.inf if p in ("line", "inf", "line-rate") else float(p)
        if not v > 0:
            raise ValueError(f"fetch axis: {part!r} is not a positive GB/s value")
        out.append(v)
    return tuple(out)


