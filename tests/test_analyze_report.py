"""`smetric trace analyze`'s report and plots: titles match file names, axes span the data, the
report links its plots, explains its balance table, and hints at --shared-prefix when it applies.
The plots are checked as matplotlib objects (titles, labels, limits), not as pixels."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from smetric_lmc.lab.workload import TraceRequest, TraceSession, Workload, analyze, format_report
from smetric_lmc.lab.workload.analyze import PLOTS, interval_span, plot_names, plot_report, report_figures
from smetric_lmc.lab.workload.cli import main


def _req(t: float, ids: tuple[int, ...], turn: int) -> TraceRequest:
    return TraceRequest(t, 16 * len(ids), 1, np.array(ids, dtype=np.uint64), 0.0, "n", turn)


def _workload(meta: dict | None = None) -> Workload:
    # Reuse intervals: 5 s (s2 after s1), 10 s (s1's turn 1), 20 s (s3 after s1's turn 1).
    s1 = TraceSession("s1", [_req(0.0, (1, 2, 3), 0), _req(10.0, (1, 2, 3, 4), 1)], None, 0.0)
    s2 = TraceSession("s2", [_req(0.0, (1, 2, 5), 0)], None, 5.0)
    s3 = TraceSession("s3", [_req(0.0, (6,), 0), _req(10.0, (1, 2, 3, 4, 7), 0)], None, 20.0)
    return Workload("hand", 16, [s1, s2, s3], {"absolute_starts": True, **(meta or {})})


def test_titles_match_file_names_and_axes_are_labelled() -> None:
    r = analyze(_workload(), instances=2)
    figs = list(report_figures(r))
    try:
        assert [name for name, _ in figs] == [f"hand_{key}.png" for key in PLOTS]
        for (name, fig), title in zip(figs, PLOTS.values(), strict=True):
            (ax,) = fig.axes
            assert ax.get_title() == f"hand: {title}"
            # the title is the file name's words: "hand_reuse_interval_cdf.png" <-> "reuse interval CDF"
            assert name.removesuffix(".png").removeprefix("hand_").replace("_", " ") == title.lower()
            assert ax.get_xlabel()
            assert ax.get_ylabel()
        bars = figs[0][1].axes[0]
        heights = [p.get_height() for p in bars.patches]
        assert heights == pytest.approx([100 * r.reuse[k] for k in ("total", "intra_session", "inter_session",
                                                                   "system_prompt")])
    finally:
        for _, fig in figs:
            plt.close(fig)


def test_reuse_interval_axis_spans_the_data_not_the_bins() -> None:
    r = analyze(_workload(), instances=2)
    lower, upper = interval_span(r)  # type: ignore[misc]
    assert lower <= 5.0 < 20.0 <= upper
    assert upper / lower < 2 * 20.0 / 5.0  # one bin of slack each side, not 1 ms .. 10^7 s
    figs = dict(report_figures(r))
    try:
        ax = figs["hand_reuse_interval_cdf.png"].axes[0]
        lo, hi = ax.get_xlim()
        assert (lo, hi) == pytest.approx((lower, upper))
        (line,) = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 2]  # the CDF, not the p50/p90 marks
        x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
        assert x.min() == pytest.approx(lower) and x.max() == pytest.approx(upper)
        assert y[0] == 0 and y[-1] == pytest.approx(1.0) and np.all(np.diff(y) >= 0)
    finally:
        for fig in figs.values():
            plt.close(fig)


def test_no_reuse_draws_an_empty_cdf_that_says_so() -> None:
    w = Workload("flat", 16, [TraceSession("a", [_req(0.0, (1,), 0)], None, 0.0)], {"absolute_starts": True})
    r = analyze(w, instances=2)
    assert interval_span(r) is None
    figs = dict(report_figures(r))
    try:
        texts = [t.get_text() for t in figs["flat_reuse_interval_cdf.png"].axes[0].texts]
        assert texts == ["no block is reused"]
    finally:
        for fig in figs.values():
            plt.close(fig)


def test_report_links_its_plots_and_explains_the_balance_table(tmp_path: Path) -> None:
    r = analyze(_workload(), instances=2)
    text = format_report(r)
    for key, title in PLOTS.items():
        assert f"- [{title}]({plot_names(r)[key]})" in text
    balance = text.split("## Balance potential")[1].split("## Plots")[0]
    assert "| least_tokens |" in balance and "busiest instance's tokens over the mean" in balance
    # The links resolve to the files plot_report writes.
    written = {p.name for p in plot_report(r, tmp_path)}
    assert written == set(plot_names(r).values())


def test_shared_prefix_hint_only_for_conversation_local_ids() -> None:
    # Three sessions with nothing in common: inter-session reuse is 0.
    sessions = [TraceSession(f"c{i}", [_req(0.0, (10 * i + 1,), 0), _req(5.0, (10 * i + 1, 10 * i + 2), 1)],
                             None, float(i)) for i in range(3)]
    local = analyze(Workload("weka", 64, sessions, {"absolute_starts": True, "shared_prefix": False}))
    assert local.reuse["inter_session"] == 0 and "Hint: " in format_report(local)
    assert "--shared-prefix" in format_report(local)
    # Already mapped, or a trace with global ids: no hint.
    mapped = analyze(Workload("weka-shared", 64, sessions, {"absolute_starts": True, "shared_prefix": True}))
    assert "--shared-prefix" not in format_report(mapped)
    assert "Hint: " not in format_report(analyze(_workload()))


def test_cli_regenerates_the_pngs_under_their_titles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rep"
    assert main(["trace", "analyze", "synthetic", "--sessions", "4", "--scale", "0.05", "--instances", "4",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == len(PLOTS) and all(p.stat().st_size > 5000 for p in out.glob("*.png"))
    report = next(out.glob("*_report.md")).read_text()
    for name in pngs:
        assert f"({name})" in report and f"wrote {out / name}" in printed
