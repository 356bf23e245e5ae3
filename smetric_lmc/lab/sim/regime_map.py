"""``smetric sim map``: where does SMetric beat the best baseline? A map over the regime.

Axes: x = mean context ÷ per-instance KV capacity, and the global tier's provisioning (none, 0.4 and
1.6 × the cluster's local capacity, full = the nodes' host pools). The preset at scale 1 sits at its
natural x0 (trace1: mean request ~45 k tokens, x0 ≈ 0.16 on the default profile). Below x0 the map
grows the GPU's KV capacity (HBM, and the node's host pool in proportion, so "full" stays full) and
keeps the workload; above x0 it scales the contexts up and keeps the hardware. Scaling contexts down
instead would need ~50× more requests per run to saturate the cluster at x = 0.02 (a 5 k-token mean
context), which no laptop replays. Each cell finds its own
saturation knee: a pilot run of SMetric measures the GPU busy share at a first guess of the load and
scales the session rate to ~90% busy; every policy then runs at rates around that knee and is
credited with its best TPS within SLO. A cell whose best rate is the top of its sweep, or whose peak
is below 80% GPU busy, is flagged: its knee was not bracketed.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.config import SimConfig
from smetric_lmc.lab.sim.knee import TARGET_BUSY, KneeResult, Setting, knee_sweeps
from smetric_lmc.lab.sim.profile import Profile
from smetric_lmc.lab.workload.model import Workload
from smetric_lmc.lab.workload.presets import preset_workload

log = logging.getLogger(__name__)

X_POINTS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.6)
TIERS = ("none", "0.4", "1.6", "full")
BASELINES = ("load_balance", "bailian", "lmetric", "dynamo")


@dataclass
class MapSpec:
    preset: str = "trace1"
    xs: Sequence[float] = X_POINTS
    tiers: Sequence[str] = TIERS
    ours: str = "smetric"
    variant: str | None = None
    baselines: Sequence[str] = BASELINES
    instances: int = 16
    pool_roots: int = 600  # root sessions generated per x (drawn with replacement)
    window_s: float = 2400.0  # session-arrival window of a point (at least: see min_sessions)
    warmup_share: float = 0.4  # of the window, left out of the measurement (the sessions' ramp-up)
    min_sessions: int = 0  # stretch a cell's window so at least this many root sessions arrive at its knee
    extend: int = 1  # rounds of one more load step for a policy best at either end of its sweep
    rate_factors: Sequence[float] = (0.6, 0.8, 1.0, 1.25, 1.6)
    seed: int = 0  # the workload's seed
    seeds: Sequence[int] = (0, 1, 2)  # arrival seeds (+ the config's): each cell runs once per seed, all policies alike
    pilots: int = 2  # pilot runs that move each cell's rate towards its knee
    variant_policy: PolicyConfig | None = None  # the variant's parameters (YAML); None: defaults
    # baselines named by a label run at these settings (e.g. "bailian λ=0.5": one parameter value of a
    # baseline tuned elsewhere); a name not here is a policy at its defaults
    configs: Mapping[str, PolicyConfig] = field(default_factory=dict)

    @property
    def policies(self) -> list[str]:
        return [self.ours, *([self.variant] if self.variant else []), *self.baselines]


def _mean(v: list[float]) -> float:
    v = [a for a in v if a == a]
    return sum(v) / len(v) if v else float("nan")


def _std(v: list[float]) -> float:
    """Sample standard deviation (0 for fewer than two values)."""
    v = [a for a in v if a == a]
    if len(v) < 2:
        return 0.0
    m = sum(v) / len(v)
    return math.sqrt(sum((a - m) ** 2 for a in v) / (len(v) - 1))


@dataclass
class Cell:
    """One map point over several seeds. Within a seed every policy replays the same arrivals (common
    random numbers), so a policy's per-seed ratio to a baseline is a paired comparison; across seeds
    the arrivals and the roots drawn differ, and the spread of those ratios is the cell's noise."""

    x_target: float
    tier: str
    x: float  # measured: mean input tokens / KV tokens per instance
    scale: float  # context-length scale of the preset
    kv_tokens: int  # KV tokens per instance (the profile's, or grown below x0)
    knees: list[KneeResult]  # one per seed

    @property
    def knee(self) -> KneeResult:
        """The first seed's (its peak rows stand for the cell in the per-cell tables)."""
        return self.knees[0]

    @property
    def flags(self) -> list[str]:
        return sorted({f for k in self.knees for f in k.flags})

    def score(self, policy: str) -> float:
        """Mean over seeds of the policy's best TPS within SLO."""
        return _mean([k.score(policy) for k in self.knees])

    def best_baseline(self, baselines: Sequence[str]) -> tuple[str, float]:
        """The baseline best on average over the seeds."""
        got = [(b, self.score(b)) for b in baselines if any(b in k.peaks for k in self.knees)]
        return max(got, key=lambda kv: kv[1]) if got else ("", float("nan"))

    def seed_ratios(self, policy: str, vs: str) -> list[float]:
        """Per seed: the policy's score ÷ ``vs``'s (paired: same arrivals)."""
        return [k.score(policy) / k.score(vs) for k in self.knees if k.score(vs) > 0]

    def ratio(self, policy: str, baselines: Sequence[str]) -> float:
        """Mean over seeds of the policy's score ÷ the best-on-average baseline's."""
        b, _ = self.best_baseline(baselines)
        return _mean(self.seed_ratios(policy, b)) if b else float("nan")

    def spread(self, policy: str, baselines: Sequence[str]) -> float:
        """Standard deviation over seeds of that ratio (0 with one seed)."""
        b, _ = self.best_baseline(baselines)
        return _std(self.seed_ratios(policy, b)) if b else float("nan")

    def interval(self, policy: str, baselines: Sequence[str], level: float = 0.9,
                 draws: int = 4000) -> tuple[float, float]:
        """A percentile bootstrap interval over the seeds for the policy's score ÷ the best
        baseline's. Each draw resamples the seeds with replacement and picks the best baseline anew
        on the resample, so the interval carries the favour the best-of-several choice gives the
        baselines; deterministic (fixed generator seed). (nan, nan) with fewer than two seeds."""
        pols = [policy, *(b for b in baselines if all(b in k.peaks for k in self.knees))]
        scores = [[k.score(p) for p in pols] for k in self.knees]
        if len(scores) < 2 or len(pols) < 2:
            return float("nan"), float("nan")
        rng = random.Random(0)
        n = len(scores)
        ratios = []
        for _ in range(draws):
            pick = [scores[rng.randrange(n)] for _ in range(n)]
            means = [sum(s[j] for s in pick) / n for j in range(len(pols))]
            best = max(means[1:])
            if best > 0:
                ratios.append(means[0] / best)
        ratios.sort()
        tail = (1 - level) / 2
        return ratios[int(tail * (len(ratios) - 1))], ratios[int((1 - tail) * (len(ratios) - 1))]

    def peak(self, policy: str) -> dict[str, Any]:
        return self.knee.summary(policy)


