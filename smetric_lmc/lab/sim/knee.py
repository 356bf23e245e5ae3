"""Each policy at its own saturation knee, for many settings at once.

A setting is a workload, a sim config (cluster, global tier, PD mode, arrival window) and a profile.
A pilot run of one policy at a guessed load measures the GPU busy share; the session rate is scaled
towards ``TARGET_BUSY`` (twice, by default). Every policy then runs at ``factors`` × that knee rate
(roots drawn with replacement, so more load means more sessions, never a pool that runs dry) and
is credited with its best score. A policy whose best is its highest load, or whose highest load
left its GPUs under ``BUSY_FLAG`` busy (the sweep has not reached its saturation knee yet), gets
one more run ``EXTEND_STEP`` x further, and one whose best is its lowest load one run ``EXTEND_STEP``
x lower (its SLO gave out below the knee rate: the peak is not bracketed), up to ``extend`` times.
Every policy also runs at every load where another policy of its setting peaked: past the SLO cliff
TPS within SLO is small and not monotone in the load, and a policy whose one lucky run past the cliff
beat its run at the knee was otherwise credited with that bump (a "collapse" of 5-10x in one seed of
the regime map that was the search, not the policy). Last, each policy runs halfway between its
best load and the next load above it, twice (``REFINE_ROUNDS``): its peak sits just below its SLO
cliff, and a grid step of 1.25x would otherwise credit a policy whose cliff falls just short of a
grid point with the run one step below it. With ``min_sessions``, each setting's
arrival window is then stretched so at least that many root sessions arrive at its knee rate (a
cell with long contexts saturates at a few sessions per minute: a short window measures a handful).

A peak below ``BUSY_FLAG`` busy is flagged with its cause: either the sweep did not reach the
policy's knee (a method failure), or it did and the policy's TPS within SLO peaked at a lower load
(SLO-bound before the GPUs: its busiest instance's share and its token imbalance say why).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.batch import Task, run_tasks
from smetric_lmc.lab.sim.config import SimConfig
from smetric_lmc.lab.sim.metrics import SimResult
from smetric_lmc.lab.sim.profile import Profile
from smetric_lmc.lab.workload.model import Workload
from smetric_lmc.lab.workload.presets import requests_per_root

TARGET_BUSY = 0.9
BUSY_FLAG = 0.8
HOT_BUSY = 0.95  # an instance this busy is saturated
EXTEND_STEP = 1.5
# Rounds that halve the gap between a policy's best load and the next one above it (see knee_sweeps):
# two take a 1.25x grid step to ~1.06x, so where a cliff falls costs a policy at most ~6% of its peak.
REFINE_ROUNDS = 2
REFINE_MIN_GAP = 0.02  # a gap already this narrow is not refined


@dataclass(frozen=True)
class Setting:
    wkey: str  # key into the workloads mapping
    cfg: SimConfig  # its rate is ignored: the knee search sets it
    profile: Profile


@dataclass
class KneeResult:
    knee_rate: float
    peaks: dict[str, SimResult] = field(default_factory=dict)  # policy -> its best run
    rate_factor: dict[str, float] = field(default_factory=dict)  # policy -> best rate / knee rate
    by_rate: dict[str, dict[float, float]] = field(default_factory=dict)  # policy -> rate -> score
    busiest: dict[str, float] = field(default_factory=dict)  # policy -> highest busy share of any of its runs
    flags: list[str] = field(default_factory=list)
    window_s: float = 0.0  # the arrival window the policies ran over

    def score(self, policy: str) -> float:
        r = self.peaks.get(policy)
        return float("nan") if r is None else r.score

    def summary(self, policy: str) -> dict[str, Any]:
        r = self.peaks.get(policy)
        return {} if r is None else r.summary

    def best_of(self, policies: Sequence[str]) -> tuple[str, float]:
        got = [(p, self.score(p)) for p in policies if p in self.peaks]
        return max(got, key=lambda kv: kv[1]) if got else ("", float("nan"))

    def ratio(self, policy: str, baselines: Sequence[str]) -> float:
        _, b = self.best_of(baselines)
        return self.score(policy) / b if b > 0 else float("nan")


def guess_rate(wl: Workload, prof: Profile, instances: int) -> float:
    """Root sessions/s that would keep the GPUs ~50% busy by a crude cost model (the pilot corrects it)."""
    reqs = [r for _, r in wl.iter_requests()]
    mean_in = sum(r.input_tokens for r in reqs) / max(1, len(reqs))
    mean_out = sum(r.output_tokens for r in reqs) / max(1, len(reqs))
    miss = int(0.25 * mean_in) + 1
    prefill = prof.iteration_time([(miss, int(mean_in - miss))], 0, 0)
    batch = 16
    decode = mean_out * prof.iteration_time([], batch, int(batch * mean_in)) / batch
    return 0.5 * instances / ((prefill + decode) * requests_per_root(wl))


def _at(cfg: SimConfig, rate: float) -> SimConfig:
    return msgspec.structs.replace(cfg, rate=rate)


def knee_sweeps(
    workloads: Mapping[str, Workload],
    settings: Mapping[Hashable, Setting],
    policies: Sequence[PolicyConfig],
    pilot: PolicyConfig,
    factors: Sequence[float],
    jobs: int = 1,
    pilots: int = 2,
    desc: str = "knee",
    extend: int = 1,
    min_sessions: int = 0,
    labels: Sequence[str] | None = None,
    refine: int = REFINE_ROUNDS,
) -> dict[Hashable, KneeResult]:
    """Each policy's best score around each setting's knee; ``extend`` more rounds, each one
    ``EXTEND_STEP`` x further, for the policies whose best is still their top load or whose top load
    did not saturate their GPUs; and every policy also at every load where another policy of the same
    setting peaked; then ``refine`` rounds, each running every policy halfway (geometrically)
    between its best load and the next load above it that it ran. Results are keyed by ``labels`` (default: the policy names; give labels to run
    several parameter settings of one policy side by side)."""
    if labels is not None:
        if len(labels) != len(policies) or len(set(labels)) != len(labels):
            raise ValueError("labels: one distinct label per policy")
        policies = [_Labelled(pol, lab) for pol, lab in zip(policies, labels)]  # type: ignore[misc]
    keys = list(settings)
    knee = {k: guess_rate(workloads[s.wkey], s.profile, s.cfg.instances) for k, s in settings.items()}
    for it in range(pilots):
        tasks = [
            Task(settings[k].wkey, _at(settings[k].cfg, knee[k]), pilot, settings[k].profile) for k in keys
        ]
        for k, r in zip(keys, run_tasks(workloads, tasks, jobs, desc=f"{desc}: pilot {it + 1}/{pilots}")):
            busy = max(float(r.summary.get("gpu_busy_share", 0.0)), 0.05)
            knee[k] *= min(16.0, max(0.25, TARGET_BUSY / busy))
    if min_sessions:
        settings = {k: _stretched(s, min_sessions / knee[k]) for k, s in settings.items()}
    out = {k: KneeResult(knee[k], window_s=settings[k].cfg.arrival_window_s) for k in keys}
    todo = [(k, pol, f) for k in keys for pol in policies for f in factors]
    top = {(k, pol.name): max(factors) for k in keys for pol in policies}
    bottom = {(k, pol.name): min(factors) for k in keys for pol in policies}
    ran: dict[tuple[Hashable, str], set[float]] = {(k, pol.name): set() for k in keys for pol in policies}
    top_busy: dict[tuple[Hashable, str], float] = {}

    def run_round(todo: list[tuple[Hashable, Any, float]], label: str) -> None:
        tasks = [
            Task(settings[k].wkey, _at(settings[k].cfg, knee[k] * f), _cfg_of(pol), settings[k].profile)
            for k, pol, f in todo
        ]
        for (k, pol, f), r in zip(todo, run_tasks(workloads, tasks, jobs, desc=label), strict=True):
            kr = out[k]
            kr.by_rate.setdefault(pol.name, {})[knee[k] * f] = r.score
            ran[(k, pol.name)].add(f)
            busy = float(r.summary.get("gpu_busy_share", 0.0))
            kr.busiest[pol.name] = max(kr.busiest.get(pol.name, 0.0), busy)
            top[(k, pol.name)] = max(top[(k, pol.name)], f)
            bottom[(k, pol.name)] = min(bottom[(k, pol.name)], f)
            if f >= top[(k, pol.name)]:
                top_busy[(k, pol.name)] = busy
            if pol.name not in kr.peaks or r.score > kr.peaks[pol.name].score:
                kr.peaks[pol.name] = r
                kr.rate_factor[pol.name] = f

    rnd = 0
    while todo:
        run_round(todo, desc if rnd == 0 else f"{desc}: bracketing ({rnd}/{extend + 1})")
        up: list[tuple[Hashable, PolicyConfig, float]] = []
        down: list[tuple[Hashable, PolicyConfig, float]] = []
        if rnd < extend and len(factors) > 1:
            # a policy still best at its top load, or not yet saturated there, has not shown its knee;
            # one best at its bottom load peaks below it (past its SLO cliff already): one step down
            up = [(k, pol, top[(k, pol.name)] * EXTEND_STEP) for k in keys for pol in policies
                  if out[k].rate_factor[pol.name] >= top[(k, pol.name)]
                  or top_busy.get((k, pol.name), 1.0) < BUSY_FLAG]  # fmt: skip
            down = [(k, pol, bottom[(k, pol.name)] / EXTEND_STEP) for k in keys for pol in policies
                    if out[k].rate_factor[pol.name] <= bottom[(k, pol.name)]]  # fmt: skip
        # past its SLO cliff a policy's TPS within SLO is small and not monotone in the load (a few
        # requests meet the SLO by luck), so a local search can credit a bump past the cliff as its
        # peak; every policy also runs at every load where another policy of the setting peaked
        # (the same loads for all: a paired comparison), and the extension goes on from there
        planned = {(k, pol.name, f) for k, pol, f in up + down}
        cross = [(k, pol, f) for k in keys for pol in policies for f in sorted(set(out[k].rate_factor.values()))
                 if f not in ran[(k, pol.name)] and (k, pol.name, f) not in planned]  # fmt: skip
        todo = up + down + cross
        rnd += 1
    for it in range(refine if len(factors) > 1 else 0):
        # TPS within SLO rises with the load up to a cliff and falls off it: a policy's peak lies
        # between its best load and the next load it ran, so halve that gap (geometrically).
        # Without this, a grid step of 1.25-1.5x credits a policy whose cliff falls just below a
        # grid point with its run one step down, up to a fifth below its peak, by luck of the grid.
        todo = []
        for k in keys:
            for pol in policies:
                fb = out[k].rate_factor[pol.name]
                above = [f for f in ran[(k, pol.name)] if f > fb]
                if above and min(above) / fb > 1 + REFINE_MIN_GAP:
                    todo.append((k, pol, math.sqrt(fb * min(above))))
        if not todo:
            break
        run_round(todo, f"{desc}: refining ({it + 1}/{refine})")
    for k, kr in out.items():
        for name, r in kr.peaks.items():
            if kr.rate_factor[name] >= top[(k, name)] and len(factors) > 1:
                kr.flags.append(f"{name}: best at the top rate")
            elif kr.rate_factor[name] <= bottom[(k, name)] and len(factors) > 1:
                kr.flags.append(f"{name}: best at the bottom rate")
            if r.summary.get("failed"):
                kr.flags.append(f"{name}: a run failed ({r.summary['failed']})")
            busy = float(r.summary.get("gpu_busy_share", 0.0))
            if busy < BUSY_FLAG:
                kr.flags.append(f"{name}: {low_peak_cause(r.summary, kr.busiest.get(name, busy))}")
    return out


def low_peak_cause(s: Mapping[str, Any], busiest: float) -> str:
    """Why a peak sits below ``BUSY_FLAG`` GPU busy, from the run's own numbers."""
    busy = float(s.get("gpu_busy_share", 0.0))
    hot = float(s.get("gpu_busy_max", math.nan))
    imb = float(s.get("token_imbalance_mean", math.nan))
    if busiest < BUSY_FLAG and hot >= HOT_BUSY:
        # not a sweep that stopped short: the policy piles its load onto a few instances, which saturate
        # while the rest idle; more offered load only lengthens their queues
        return (f"peak at {busy:.0%} GPU busy, load-skewed: its busiest instance was {hot:.0%} busy (token imbalance "
                f"{imb:.2f}) and no run's mean passed {busiest:.0%}")  # fmt: skip
    if busiest < BUSY_FLAG:
        return (f"peak at {busy:.0%} GPU busy and no run above {busiest:.0%}: the sweep did not reach "
                "this policy's knee")  # fmt: skip
    return (
        f"peak at {busy:.0%} GPU busy, SLO-bound: at more load its GPUs reached {busiest:.0%} but its TPS within "
        f"SLO fell; at the peak its busiest instance was {hot:.0%} busy (token imbalance {imb:.2f})"
    )


def refresh_flags(kr: KneeResult) -> None:
    """Re-derive the low-peak flags from the stored runs (a saved report rebuilt with newer wording)."""
    kr.flags = [f for f in kr.flags if ": peak at " not in f]
    for name, r in kr.peaks.items():
        busy = float(r.summary.get("gpu_busy_share", 0.0))
        if busy < BUSY_FLAG:
            kr.flags.append(f"{name}: {low_peak_cause(r.summary, kr.busiest.get(name, busy))}")


class _Labelled:
    """A policy config under a label: ``name`` is the label (what results are keyed by)."""

    __slots__ = ("cfg", "name")

    def __init__(self, cfg: PolicyConfig, name: str) -> None:
        self.cfg = cfg
        self.name = name


def _cfg_of(pol: PolicyConfig | _Labelled) -> PolicyConfig:
    return pol.cfg if isinstance(pol, _Labelled) else pol


def _stretched(s: Setting, window_s: float) -> Setting:
    if window_s <= s.cfg.arrival_window_s:
        return s
    return Setting(s.wkey, msgspec.structs.replace(s.cfg, arrival_window_s=window_s), s.profile)
