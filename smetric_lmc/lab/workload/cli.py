"""`trace` subcommands of the `smetric` command line."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from smetric_lmc.lab.workload.analyze import analyze, format_report, plot_report
from smetric_lmc.lab.workload.loaders import load_any
from smetric_lmc.lab.workload.model import Workload
from smetric_lmc.lab.workload.native import save_native
from smetric_lmc.lab.workload.presets import PAPER_TRACE1, PRESETS, preset_workload, requests_per_root

log = logging.getLogger(__name__)


def _load(
    spec: str, shared_prefix: bool, sessions: int, seed: int, scale: float, preset: str = "weka"
) -> Workload:
    if spec == "synthetic":
        return preset_workload(preset, sessions, seed=seed, scale=scale)
    return load_any(spec, shared_prefix=shared_prefix)


def _cmd_analyze(args: argparse.Namespace) -> int:
    w = _load(args.path, args.shared_prefix, args.sessions, args.seed, args.scale, args.preset)
    report = analyze(w, instances=args.instances, window_s=args.window, concurrency=args.concurrency,
                     scope=args.scope)  # fmt: skip
    text = format_report(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{report.name}_report.md").write_text(text)
        for p in plot_report(report, out):
            print(f"wrote {p}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    w = load_any(args.input, shared_prefix=args.shared_prefix)
    path = save_native(w, args.output)
    print(f"wrote {path}: {len(w.sessions)} sessions, {w.n_requests} requests")
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    w = preset_workload(args.preset, args.sessions, seed=args.seed, scale=args.scale)
    path = save_native(w, args.out)
    print(f"wrote {path}: {len(w.sessions)} sessions, {w.n_requests} requests")
    return 0


def preset_rows(workloads: dict[str, Workload], kv_tokens: int) -> list[tuple[str, list[str]]]:
    """One row of paper-comparable statistics per workload (reuse split per session, as the paper)."""
    rows: list[tuple[str, list[str]]] = []
    for label, w in workloads.items():
        r = analyze(w, scope="session")
        tot = max(r.reuse["total"], 1e-12)
        within = (
            float(np.interp(100.0, r.interval_edges, r.interval_cdf)) if len(r.interval_cdf) else float("nan")
        )
        rows.append((label, [
            f"{r.reuse['total']:.1%}", f"{r.reuse['intra_session'] / tot:.1%}",
            f"{r.reuse['system_prompt'] / tot:.1%}", f"{r.reuse['inter_session'] / tot:.1%}",
            f"{within:.1%}", f"{r.interval_pct['p90']:.0f}", f"{requests_per_root(w):.1f}",
            f"{r.input_pct['mean']:,.0f}", f"{r.input_pct['mean'] / kv_tokens:.3f}",
        ]))  # fmt: skip
    return rows


def presets_table(workloads: dict[str, Workload], kv_tokens: int) -> str:
    head = ["workload", "ideal reuse", "intra-session share", "system-prompt share", "inter-session share",
            "reuse within 100 s", "reuse p90 (s)", "requests per root", "mean input", "mean input / KV"]  # fmt: skip
    lo, hi = PAPER_TRACE1["system_prompt_share"]  # type: ignore[misc]
    paper = [f"≈{PAPER_TRACE1['reuse_total']:.0%}", f"≈{PAPER_TRACE1['intra_share']:.0%}", f"{lo:.0%}–{hi:.0%}",
             "the rest (≈13–15%)", "≈90%", f"≈{PAPER_TRACE1['reuse_p90_s']:.0f}", "–", "–", "–"]  # fmt: skip
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        "| paper, Trace 1 | " + " | ".join(paper) + " |",
    ]
    lines += [
        "| " + label + " | " + " | ".join(cells) + " |" for label, cells in preset_rows(workloads, kv_tokens)
    ]
    return "\n".join(lines) + "\n"


def _cmd_presets(args: argparse.Namespace) -> int:
    kv = args.kv_tokens()
    wls: dict[str, Workload] = {
        f"preset {name} ({args.sessions} roots)": preset_workload(name, args.sessions, seed=args.seed)
        for name in PRESETS
    }
    if args.weka:
        wls["WEKA trace, --shared-prefix"] = load_any(args.weka, shared_prefix=True)
    print(presets_table(wls, kv))
    print(
        f"(reuse split per session, as the paper counts it; KV = {kv:,} tokens per instance, default profile)"
    )
    return 0


def add_trace_subcommands(subparsers: argparse._SubParsersAction,
                          presets_kv_tokens: Callable[[], int] | None = None) -> None:
    """Add `trace analyze|convert|synth` under a `trace` command of `subparsers`, and `trace
    presets` when ``presets_kv_tokens`` (an instance's KV capacity, from an engine profile: the
    simulator's, which this package does not import) is given."""
    trace = subparsers.add_parser("trace", help="workload traces: analyse, convert, generate")
    sub = trace.add_subparsers(dest="trace_cmd", required=True)

    a = sub.add_parser("analyze", help="reuse, session and balance statistics of a trace")
    a.add_argument("path", help="trace file/folder/archive, native workload, or 'synthetic'")
    a.add_argument("--instances", type=int, default=32)
    a.add_argument("--window", type=float, default=60.0, help="balance window (s)")
    a.add_argument("--concurrency", type=float, default=None, help="mean active sessions when placing")
    a.add_argument("--out", default=None, help="folder for the markdown report and PNG plots")
    a.add_argument("--shared-prefix", action="store_true", help="WEKA: share system-prompt blocks")
    a.add_argument("--sessions", type=int, default=200, help="synthetic: root sessions")
    a.add_argument("--seed", type=int, default=0, help="synthetic: seed")
    a.add_argument("--scale", type=float, default=1.0, help="synthetic: token scale")
    a.add_argument("--preset", choices=tuple(PRESETS), default="weka", help="synthetic: preset")
    a.add_argument("--scope", choices=("family", "session"), default="family",
                   help="intra-session reuse per session family (root + sub-agents) or per session (the paper)")  # fmt: skip
    a.set_defaults(func=_cmd_analyze)

    if presets_kv_tokens is not None:
        t = sub.add_parser("presets", help="each synthetic preset's statistics vs the paper's published Trace 1")
        t.add_argument("--sessions", type=int, default=600, help="root sessions generated per preset")
        t.add_argument("--seed", type=int, default=0)
        t.add_argument("--weka", default=None, help="also analyse this WEKA trace (with --shared-prefix)")
        t.set_defaults(func=_cmd_presets, kv_tokens=presets_kv_tokens)

    c = sub.add_parser("convert", help="convert a trace to the native workload format")
    c.add_argument("input")
    c.add_argument("output")
    c.add_argument("--shared-prefix", action="store_true", help="WEKA: share system-prompt blocks")
    c.set_defaults(func=_cmd_convert)

    s = sub.add_parser("synth", help="generate a synthetic agentic workload (native format)")
    s.add_argument("--sessions", type=int, required=True)
    s.add_argument("--seed", type=int, default=0, help="random seed (the same seed gives the same workload)")
    s.add_argument("--scale", type=float, default=1.0)
    s.add_argument("--preset", choices=tuple(PRESETS), default="weka")
    s.add_argument("--out", required=True)
    s.set_defaults(func=_cmd_synth)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (`python -m smetric_lmc.lab.workload.cli trace ...`)."""
    parser = argparse.ArgumentParser(prog="smetric")
    add_trace_subcommands(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