@dataclass
class RegimeMap:
    spec: MapSpec
    kv_tokens: int
    cells: list[Cell]

    def cell(self, x: float, tier: str) -> Cell:
        return next(c for c in self.cells if c.x_target == x and c.tier == tier)

    def ratios(self, policy: str, vs: Sequence[str] | None = None) -> list[float]:
        b = list(vs) if vs is not None else list(self.spec.baselines)
        return [c.ratio(policy, b) for c in self.cells]


def _mean_input(wl: Workload) -> float:
    return sum(r.input_tokens for _, r in wl.iter_requests()) / max(1, wl.n_requests)


def grown_profile(prof: Profile, kv_tokens: float) -> Profile:
    """``prof`` with enough HBM for ``kv_tokens`` of KV per instance, and the node's host pool grown
    in the same proportion (a fully provisioned global tier stays fully provisioned)."""
    k = kv_tokens / prof.kv_capacity_tokens()
    extra_gib = (kv_tokens - prof.kv_capacity_tokens()) * prof.kv_bytes_per_token / 1024**3
    hbm = prof.hbm_gib + extra_gib / (prof.tp * prof.gpu_memory_utilization)
    return prof.with_overrides(hbm_gib=hbm, host_pool_gib_per_node=prof.host_pool_gib_per_node * k)


def _cfg(base: SimConfig, spec: MapSpec, tier: str, rate: float) -> SimConfig:
    # roots drawn with replacement over a fixed window: the offered load is `rate` whatever the pool
    return msgspec.structs.replace(
        base, instances=spec.instances, global_tier=tier, pd=False, rate=rate, sampling="replace", drain=False,
        arrival_window_s=spec.window_s, max_sessions=None, warmup_share=spec.warmup_share,
    )  # fmt: skip


def _policy(spec: MapSpec, name: str) -> PolicyConfig:
    if spec.variant_policy is not None and name == spec.variant_policy.name:
        return spec.variant_policy
    if name in spec.configs:
        return spec.configs[name]
    return PolicyConfig(name=name)  # type: ignore[arg-type]


