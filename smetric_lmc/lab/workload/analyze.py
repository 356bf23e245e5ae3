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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from smetric_lmc.lab.workload.model import BLOCK_DTYPE, Workload

log = logging.getLogger(__name__)

# Log-spaced reuse-interval bins (seconds); interval 0 (same instant) falls in the first bin.
INTERVAL_EDGES = np.concatenate([[0.0], np.logspace(-3, 7, 201)])

#: The PNGs `plot_report` writes: file name suffix -> the title after "<workload>: ".
PLOTS: dict[str, str] = {
    "reuse_breakdown": "reuse breakdown",
    "reuse_interval_cdf": "reuse interval CDF",
    "requests_per_session": "requests per session",
}


def plot_names(report: AnalysisReport) -> dict[str, str]:
    """File name of each plot of `report` (suffix -> file name), as `plot_report` writes them."""
    return {key: f"{report.name}_{key}.png" for key in PLOTS}


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
    lines += [
        "",
        "Each row replays the requests in arrival order onto the instances, either always to the one with "
        "the fewest input tokens in the current window (least_tokens) or keeping every follow-up on its "
        "session's first instance (sticky_sessions), and reports per window the busiest instance's tokens "
        "over the mean (1.00: perfectly even; the gap between the rows is what stickiness costs in balance).",
    ]
    hint = shared_prefix_hint(r)
    if hint:
        lines += ["", f"Hint: {hint}"]
    names = plot_names(r)
    lines += ["", "## Plots", "", "Written next to this report by `smetric trace analyze --out DIR`:", ""]
    lines += [f"- [{PLOTS[k]}]({names[k]})" for k in PLOTS]
    return "\n".join(lines) + "\n"


def shared_prefix_hint(report: AnalysisReport) -> str | None:
    """Why inter-session reuse reads 0 on a trace whose block ids are conversation-local, and the fix."""
    r = report
    if r.meta.get("shared_prefix") is False and r.reuse["inter_session"] == 0 and r.reuse["system_prompt"] == 0:
        return (
            "inter-session and system-prompt reuse are 0 because this trace's block ids are local to each "
            "conversation, so no two sessions can share a block; `--shared-prefix` maps each session's "
            "system prompt and tool blocks to ids shared by all sessions of the same agent type."
        )
    return None


def report_figures(report: AnalysisReport) -> Iterator[tuple[str, Any]]:
    """(file name, open matplotlib figure) of each plot; the caller saves and closes them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = plot_names(report)
    draw = {"reuse_breakdown": _plot_reuse, "reuse_interval_cdf": _plot_interval_cdf,
            "requests_per_session": _plot_session_length}
    for key, title in PLOTS.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        draw[key](ax, report)
        ax.set_title(f"{report.name}: {title}")
        fig.tight_layout()
        yield names[key], fig


def plot_report(report: AnalysisReport, outdir: str | Path) -> list[Path]:
    """Write the PNGs of `PLOTS` (reuse breakdown, reuse-interval CDF, requests per session)."""
    import matplotlib.pyplot as plt

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for name, fig in report_figures(report):
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def _plot_reuse(ax: Any, r: AnalysisReport) -> None:
    keys = ["total", "intra_session", "inter_session", "system_prompt"]
    bars = ax.bar(["total", "intra-\nsession", "inter-\nsession", "system\nprompt"],
                  [100 * r.reuse[k] for k in keys], color=["C7", "C0", "C1", "C2"])
    ax.bar_label(bars, fmt="%.1f%%")
    ax.set_ylabel("% of request blocks")
    ax.set_xlabel("ideal reuse (infinite cache) by source")
    ax.set_ylim(0, 105)


def interval_span(r: AnalysisReport) -> tuple[float, float] | None:
    """(lower edge of the first, upper edge of the last) reuse-interval bin holding data; None: no reuse."""
    counts = np.diff(np.concatenate([[0.0], r.interval_cdf]))
    nonzero = np.flatnonzero(counts > 0)
    if not len(nonzero):
        return None
    lo, hi = int(nonzero[0]), int(nonzero[-1])
    lower = r.interval_edges[lo - 1] if lo > 0 else r.interval_edges[0] / 10  # bin 0 starts at 0 s
    return float(lower), float(r.interval_edges[hi])


def _plot_interval_cdf(ax: Any, r: AnalysisReport) -> None:
    span = interval_span(r)
    ax.set_xscale("log")
    ax.set_xlabel("reuse interval (s)")
    ax.set_ylabel("CDF of block reuses")
    ax.grid(True, alpha=0.3)
    if span is None:
        ax.text(0.5, 0.5, "no block is reused", ha="center", va="center", transform=ax.transAxes)
        return
    lower, upper = span
    keep = (r.interval_edges >= lower) & (r.interval_edges <= upper)
    x = np.concatenate([[lower], r.interval_edges[keep]])
    y = np.concatenate([[0.0], r.interval_cdf[keep]])
    ax.step(x, y, where="post")
    for q in ("p50", "p90"):
        v = r.interval_pct[q]
        if np.isfinite(v):
            ax.axvline(v, color="C3", alpha=0.5, linestyle="--")
            ax.annotate(f"{q} {_fmt(v)} s", (v, 0.05 if q == "p50" else 0.15), color="C3", fontsize=8)
    ax.set_xlim(lower, upper if upper > lower * 1.5 else lower * 1.5)
    ax.set_ylim(0, 1.02)


def _plot_session_length(ax: Any, r: AnalysisReport) -> None:
    counts = r.requests_per_session
    if len(counts):
        bins = np.unique(np.logspace(0, np.log10(max(2, counts.max() + 1)), 30).astype(int))
        ax.hist(counts, bins=bins)
        ax.set_xscale("log")
    ax.set_xlabel("requests per session")
    ax.set_ylabel("sessions")
