"""PNG plots of simulation results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from smetric_lmc.lab.sim.metrics import SimResult  # noqa: E402
from smetric_lmc.lab.sim.sweep import SweepResult  # noqa: E402


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tps_vs_load(sw: SweepResult, path: Path, pd: bool = False) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for pol in sw.policies():
        pts = sorted((o.point.cfg.rate, o.result.score) for o in sw.outcomes if o.policy == pol)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
    ax.set_xlabel("offered load (sessions/s)")
    ax.set_ylabel("prefill TPS within SLO" if pd else "TPS within SLO (tokens/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def knob_bars(sw: SweepResult, path: Path, ylabel: str = "max TPS within SLO") -> Path:
    best = sw.best()
    values, pols = sw.values(), sw.policies()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(values) * max(1, len(pols)) / 3), 4.2))
    width = 0.8 / max(1, len(pols))
    x = np.arange(len(values))
    for k, pol in enumerate(pols):
        ys = [best[(v, pol)].result.score if (v, pol) in best else 0.0 for v in values]
        ax.bar(x + k * width, ys, width, label=pol)
    ax.set_xticks(x + width * (len(pols) - 1) / 2, values)
    ax.set_xlabel(sw.knob)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def heatmaps(results: Mapping[str, SimResult], path: Path, window_s: float) -> Path:
    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(8, 1.6 * n + 0.6), squeeze=False)
    for ax, (name, res) in zip(axes[:, 0], results.items()):
        w = res.win_tokens
        if w.size:
            im = ax.imshow(w.T / window_s, aspect="auto", cmap="viridis", interpolation="nearest")
            fig.colorbar(im, ax=ax, pad=0.01, label="tok/s")
        ax.set_title(f"{name}: per-instance token load (imbalance {res.summary.get('imbalance_mean', float('nan')):.2f})",
                     fontsize=9)  # fmt: skip
        ax.set_ylabel("instance")
    axes[-1, 0].set_xlabel(f"time window ({window_s:g} s)")
    return _save(fig, path)


def cdfs(results: Mapping[str, SimResult], path: Path) -> Path:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, res in results.items():
        for ax, x in ((a1, res.ttft), (a2, res.tpot)):
            if len(x):
                xs = np.sort(x)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    a1.set_xscale("log")
    a1.set_xlabel("TTFT (s)")
    a2.set_xscale("log")
    a2.set_xlabel("TPOT (s)")
    for ax in (a1, a2):
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    return _save(fig, path)


def all_plots(results: Mapping[str, SimResult], sweeps: Sequence[SweepResult], outdir: Path, window_s: float,
              pd: bool = False) -> list[Path]:  # fmt: skip
    out: list[Path] = []
    if results:
        out.append(heatmaps(results, outdir / "heatmap.png", window_s))
        out.append(cdfs(results, outdir / "latency_cdf.png"))
    for sw in sweeps:
        if sw.knob == "load":
            out.append(tps_vs_load(sw, outdir / "tps_vs_load.png", pd))
        else:
            out.append(knob_bars(sw, outdir / f"sweep_{sw.knob}.png"))
    return out