def build_workloads(
    spec: MapSpec, prof: Profile, block_size: int = 64
) -> tuple[dict[str, Workload], dict[float, tuple[float, Profile]]]:
    """Workloads by key ("scale1" below x0, f"x{x}" above) and, per x, (scale, profile)."""
    kv = prof.kv_capacity_tokens()
    # the agent compacts before its context plus an answer outgrows the model's window
    limit = int(0.9 * prof.max_context(block_size))
    one = preset_workload(spec.preset, spec.pool_roots, seed=spec.seed, context_limit=limit)
    x0 = _mean_input(one) / kv
    wls: dict[str, Workload] = {"scale1": one}
    cells: dict[float, tuple[float, Profile]] = {}
    for x in spec.xs:
        if x <= x0:
            cells[x] = (1.0, grown_profile(prof, _mean_input(one) / x))
            continue
        s = x / x0
        wl = preset_workload(spec.preset, spec.pool_roots, seed=spec.seed, scale=s, context_limit=limit)
        # contexts clipped at the model's window fall short of the target: scale up once to compensate
        got = _mean_input(wl) / kv
        if got < 0.95 * x:
            s *= x / got
            wl = preset_workload(spec.preset, spec.pool_roots, seed=spec.seed, scale=s, context_limit=limit)
        wls[f"x{x}"] = wl
        cells[x] = (s, prof)
    return wls, cells


def _wkey(scale: float, x: float) -> str:
    return "scale1" if scale == 1.0 else f"x{x}"


def run_map(spec: MapSpec, base: SimConfig, prof: Profile, jobs: int = 1) -> RegimeMap:
    kv = prof.kv_capacity_tokens()
    wls, per_x = build_workloads(spec, prof)
    settings = {
        (x, t, sd): Setting(_wkey(per_x[x][0], x), msgspec.structs.replace(_cfg(base, spec, t, 1.0), seed=base.seed + sd), per_x[x][1])
        for x in spec.xs
        for t in spec.tiers
        for sd in spec.seeds
    }  # fmt: skip
    pols = [_policy(spec, p) for p in spec.policies]
    res = knee_sweeps(
        wls, settings, pols, _policy(spec, spec.ours), spec.rate_factors, jobs, spec.pilots, desc="map",
        min_sessions=spec.min_sessions, extend=spec.extend,
        labels=spec.policies if spec.configs else None,
    )
    cells = []
    for x in spec.xs:
        for t in spec.tiers:
            s, p = per_x[x]
            kvx = p.kv_capacity_tokens()
            wl = wls[settings[(x, t, spec.seeds[0])].wkey]
            cells.append(Cell(x, t, _mean_input(wl) / kvx, s, kvx, [res[(x, t, sd)] for sd in spec.seeds]))
    return RegimeMap(spec, kv, cells)


# ---- presentation -------------------------------------------------------------------------------


def _r(v: float) -> str:
    return "–" if v != v else f"{v:.2f}"


