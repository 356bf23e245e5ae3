"""`trace` subcommands of the `smetric` command line."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .analyze import analyze, format_report, plot_report
from .loaders import load_any
from .model import Workload
from .native import save_native
from .synthetic import synthetic

log = logging.getLogger(__name__)


def _load(spec: str, shared_prefix: bool, sessions: int, seed: int, scale: float) -> Workload:
    if spec == "synthetic":
        return synthetic(sessions, seed=seed, scale=scale)
    return load_any(spec, shared_prefix=shared_prefix)


def _cmd_analyze(args: argparse.Namespace) -> int:
    w = _load(args.path, args.shared_prefix, args.sessions, args.seed, args.scale)
    report = analyze(w, instances=args.instances, window_s=args.window, concurrency=args.concurrency)
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
    w = synthetic(args.sessions, seed=args.seed, scale=args.scale)
    path = save_native(w, args.out)
    print(f"wrote {path}: {len(w.sessions)} sessions, {w.n_requests} requests")
    return 0


def add_trace_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Add `trace analyze|convert|synth` under a `trace` command of `subparsers`."""
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
    a.set_defaults(func=_cmd_analyze)

    c = sub.add_parser("convert", help="convert a trace to the native workload format")
    c.add_argument("input")
    c.add_argument("output")
    c.add_argument("--shared-prefix", action="store_true", help="WEKA: share system-prompt blocks")
    c.set_defaults(func=_cmd_convert)

    s = sub.add_parser("synth", help="generate a synthetic agentic workload (native format)")
    s.add_argument("--sessions", type=int, required=True)
    s.add_argument("--seed", type=int, required=True)
    s.add_argument("--scale", type=float, default=1.0)
    s.add_argument("--out", required=True)
    s.set_defaults(func=_cmd_synth)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (`python -m smetric_lmc.workload.cli trace ...`)."""
    parser = argparse.ArgumentParser(prog="smetric")
    add_trace_subcommands(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
