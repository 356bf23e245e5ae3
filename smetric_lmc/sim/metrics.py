"""Per-request records and the summary metrics of one simulation run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from smetric_lmc.sim.cluster import Simulator
    from smetric_lmc.sim.engine import SimRequest

_COLS = (
    "session", "turn", "input", "output", "arrival", "first_token", "finish", "instance",
    "local_tokens", "global_tokens", "sticky", "rejected",
)  # fmt: skip


class Recorder:
    """Collects one row per finished (or rejected) request."""

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.reasons: list[str] = []

    def add(self, r: SimRequest, instance: int, rejected: bool = False) -> None:
        self.rows.append((
            r.session.idx, r.turn, r.input, r.output, r.arrival, r.first_token, r.finish, instance,
            r.local_tokens, r.global_tokens, r.sticky, rejected,
        ))  # fmt: skip
        self.reasons.append(r.reason)

    def columns(self) -> dict[str, np.ndarray]:
        if not self.rows:
            return {c: np.empty(0) for c in _COLS}
        arr = list(zip(*self.rows))
        return {c: np.asarray(v) for c, v in zip(_COLS, arr)}


@dataclass
class SimResult:
    policy: str
    summary: dict[str, Any]
    ttft: np.ndarray  # seconds, served requests
    tpot: np.ndarray  # seconds, served requests with more than one output token
    win_tokens: np.ndarray  # (windows, instances): tokens processed
    cols: dict[str, np.ndarray] = field(repr=False, default_factory=dict)

    @property
    def score(self) -> float:
        """The number sweeps maximise: TPS within SLO (prefill TPS within SLO under PD)."""
        return float(self.summary["prefill_tps_slo"] if self.summary["pd"] else self.summary["tps_slo"])


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


def imbalance(win_tokens: np.ndarray) -> dict[str, float]:
    """Per-window max/mean load across instances (rows: windows), over the steady windows (total load at
    least half the 90th-percentile window: ramp-up and drain, when a handful of requests run on a
    large cluster, would otherwise dominate)."""
    if win_tokens.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan"), "windows": 0}
    tot = win_tokens.sum(axis=1)
    live = tot > 0
    if not live.any():
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan"), "windows": 0}
    steady = tot >= 0.5 * np.percentile(tot[live], 90)
    w = win_tokens[steady].astype(np.float64)
    ratio = w.max(axis=1) / w.mean(axis=1)
    return {"mean": float(ratio.mean()), "p50": _pct(ratio, 50), "p95": _pct(ratio, 95), "windows": int(len(ratio))}


def slo_flags(cols: dict[str, np.ndarray], sim_cfg: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(served, ttft_ok, tpot_ok, [ttft, tpot]) masks and values for every record."""
    served = ~cols["rejected"].astype(bool)
    ttft = cols["first_token"] - cols["arrival"]
    out = cols["output"]
    if sim_cfg.pd:
        tpot = np.full(len(out), sim_cfg.pd_decode_tpot_s)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(out > 1, (cols["finish"] - cols["first_token"]) / np.maximum(out - 1, 1), 0.0)
    ttft_ok = served & (ttft <= sim_cfg.slo.ttft_limit(cols["input"]) + 1e-9)
    tpot_ok = served & (tpot <= sim_cfg.slo.tpot_s + 1e-9)
    return served, ttft_ok, tpot_ok, np.stack([ttft, tpot])


def summarize(sim: Simulator) -> SimResult:
    cfg = sim.cfg
    cols = sim.rec.columns()
    n = len(cols["input"])
    win = np.stack(sim.win_tokens) if sim.win_tokens else np.zeros((0, cfg.instances), dtype=np.int64)
    s: dict[str, Any] = {
        "policy": sim.policy.name,
        "instances": cfg.instances,
        "rate": cfg.rate,
        "global_tier": cfg.global_tier,
        "pd": cfg.pd,
        "requests": n,
    }
    if n == 0:
        s.update(tps_slo=0.0, prefill_tps_slo=0.0)
        return SimResult(sim.policy.name, s, np.empty(0), np.empty(0), win, cols)
    served, ttft_ok, tpot_ok, tt = slo_flags(cols, cfg)
    ttft, tpot = tt
    ok = ttft_ok & tpot_ok
    inp = cols["input"].astype(np.int64)
    outp = cols["output"].astype(np.int64)
    tokens = inp + outp if cfg.tps_tokens == "total" else outp
    t0 = float(cols["arrival"].min())
    t1 = float(np.nanmax(np.where(served, cols["finish"], t0)))
    run_dur = max(t1 - t0, 1e-9)
    w0, w1 = t0, t1
    if cfg.measure == "arrivals" and sim.last_root_start > sim.first_root_start:
        w0, w1 = sim.first_root_start, sim.last_root_start
    dur = max(w1 - w0, 1e-9)
    inside = (cols["finish"] >= w0) & (cols["finish"] <= w1)
    served_in = int(inp[served].sum())
    loc = int(cols["local_tokens"][served].sum())
    glo = int(cols["global_tokens"][served].sum())
    fol = served & (cols["sticky"] >= 0)
    reasons = Counter(r for r, sv in zip(sim.rec.reasons, served) if sv)
    ttft_s, tpot_s = ttft[served], tpot[served & (outp > 1)]
    s.update(
        rejected=int((~served).sum()),
        rejected_input_share=float(inp[~served].sum() / max(1, inp.sum())),
        duration_s=run_dur,
        window_s=dur,
        tps=float(tokens[served & inside].sum() / dur),
        tps_slo=float(tokens[ok & inside].sum() / dur),
        prefill_tps_slo=float(inp[ttft_ok & inside].sum() / dur),
        tps_slo_run=float(tokens[ok].sum() / run_dur),
        slo_attainment=float(ok[served].mean()) if served.any() else 0.0,
        ttft_attainment=float(ttft_ok[served].mean()) if served.any() else 0.0,
        tpot_attainment=float(tpot_ok[served].mean()) if served.any() else 0.0,
        hit_local=loc / max(1, served_in),
        hit_global=glo / max(1, served_in),
        hit_miss=1 - (loc + glo) / max(1, served_in),
        stickiness=float(cols["sticky"][fol].mean()) if fol.any() else float("nan"),
        ttft_p50=_pct(ttft_s, 50), ttft_p90=_pct(ttft_s, 90), ttft_p99=_pct(ttft_s, 99),
        tpot_p50=_pct(tpot_s, 50), tpot_p90=_pct(tpot_s, 90), tpot_p99=_pct(tpot_s, 99),
        reasons=dict(sorted(reasons.items())),
        events=sim.events,
        evicted_local_blocks=int(sum(i.cache.evicted for i in sim.instances)),
        evicted_global_blocks=int(sim.gcache.evicted) if sim.gcache is not None else 0,
        link_busy_share=float(np.mean([lk.busy_s for lk in sim.links]) / dur) if sim.links else 0.0,
        fetched_gb=float(sum(lk.bytes for lk in sim.links) / 1e9),
    )  # fmt: skip
    imb = imbalance(win)
    s.update(token_imbalance_mean=imb["mean"], token_imbalance_p95=imb["p95"])
    if sim.win_load:
        samples = np.maximum(np.asarray(sim.win_samples, dtype=np.float64), 1)[:, None]
        imb = imbalance(np.stack(sim.win_load) / samples)
    s.update(imbalance_mean=imb["mean"], imbalance_p50=imb["p50"], imbalance_p95=imb["p95"])
    return SimResult(sim.policy.name, s, ttft_s, tpot_s, win, cols)
