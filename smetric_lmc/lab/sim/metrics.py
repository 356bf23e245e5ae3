"""Per-request records and the summary metrics of one simulation run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from smetric_lmc.lab.sim.request import SimRequest

# A policy's peak counts as saturated when its GPUs were at least this busy (DESIGN §4).
SATURATED_BUSY = 0.8

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


def opening_imbalance(win_tokens: np.ndarray, window_s: float, span_s: float = 600.0) -> float:
    """Mean per-window max/mean load across instances over the replay's first ``span_s`` seconds,
    the ramp-up included: the SMetric paper's figure, read as written ("the tokens each instance
    processes per minute during the first 10 minutes of the replay", "the mean, over time, of the
    ratio", §4.1 Fig. 11c; Fig. 15b and 21b use the same §4.1 ratio). Windows with no load are skipped."""
    w = win_tokens[: max(1, round(span_s / window_s))].astype(np.float64)
    w = w[w.sum(axis=1) > 0]
    return float((w.max(axis=1) / w.mean(axis=1)).mean()) if len(w) else float("nan")


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


@dataclass
class RunStats:
    """What a finished run hands to ``summarize`` (plain data: metrics need no simulator)."""

    cfg: Any
    policy: str
    rec: Recorder
    win_tokens: list[np.ndarray]
    busy_in_window: float  # engine-busy seconds inside [measure_from, last_root_start]
    busy_in_window_by: list[float]  # the same per instance
    win_load: list[np.ndarray]
    win_samples: list[int]
    first_root_start: float
    last_root_start: float
    measure_from: float  # first_root_start + warmup_share x the arrival window
    events: int
    busy_s: list[float]
    stall_s: list[float]
    evicted_local_blocks: int
    evicted_global_blocks: int
    link_busy_s: dict[str, list[float]]
    fetched_bytes: float
    fetched_remote_bytes: float
    stored_bytes: float
    # (windows, instances): mean in-flight tokens (prefill tokens under PD), sim/token_load.py
    win_inflight_tokens: np.ndarray | None = None


def summarize(st: RunStats) -> SimResult:
    cfg = st.cfg
    cols = st.rec.columns()
    n = len(cols["input"])
    win = np.stack(st.win_tokens) if st.win_tokens else np.zeros((0, cfg.instances), dtype=np.int64)
    s: dict[str, Any] = {
        "policy": st.policy,
        "instances": cfg.instances,
        "rate": cfg.rate,
        "global_tier": cfg.global_tier,
        "kv_load_mode": cfg.kv_load_mode,
        "pd": cfg.pd,
        "requests": n,
    }
    if n == 0:
        s.update(tps_slo=0.0, prefill_tps_slo=0.0, gpu_busy_share=0.0, saturated=False)
        return SimResult(st.policy, s, np.empty(0), np.empty(0), win, cols)
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
    if cfg.measure == "arrivals" and st.last_root_start > st.first_root_start:
        w0, w1 = st.measure_from, st.last_root_start
    dur = max(w1 - w0, 1e-9)
    # GPU busy share: a step in progress (load/store waits included), per instance, over the window
    if (w0, w1) == (t0, t1):
        busy_share = sum(st.busy_s) / (run_dur * cfg.instances)  # every step lies in the run
        busy_max = max(st.busy_s) / run_dur
    else:
        busy_share = st.busy_in_window / (dur * cfg.instances)
        busy_max = max(st.busy_in_window_by, default=0.0) / dur
    inside = (cols["finish"] >= w0) & (cols["finish"] <= w1)
    arrived_in = served & (cols["arrival"] >= w0) & (cols["arrival"] <= w1)
    served_in = int(inp[served].sum())
    loc = int(cols["local_tokens"][served].sum())
    glo = int(cols["global_tokens"][served].sum())
    fol = served & (cols["sticky"] >= 0)
    reasons = Counter(r for r, sv in zip(st.rec.reasons, served) if sv)
    ttft_s, tpot_s = ttft[served], tpot[served & (outp > 1)]
    # Links: busy time (at least one transfer on it) over the run; a share of wall time, <= 1.
    link = {k: float(np.mean(v)) / run_dur if v else 0.0 for k, v in st.link_busy_s.items()}
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
        events=st.events,
        evicted_local_blocks=int(st.evicted_local_blocks),
        evicted_global_blocks=int(st.evicted_global_blocks),
        gpu_busy_share=busy_share,
        gpu_busy_max=busy_max,  # the busiest instance: an imbalanced policy saturates it first
        saturated=bool(busy_share >= SATURATED_BUSY),
        stall_share=float(sum(st.stall_s) / max(1e-9, sum(st.busy_s))),
        req_per_min_per_instance=float(arrived_in.sum() / (dur / 60.0) / cfg.instances),
        link_busy_share=link.get("nic_rx", 0.0),
        nic_tx_busy_share=link.get("nic_tx", 0.0),
        pcie_h2d_busy_share=link.get("pcie_h2d", 0.0),
        pcie_d2h_busy_share=link.get("pcie_d2h", 0.0),
        fetched_gb=st.fetched_bytes / 1e9,
        fetched_remote_gb=st.fetched_remote_bytes / 1e9,
        stored_gb=st.stored_bytes / 1e9,
    )  # fmt: skip
    # The paper's imbalance: tokens processed per instance per window, max/mean.
    imb = imbalance(win)
    s.update(imbalance_mean=imb["mean"], imbalance_p50=imb["p50"], imbalance_p95=imb["p95"])
    s.update(token_imbalance_mean=imb["mean"], token_imbalance_p95=imb["p95"])  # old names, same figure
    # Secondary: the policy's own load (in flight; unprefilled tokens under PD) sampled at routing.
    if st.win_load:
        samples = np.maximum(np.asarray(st.win_samples, dtype=np.float64), 1)[:, None]
        imb = imbalance(np.stack(st.win_load) / samples)
    s.update(inflight_imbalance_mean=imb["mean"], inflight_imbalance_p95=imb["p95"])
    # The paper's load imbalance (§4.1, Fig. 15b, Fig. 21b): in-flight tokens, queued ones included.
    if st.win_inflight_tokens is not None:
        imb = imbalance(st.win_inflight_tokens)
        s.update(load_imbalance_mean=imb["mean"], load_imbalance_p95=imb["p95"],
                 load_imbalance_opening=opening_imbalance(st.win_inflight_tokens, st.cfg.window_s))
    return SimResult(st.policy, s, ttft_s, tpot_s, win, cols)
