"""A replay's records summarised with the simulator's definitions, for the simulator's tables.

Local hit = the engine's own ``cached_tokens`` over prompt tokens; stickiness = share of follow-ups
(turn > 0) served by the instance of the session's latest first turn; TPS within SLO, SLO
attainment and percentiles as ``sim.metrics`` computes them (same SLO config).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from smetric_lmc.lab.replay.runner import Record
from smetric_lmc.lab.sim.config import SimConfig
from smetric_lmc.lab.sim.metrics import SimResult, _pct, imbalance, slo_flags


def columns(records: Sequence[Record]) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """Simulator-shaped columns (``sim.metrics._COLS``), reasons per row, and the instance names."""
    recs = sorted(records, key=lambda r: (r.session, r.request))
    names = sorted({r.instance for r in recs if r.instance})
    pos = {n: i for i, n in enumerate(names)}
    first: dict[int, str] = {}
    sticky: list[int] = []
    for r in recs:
        if r.turn == 0:
            if r.ok:  # as in the simulator: a rejected first turn was never routed
                first[r.session] = r.instance
            sticky.append(-1)
        elif r.session in first and r.instance and r.ok:
            sticky.append(int(first[r.session] == r.instance))
        else:
            sticky.append(-1)
    failed = [not r.ok for r in recs]  # failed requests count as not served, like rejected ones
    cols = {
        "session": np.array([r.session for r in recs], dtype=np.int64),
        "turn": np.array([r.turn for r in recs], dtype=np.int64),
        "input": np.array([r.input for r in recs], dtype=np.int64),
        "output": np.array([r.output for r in recs], dtype=np.int64),
        "arrival": np.array([r.arrival for r in recs], dtype=np.float64),
        "first_token": np.array([r.first_token for r in recs], dtype=np.float64),
        "finish": np.array([r.finish for r in recs], dtype=np.float64),
        "instance": np.array([pos.get(r.instance, -1) for r in recs], dtype=np.int64),
        "local_tokens": np.array([r.cached_tokens or 0 for r in recs], dtype=np.int64),
        "global_tokens": np.zeros(len(recs), dtype=np.int64),
        "sticky": np.array(sticky, dtype=np.int64),
        "rejected": np.array(failed, dtype=bool),
    }
    return cols, [r.reason for r in recs], names


def summarize_records(records: Sequence[Record], cfg: SimConfig | None = None, policy: str | None = None,
                      window_s: float = 60.0) -> SimResult:
    cfg = cfg or SimConfig()
    cols, reasons, names = columns(records)
    n = len(cols["input"])
    if policy is None:
        seen = Counter(r.policy for r in records if r.policy)
        policy = seen.most_common(1)[0][0] if seen else "replay"
    pol = policy
    s: dict[str, Any] = {"policy": pol, "instances": len(names), "requests": n,
                         "failed": int(sum(1 for r in records if not r.ok and not r.rejected)),
                         "rejected": int(sum(1 for r in records if r.rejected))}
    if n == 0:
        s.update(tps_slo=0.0, prefill_tps_slo=0.0, pd=False)
        return SimResult(pol, s, np.empty(0), np.empty(0), np.zeros((0, 0)), cols)
    served, ttft_ok, tpot_ok, tt = slo_flags(cols, cfg)
    ttft, tpot = tt
    ok = ttft_ok & tpot_ok
    inp, outp = cols["input"], cols["output"]
    tokens = inp + outp if cfg.tps_tokens == "total" else outp
    t0 = float(np.nanmin(cols["arrival"]))
    t1 = float(np.nanmax(np.where(served, cols["finish"], t0)))
    dur = max(t1 - t0, 1e-9)
    served_in = int(inp[served].sum())
    fol = served & (cols["sticky"] >= 0)
    ttft_s, tpot_s = ttft[served], tpot[served & (outp > 1)]
    win = np.zeros((int(dur // window_s) + 1, max(1, len(names))), dtype=np.int64)
    for i in np.flatnonzero(served & (cols["instance"] >= 0)):
        win[int((cols["finish"][i] - t0) // window_s), cols["instance"][i]] += tokens[i]
    s.update(
        pd=False,
        duration_s=dur,
        tps=float(tokens[served].sum() / dur),
        tps_slo=float(tokens[ok].sum() / dur),
        prefill_tps_slo=float(inp[ttft_ok].sum() / dur),
        slo_attainment=float(ok[served].mean()) if served.any() else 0.0,
        # where TPS within SLO went: token shares of the served requests past their TTFT limit, and
        # within it but past the TPOT limit (what a router lost to queueing vs to crowded batches)
        tokens_lost_ttft=float(tokens[served & ~ttft_ok].sum() / max(1, tokens[served].sum())),
        tokens_lost_tpot=float(tokens[served & ttft_ok & ~tpot_ok].sum() / max(1, tokens[served].sum())),
        hit_local=float(cols["local_tokens"][served].sum() / max(1, served_in)),
        hit_global=0.0,
        hit_miss=1 - float(cols["local_tokens"][served].sum() / max(1, served_in)),
        stickiness=float(cols["sticky"][fol].mean()) if fol.any() else float("nan"),
        ttft_p50=_pct(ttft_s, 50), ttft_p90=_pct(ttft_s, 90), ttft_p99=_pct(ttft_s, 99),
        tpot_p50=_pct(tpot_s, 50), tpot_p90=_pct(tpot_s, 90), tpot_p99=_pct(tpot_s, 99),
        reasons=dict(sorted(Counter(r for r, sv in zip(reasons, served) if sv and r).items())),
    )  # fmt: skip
    imb = imbalance(win)
    s.update(imbalance_mean=imb["mean"], imbalance_p95=imb["p95"])
    return SimResult(pol, s, ttft_s, tpot_s, win, cols)