def map_table(m: RegimeMap, policy: str) -> str:
    """Ratio of `policy` to the best baseline per cell (rows: global tier, columns: x)."""
    xs = list(m.spec.xs)
    head = "| global tier \\ x | " + " | ".join(f"{m.cell(x, m.spec.tiers[0]).x:.3f}" for x in xs) + " |"
    lines = [head, "|" + "---|" * (len(xs) + 1)]
    for t in m.spec.tiers:
        row = []
        for x in xs:
            c = m.cell(x, t)
            b, _ = c.best_baseline(m.spec.baselines)
            sd = f" ± {c.spread(policy, m.spec.baselines):.2f}" if len(c.knees) > 1 else ""
            row.append(f"{_r(c.ratio(policy, m.spec.baselines))}{sd} ({b})" + (" *" if c.flags else ""))
        lines.append(f"| {t} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def detail_table(m: RegimeMap) -> str:
    """Per cell: knee, every policy's peak TPS within SLO and where SMetric's hits come from."""
    pols = m.spec.policies
    head = ["x", "KV", "scale", "tier", "knee (sessions/s)", *pols, "smetric local/global/miss", "best baseline local/global/miss",
            "smetric imbalance", "best imbalance", "smetric busy", "smetric rpm/inst"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in m.cells:
        s = c.peak(m.spec.ours)
        b, _ = c.best_baseline(m.spec.baselines)
        bs = c.peak(b)

        def split(d: dict[str, Any]) -> str:
            return "–" if not d else f"{d['hit_local']:.2f}/{d['hit_global']:.2f}/{d['hit_miss']:.2f}"

        row = [f"{c.x:.3f}", f"{c.kv_tokens:,}", f"{c.scale:.2f}", c.tier, f"{c.knee.knee_rate:.3g}", *(f"{c.score(p):,.0f}" for p in pols), split(s), split(bs),
               _r(s.get("token_imbalance_mean", math.nan)), _r(bs.get("token_imbalance_mean", math.nan)),
               f"{s.get('gpu_busy_share', math.nan):.0%}", f"{s.get('req_per_min_per_instance', math.nan):.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def regions(m: RegimeMap) -> list[tuple[str, list[Cell]]]:
    """The map cut into regions: (no / partial / full global tier) x (short / long contexts)."""
    groups = {
        "no global tier": ["none"],
        "partial global tier (0.4, 1.6)": ["0.4", "1.6"],
        "full global tier": ["full"],
    }
    out = []
    for gname, tiers in groups.items():
        for lo, hi, xname in ((0.0, 0.15, "x ≤ 0.1"), (0.15, 10.0, "x ≥ 0.2")):
            cells = [c for c in m.cells if c.tier in tiers and lo <= c.x_target < hi]
            if cells:
                out.append((f"{gname}, {xname}", cells))
    return out


def region_paragraphs(m: RegimeMap) -> str:
    """One paragraph per region, every claim taken from the cells' numbers."""
    ours, var, bl = m.spec.ours, m.spec.variant, m.spec.baselines
    paras = []
    for name, cells in regions(m):
        r = [c.ratio(ours, bl) for c in cells]
        best = [c.best_baseline(bl)[0] for c in cells]
        common = max(set(best), key=best.count)
        sm = [c.peak(ours) for c in cells if c.peak(ours)]
        bb = [c.peak(b) for c, b in zip(cells, best) if c.peak(b)]

        def avg(rows: list[dict[str, Any]], k: str) -> float:
            return _mean([float(d.get(k, math.nan)) for d in rows])

        def reason(rows: list[dict[str, Any]], k: str) -> float:
            return _mean(
                [d.get("reasons", {}).get(k, 0) / max(1, sum(d.get("reasons", {}).values())) for d in rows]
            )

        verdict = "wins" if min(r) >= 1.0 else ("loses" if max(r) < 1.0 else "is mixed")
        text = (
            f"**{name}.** SMetric {verdict} here: {_r(min(r))}–{_r(max(r))}× the best baseline "
            f"(mostly {common}). SMetric serves {avg(sm, 'hit_local'):.0%} of prompt tokens from the local tier, "
            f"{avg(sm, 'hit_global'):.0%} from the global tier and recomputes {avg(sm, 'hit_miss'):.0%}; "
            f"{common} {avg(bb, 'hit_local'):.0%} / {avg(bb, 'hit_global'):.0%} / {avg(bb, 'hit_miss'):.0%}. "
            f"Token-window imbalance (max/mean) {avg(sm, 'token_imbalance_mean'):.2f} vs "
            f"{avg(bb, 'token_imbalance_mean'):.2f}. SMetric's follow-ups: {reason(sm, 'sticky'):.0%} sticky, "
            f"{reason(sm, 'evicted_fallback'):.0%} rebalanced as evicted, {reason(sm, 'overloaded_fallback'):.0%} "
            f"shed as overloaded."
        )
        if avg(sm, "hit_miss") > avg(bb, "hit_miss") + 0.02:
            text += " It recomputes more than the winner: its rebalanced sessions lose their KV."
        elif avg(sm, "token_imbalance_mean") > avg(bb, "token_imbalance_mean") + 0.1:
            text += " Its reuse is at least as good, so the gap is the load skew stickiness leaves."
        if var:
            rv = [c.ratio(var, bl) for c in cells]
            text += f" The variant `{var}`: {_r(min(rv))}–{_r(max(rv))}× the best baseline."
        paras.append(text)
    return "\n\n".join(paras) + "\n"


def heatmap_png(m: RegimeMap, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pols = [m.spec.ours] + ([m.spec.variant] if m.spec.variant else [])
    fig, axes = plt.subplots(1, len(pols), figsize=(5.2 * len(pols), 3.6), squeeze=False)
    xs, tiers = list(m.spec.xs), list(m.spec.tiers)
    for ax, pol in zip(axes[0], pols):
        grid = np.array([[m.cell(x, t).ratio(pol, m.spec.baselines) for x in xs] for t in tiers])
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0.6, vmax=1.4, aspect="auto", origin="lower")
        for i in range(len(tiers)):
            for j in range(len(xs)):
                ax.text(j, i, _r(grid[i, j]), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(xs)), [f"{m.cell(x, tiers[0]).x:.2f}" for x in xs])
        ax.set_yticks(range(len(tiers)), tiers)
        ax.set_xlabel("mean context ÷ KV capacity per instance")
        ax.set_ylabel("global tier")
        ax.set_title(f"{pol} ÷ best baseline (max TPS in SLO)", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def noise_line(m: RegimeMap) -> str:
    """How big the seed-to-seed noise of a cell's ratio is, over every policy and cell."""
    n = len(m.spec.seeds)
    if n < 2:
        return "With one seed the noise is not measured here (reruns moved single cells by 5-10%)."
    sds = sorted(c.spread(p, m.spec.baselines) for c in m.cells for p in m.spec.policies)
    sds = [v for v in sds if v == v]
    med, top = sds[len(sds) // 2], sds[-1]
    return (
        f"Noise: the per-seed ratios' standard deviation is {med:.3f} at the median (policy, cell) and up to "
        f"{top:.3f}; a cell's mean over {n} seeds is uncertain by about sd/√{n} ≈ {med / math.sqrt(n):.3f} "
        f"(median), so differences under ~{2 * med / math.sqrt(n):.2f} in one cell are not resolved."
    )


def map_markdown(m: RegimeMap, png: str | None = None) -> str:
    sp = m.spec
    md = [
        f"Preset `{sp.preset}`, {sp.instances} instances; the profile's {m.kv_tokens:,} KV tokens per instance, grown "
        "below the preset's natural x (column `KV`), contexts scaled above it (column `scale`). Each cell at its own "
        f"knee: rates {', '.join(f'{f:g}' for f in sp.rate_factors)} × the rate a pilot put at {TARGET_BUSY:.0%} GPU busy "
        "(one more run 1.5× beyond for a policy best at either end, or not 80% busy at the top; and every policy at "
        "every load where another policy of the cell peaked), over an arrival "
        f"window of ≥ {sp.window_s:g} s" + (f" stretched to ≥ {sp.min_sessions} root sessions" if sp.min_sessions else "")
        + f", its first {sp.warmup_share:.0%} warm-up; every policy credited with its best. Best baseline among {', '.join(sp.baselines)}. "
        "Columns: measured x = mean input ÷ KV tokens per instance. `*`: a flagged cell (see below).\n",
        f"Every cell runs {len(sp.seeds)} arrival seed(s); within a seed all policies replay the same arrivals and "
        "the same roots (common random numbers), so each ratio is a paired per-seed ratio to the baseline that is "
        "best on average, and the table shows its mean ± its standard deviation over the seeds. "
        + noise_line(m) + "\n",
        f"SMetric ÷ best baseline:\n\n{map_table(m, sp.ours)}",
    ]
    if sp.variant:
        md.append(f"`{sp.variant}` ÷ best baseline:\n\n{map_table(m, sp.variant)}")
        md.append(f"`{sp.variant}` ÷ SMetric: " + ", ".join(
            f"{c.tier}@{c.x:.3f} {_r(_mean(c.seed_ratios(sp.variant, sp.ours)))}" for c in m.cells) + "\n")  # fmt: skip
    if png:
        md.append(f"![regime map]({png})\n")
    md += ["Per cell:\n", detail_table(m), "Why, region by region:\n", region_paragraphs(m)]
    flagged = []
    for c in m.cells:
        busy = [float(c.peak(p).get("gpu_busy_share", math.nan)) for p in sp.policies if c.peak(p)]
        top = [p for p in sp.policies if f"{p}: best at the top rate" in c.flags]
        bottom = [p for p in sp.policies if f"{p}: best at the bottom rate" in c.flags]
        low = sum(1 for b in busy if b < 0.8)
        slo = sum(1 for f in c.flags if "SLO-bound" in f)
        unreached = sum(1 for f in c.flags if "did not reach" in f)
        skewed = sum(1 for f in c.flags if "load-skewed" in f)
        if low or top or bottom:
            flagged.append(f"- {c.tier} @ x={c.x:.3f}: peaks at {min(busy):.0%}–{max(busy):.0%} GPU busy ({low} below 80%"
                           + (f"; over the seeds {slo} peak rows SLO-bound, {skewed} load-skewed, {unreached} short of "
                              "the knee" if low else "")
                           + ")" + (f"; best at the top load: {', '.join(top)}" if top else "")
                           + (f"; best at the bottom load: {', '.join(bottom)}" if bottom else ""))  # fmt: skip
    if flagged:
        md += ["Flagged cells (a peak below 80% GPU busy, with its cause: SLO-bound = more load saturated the GPUs but "
               "lost SLO, load-skewed = the busiest instance saturated while the mean stayed low, short of the knee = no run "
               "saturated them; or a best load at the edge of the sweep):\n",
               "\n".join(flagged) + "\n"]  # fmt: skip
    return "\n".join(md)
