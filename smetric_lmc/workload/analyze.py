"""Trace analysis: how much KV reuse a workload offers, where it comes from, and how well its load
can be balanced.

Session placement. Requests are replayed open-loop at session start + recorded arrival. A workload
with absolute start times (Bailian, Mooncake) keeps them. One without (WEKA, synthetic: every root
session starts at 0) gets its root sessions placed as a Poisson process, in a seeded random order,
at the rate that keeps `concurrency` root sessions active on average (Little's law with the mean
root session span); sub-agents start at their recorded offset from their root.

Reuse is counted per block with an infinite cache, as prefix hits: a request hits the longest
prefix of its blocks that any earlier request used. Each hit is "intra-session" when the request's
own session family (a root session and its sub-agents) used the block before, i.e. a per-session
cache would have it; otherwise "system-prompt" when the block is part of the first request of at
least two session families (shared system prompt / tool definitions), else "inter-session".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .model import BLOCK_DTYPE, Workload

log = logging.getLogger(__name__)

# Log-spaced reuse-interval bins (seconds); interval 0 (same instant) falls in the first bin.
INTERVAL_EDGES = np.concatenate([[0.0], np.logspace(-3, 7, 201)])


def _pct(x: np.ndarray | list[float]) -> dict[str, float]:
    a = np.asarray(x, dtype=float)
    if a.size == 0:
        return {
            "n": 0,
            "mean": float("nan"),
            "p50": float("nan"),
            "p90": float("nan"),
            "p99": float("nan"),
            "max": float("nan"),
        }
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "n": int(a.size),
        "mean": float(a.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
    }


@dataclass(slots=True)
class AnalysisReport:
    name: str
    block_size: int
    placement: str
    sessions: int
    families: int
    requests: int
    total_blocks: int
    reused_blocks: int
    # fractions of all request blocks: total, intra_session, inter_session, system_prompt
    reuse: dict[str, float]
    interval_edges: np.ndarray
    interval_cdf: np.ndarray  # fraction of reuses with interval <= interval_edges[i]
    interval_pct: dict[str, float]
    requests_per_session: np.ndarray
    session_pct: dict[str, float]
    first_request_share: float  # sessions' first requests / all requests
    turn0_share: float  # requests with turn 0 (first requests + history resets) / all requests
    kinds: dict[str, float]
    input_pct: dict[str, float]
    output_pct: dict[str, float]
    gap_pct: dict[str, float]  # arrival gap between consecutive requests of a session
    think_pct: dict[str, float]
    instances: int
    window_s: float
    # policy -> statistics of per-window max/mean token load over instances
    balance: dict[str, dict[str, float]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    scope: str = "family"


def _dense_blocks(arrays: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
    """Map every block id to a dense index 0..U-1, hashing each stored base array once."""
    bases: dict[int, np.ndarray] = {}
    spans: list[tuple[int, int]] = []
    for a in arrays:
        base = a.base
        ok = (
            isinstance(base, np.ndarray)
            and base.dtype == BLOCK_DTYPE
            and base.ndim == 1
            and base.flags.c_contiguous
            and a.dtype == BLOCK_DTYPE
            and (a.strides == (8,) or len(a) <= 1)
        )
        if not ok:
            base = np.ascontiguousarray(a, dtype=BLOCK_DTYPE)
            off = 0
        else:
            off = (a.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // 8
        bases.setdefault(id(base), base)
        spans.append((id(base), off))
    keys = list(bases)
    lens = [len(bases[k]) for k in keys]
    cat = np.concatenate([bases[k] for k in keys]) if keys else np.empty(0, dtype=BLOCK_DTYPE)
    uniq, inverse = np.unique(cat, return_inverse=True)
    inverse = inverse.astype(np.int64, copy=False)
    starts = (
        dict(zip(keys, np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist(), strict=True)) if keys else {}
    )
    out = [
        inverse[starts[k] + off : starts[k] + off + len(a)] for (k, off), a in zip(spans, arrays, strict=True)
    ]
    return out, len(uniq)


def _place(w: Workload, concurrency: float, seed: int) -> tuple[dict[str, float], str]:
    rel = w.absolute_start()
    roots = w.root_of()
    if w.meta.get("absolute_starts"):
        return rel, "recorded session start times"
    by_id = {s.session_id: s for s in w.sessions}
    span: dict[str, float] = {}
    for s in w.sessions:
        end = rel[s.session_id] + (s.requests[-1].arrival if s.requests else 0.0)
        r = roots[s.session_id]
        span[r] = max(span.get(r, 0.0), end - rel[r])
    root_ids = [s.session_id for s in w.sessions if roots[s.session_id] == s.session_id]
    mean_span = float(np.mean([span.get(r, 0.0) for r in root_ids])) if root_ids else 0.0
    rate = concurrency / mean_span if mean_span > 0 else 1.0
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(root_ids))
    t = np.cumsum(rng.exponential(1.0 / rate, len(root_ids)))
    start = {root_ids[i]: float(ti) for i, ti in zip(order, t, strict=True)}
    placed = {sid: start[roots[sid]] + (0.0 if roots[sid] == sid else rel[sid]) for sid in by_id}
    desc = (
        f"no recorded starts: root sessions placed as a Poisson process at {rate:.4g}/s "
        f"(mean concurrency {concurrency:g} x mean root span {mean_span:.0f} s), seed {seed}"
    )
    return placed, desc


def _balance(
    times: np.ndarray, tokens: np.ndarray, session: np.ndarray, turn0: np.ndarray, n: int, window_s: float
) -> dict[str, dict[str, float]]:
    """Per-window max/mean of tokens dispatched to `n` instances, for two dispatch rules."""
    out: dict[str, dict[str, float]] = {}
    win = np.floor(times / window_s).astype(np.int64)
    for policy in ("least_tokens", "sticky_sessions"):
        load = np.zeros(n)
        home: dict[int, int] = {}
        ratios: list[float] = []
        cur = win[0] if len(win) else 0
        for w, tok, s, t0 in zip(
            win.tolist(), tokens.tolist(), session.tolist(), turn0.tolist(), strict=True
        ):
            if w != cur:
                ratios.append(load.max() / load.mean() if load.sum() > 0 else 1.0)
                load[:] = 0.0
                cur = w
            if policy == "sticky_sessions" and not t0 and s in home:
                i = home[s]
            else:
                i = int(np.argmin(load))
                home[s] = i
            load[i] += tok
        if load.sum() > 0:
            ratios.append(load.max() / load.mean())
        out[policy] = {k: v for k, v in _pct(ratios).items() if k in ("n", "mean", "p50", "p90", "max")}
    return out


def analyze(
    workload: Workload,
    *,
    instances: int = 32,
    window_s: float = 60.0,
    concurrency: float | None = None,
    seed: int = 0,
    scope: str = "family",
) -> AnalysisReport:
    """Analyse `workload`; see the module docstring for how sessions are placed and reuse is split.

    `concurrency` (default 8 x instances, enough load to make balance matter) sets the placement rate of workloads without start times.
    `scope`: what counts as "intra-session" reuse: "family" (a root session and its sub-agents) or
    "session" (the session alone: a fork's reuse of its parent's context is inter-session, as the
    paper counts it). System-prompt blocks are always those opening the first request of >= 2 families.
    """
    if scope not in ("family", "session"):
        raise ValueError(f"scope must be 'family' or 'session', got {scope!r}")
    w = workload
    conc = float(concurrency if concurrency is not None else 8 * instances)
    start, placement = _place(w, conc, seed)
    roots = w.root_of()
    fam_index = {r: i for i, r in enumerate(dict.fromkeys(roots[s.session_id] for s in w.sessions))}

    times, fams, sess_idx, reqs = [], [], [], []
    gaps, thinks = [], []
    for si, s in enumerate(w.sessions):
        for k, r in enumerate(s.requests):
            times.append(start[s.session_id] + r.arrival)
            fams.append(fam_index[roots[s.session_id]])
            sess_idx.append(si)
            reqs.append(r)
            if k:
                gaps.append(r.arrival - s.requests[k - 1].arrival)
                thinks.append(r.think_time)
    t_arr = np.asarray(times, dtype=float)
    order = np.argsort(t_arr, kind="stable")
    dense, n_unique = _dense_blocks([r.block_ids for r in reqs])

    # Blocks opening the first request of >= 2 session families: the shared system prompt.
    fam_count = np.zeros(n_unique, dtype=np.int32)
    fam_first: dict[int, list[np.ndarray]] = {}
    pos = 0
    for s in w.sessions:
        if s.requests:
            fam_first.setdefault(fam_index[roots[s.session_id]], []).append(dense[pos])
        pos += len(s.requests)
    for parts in fam_first.values():
        fam_count[np.unique(np.concatenate(parts))] += 1
    sys_block = fam_count >= 2
    del fam_count

    last_use = np.full(n_unique, -np.inf)
    fam_seen: dict[int, set[int]] = {}
    hist = np.zeros(len(INTERVAL_EDGES) - 1, dtype=np.int64)
    total = intra = inter = sysp = 0
    for j in order.tolist():
        idx = dense[j]
        t = t_arr[j]
        n = len(idx)
        total += n
        prev = last_use[idx]
        unseen = np.flatnonzero(prev == -np.inf)
        hg = int(unseen[0]) if len(unseen) else n
        seen = fam_seen.setdefault(fams[j] if scope == "family" else sess_idx[j], set())
        # Family hits form a prefix of the global hit (blocks are prefix-chained): binary search.
        lo, hi = 0, hg
        while lo < hi:
            mid = (lo + hi) // 2
            if int(idx[mid]) in seen:
                lo = mid + 1
            else:
                hi = mid
        hf = lo
        intra += hf
        if hg > hf:
            sp = int(sys_block[idx[hf:hg]].sum())
            sysp += sp
            inter += hg - hf - sp
        if hg:
            hist += np.histogram(np.maximum(t - prev[:hg], 0.0), bins=INTERVAL_EDGES)[0]
        if hf < n:
            seen.update(idx[hf:].tolist())
        last_use[idx] = t

    hits = intra + inter + sysp
    denom = max(total, 1)
    n_hist = hist.sum()
    cdf = np.cumsum(hist) / n_hist if n_hist else np.zeros(len(hist))
    mids = INTERVAL_EDGES[1:]

    def _cdf_pct(q: float) -> float:
        if not n_hist:
            return float("nan")
        return float(mids[min(int(np.searchsorted(cdf, q)), len(mids) - 1)])

    per_session = np.array([len(s.requests) for s in w.sessions], dtype=np.int64)
    turns = np.array([r.turn for r in reqs], dtype=np.int64)
    kinds: dict[str, int] = {}
    for r in reqs:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    nreq = max(len(reqs), 1)
    tokens = np.array([r.input_tokens for r in reqs], dtype=float)
    balance = (
        _balance(
            t_arr[order], tokens[order], np.asarray(sess_idx)[order], (turns == 0)[order], instances, window_s
        )
        if reqs
        else {}
    )
    return AnalysisReport(
        name=w.name,
        block_size=w.block_size,
        placement=placement,
        sessions=len(w.sessions),
        families=len(fam_index),
        requests=len(reqs),
        total_blocks=total,
        reused_blocks=hits,
        reuse={
            "total": hits / denom,
            "intra_session": intra / denom,
            "inter_session": inter / denom,
            "system_prompt": sysp / denom,
        },
        interval_edges=mids,
        interval_cdf=cdf,
        interval_pct={
            "p10": _cdf_pct(0.1),
            "p50": _cdf_pct(0.5),
            "p90": _cdf_pct(0.9),
            "p99": _cdf_pct(0.99),
        },
        requests_per_session=per_session,
        session_pct=_pct(per_session),
        first_request_share=len(w.sessions) / nreq if reqs else 0.0,
        turn0_share=float((turns == 0).sum()) / nreq if reqs else 0.0,
        kinds={k: v / nreq for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        input_pct=_pct([r.input_tokens for r in reqs]),
        output_pct=_pct([r.output_tokens for r in reqs]),
        gap_pct=_pct(gaps),
        think_pct=_pct(thinks),
        instances=instances,
        window_s=window_s,
        balance=balance,
        meta=dict(w.meta),
        scope=scope,
    )


def _fmt(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _pct_row(label: str, d: dict[str, float]) -> str:
    return f"| {label} | " + " | ".join(_fmt(d[k]) for k in ("mean", "p50", "p90", "p99", "max")) + " |"


def format_report(report: AnalysisReport) -> str:
    """The report as markdown tables."""
    r = report
    lines = [
        f"# Workload analysis: {r.name}",
        "",
        f"- sessions: {r.sessions:,} ({r.families:,} session families), requests: {r.requests:,}, "
        f"block size: {r.block_size} tokens, blocks: {r.total_blocks:,}",
        f"- placement: {r.placement}",
        "- intra-session reuse counted per "
        + (
            "session (the paper's definition)"
            if r.scope == "session"
            else "session family (root + sub-agents)"
        ),
    ]
    for note in r.meta.get("notes", []):
        lines.append(f"- note: {note}")
    lines += [
        "",
        "## Ideal block reuse (infinite cache)",
        "",
        "| total | intra-session | inter-session | system prompt |",
        "|---|---|---|---|",
        "| "
        + " | ".join(
            f"{100 * r.reuse[k]:.1f}%" for k in ("total", "intra_session", "inter_session", "system_prompt")
        )
        + " |",
        "",
        "## Reuse interval (seconds between consecutive uses of a block)",
        "",
        "| p10 | p50 | p90 | p99 |",
        "|---|---|---|---|",
        "| " + " | ".join(_fmt(r.interval_pct[k]) for k in ("p10", "p50", "p90", "p99")) + " |",
        "",
        "## Distributions",
        "",
        "| quantity | mean | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|---|",
        _pct_row("requests per session", r.session_pct),
        _pct_row("input tokens", r.input_pct),
        _pct_row("output tokens", r.output_pct),
        _pct_row("gap between requests in a session (s)", r.gap_pct),
        _pct_row("think time (s)", r.think_pct),
        "",
        f"- first requests of sessions: {100 * r.first_request_share:.2f}% of requests; "
        f"turn 0 (incl. history resets): {100 * r.turn0_share:.2f}%",
        "- request kinds: " + ", ".join(f"{k or '?'} {100 * v:.1f}%" for k, v in r.kinds.items()),
        "",
        f"## Balance potential ({r.instances} instances, {r.window_s:g} s windows, input tokens)",
        "",
        "| dispatch | windows | mean max/mean | p50 | p90 | max |",
        "|---|---|---|---|---|---|",
    ]
    for policy, d in r.balance.items():
        lines.append(
            f"| {policy} | {d['n']} | "
            + " | ".join(f"{d[k]:.2f}" for k in ("mean", "p50", "p90", "max"))
            + " |"
        )
    return "\n".join(lines) + "\n"


def plot_report(report: AnalysisReport, outdir: str | Path) -> list[Path]:
    """Write PNGs: reuse breakdown bar, reuse-interval CDF, requests-per-session histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    r = report
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(5, 3.5))
    keys = ["intra_session", "inter_session", "system_prompt"]
    ax.bar(
        ["intra-session", "inter-session", "system prompt"],
        [100 * r.reuse[k] for k in keys],
        color=["C0", "C1", "C2"],
    )
    ax.set_ylabel("% of request blocks")
    ax.set_title(f"{r.name}: ideal reuse {100 * r.reuse['total']:.1f}%")
    fig.tight_layout()
    paths.append(out / f"{r.name}_reuse.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.step(r.interval_edges, r.interval_cdf, where="post")
    ax.set_xscale("log")
    ax.set_xlabel("reuse interval (s)")
    ax.set_ylabel("CDF of block reuses")
    ax.set_title(f"{r.name}: reuse interval")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    paths.append(out / f"{r.name}_reuse_interval_cdf.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    counts = r.requests_per_session
    if len(counts):
        bins = np.unique(np.logspace(0, np.log10(max(2, counts.max() + 1)), 30).astype(int))
        ax.hist(counts, bins=bins)
        ax.set_xscale("log")
    ax.set_xlabel("requests per session")
    ax.set_ylabel("sessions")
    ax.set_title(f"{r.name}: session length")
    fig.tight_layout()
    paths.append(out / f"{r.name}_turns.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
