"""smetric sim: the trace-driven cluster simulator.

smetric sim (or smetric sim run) replays the built-in synthetic agentic workload on a small cluster
and prints the policy comparison. Subcommands: run, report (docs/results.md), map (the regime map),
paper (the SMetric paper's measurements side by side, docs/paper.md), calibrate and validate
(against real vLLM engines). smetric sim SUBCOMMAND --help lists each one's options. report and
paper write where --out says (docs/results.md and docs/paper.md in a checkout).

Calibrate and validate drive real engines: the replay package adds them (smetric_lmc.lab.replay.sim_cli
registers smetric sim), so that the simulator never imports the replay package.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from smetric_lmc.config import POLICY_NAMES, PolicyConfig
from smetric_lmc.lab.sim.config import GLOBAL_CHOICES, SimConfig, load_sim_config
from smetric_lmc.lab.sim.metrics import SimResult
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.sim.report import (
    comparison_table,
    default_out_dir,
    headline,
    reasons_table,
    slo_line,
    sweep_section,
)
from smetric_lmc.lab.sim.sweep import KNOBS, Point, SweepResult, rates_around, run_points, sweep
from smetric_lmc.lab.workload.model import Workload

log = logging.getLogger(__name__)

# The no-argument run: sized to finish within a few minutes on a laptop (2 cores), all 7 policies.
DEFAULT_SYNTH_SESSIONS = 96
DEFAULT_SYNTH_INSTANCES = 16
DEFAULT_SYNTH_RATE = 0.04


def _policies(text: str | None) -> list[str]:
    if not text:
        return list(POLICY_NAMES)
    pols = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in pols if p not in POLICY_NAMES]
    if bad:
        raise SystemExit(f"unknown policies {bad}; choose from {', '.join(POLICY_NAMES)}")
    return pols


def _floats(text: str | None) -> list[float] | None:
    return [float(x) for x in text.split(",")] if text else None


def _common(p: argparse.ArgumentParser, seed: bool = True) -> None:
    p.add_argument("--profile", help="hardware/model profile: a name under configs/profiles, or a YAML path")
    p.add_argument("--config", help="simulator defaults YAML (the packaged configs/sim.yaml when not given)")
    if seed:
        p.add_argument("--seed", type=int, help="workload and arrival seed")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")


def _fetch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fetch-path", help="how a global-tier hit is retrieved: lmcache-mooncake-rdma (the paper's "
                   "testbed), lmcache-redis, lmcache-local-cpu or line-rate (configs/fetch_paths.yaml)")
    p.add_argument("--fetch-gbs", type=float, help="per-request retrieve throughput cap in GB/s (overrides the path's)")


def _slowdown(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slowdown-cv", type=float, help="instances slower for a while: coefficient of variation of "
                   "each instance's step-time factor (0, off, when not given; docs/simulator.md)")
    p.add_argument("--slowdown-period-s", type=float, help="how often the factor is redrawn (inf: fixed per instance)")


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="trace file, folder or archive (WEKA, Bailian, Mooncake, native); "
                   "without it a synthetic workload is generated")
    p.add_argument("--shared-prefix", action="store_true",
                   help="WEKA: map each session's system prompt and tools to ids shared across sessions")
    p.add_argument("--preset", choices=("weka", "trace1"), help="synthetic workload preset (weka when not given)")
    p.add_argument("--scale", type=float, help="synthetic: context-length scale of the preset (1 when not given)")
    p.add_argument("--sessions", type=int, help="replay only N root sessions (synthetic: generate N)")
    p.add_argument("--instances", type=int, help="instances (16 for the synthetic workload when not given)")
    p.add_argument("--policies", help=f"comma list of policies (all when not given: {','.join(POLICY_NAMES)})")
    p.add_argument("--global", dest="global_tier", choices=GLOBAL_CHOICES, help="global tier provisioning")
    _fetch(p)
    p.add_argument("--load-signal", choices=("router", "scrape"),
                   help="load the policy reads: the router's own in-flight counts, or engine metrics scraped periodically")
    p.add_argument("--scrape-s", type=float, help="scrape period in seconds, with --load-signal scrape")
    _slowdown(p)
    p.add_argument("--pd", action="store_true", default=None, help="PD disaggregation (prefill-only instances)")
    p.add_argument("--rate", type=float, help="session arrivals per second, the offered load")
    p.add_argument("--rates", help="comma list of offered loads for sweeps (5 around --rate when not given)")
    p.add_argument("--arrival", choices=("closed", "open"), help="closed: next request after the previous one's "
                   "completion and think time; open: at the recorded offsets")
    p.add_argument("--sweep", action="append", choices=KNOBS, help="sweep a knob (repeatable)")
    p.add_argument("--values", help="comma list of knob values for a single --sweep")
    p.add_argument("--out", help="folder for the plots, report.md and summaries.json")
    p.add_argument("--json", action="store_true", help="also print the summaries as one JSON line")
    _common(p)


@dataclass(frozen=True)
class ExtraAction:
    """A ``smetric sim`` subcommand that a package above the simulator provides (the replay
    package's calibrate and validate), handed in so that the simulator does not import it."""

    name: str
    text: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _sub(sub: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text)  # type: ignore[no-any-return]


def add_arguments(p: argparse.ArgumentParser, extra: Sequence[ExtraAction] = ()) -> None:
    """``smetric sim`` and its subcommands; with no subcommand, ``sim`` is ``sim run``."""
    _run_arguments(p)
    names = ["run", "report", "map", *(a.name for a in extra), "paper"]
    sub = p.add_subparsers(dest="action", metavar="{" + ",".join(names) + "}")
    _run_arguments(_sub(sub, "run", "Replay a workload on a simulated cluster and compare the routing policies "
                                    "(what plain smetric sim does)."))
    r = _sub(sub, "report", "Regenerate the results document (--out; docs/results.md in a checkout): every policy "
                            "over an offered-load sweep on the WEKA trace and the trace1 preset, with and without a "
                            "global tier and under PD, plus the regime map.")
    r.add_argument("--quick", action="store_true", help="the same pipeline on reduced sizes")
    r.add_argument("--rebuild", action="store_true", help="rewrite the document from the last run's saved results")
    r.add_argument("--trace", help="the WEKA trace (SMETRIC_SHARED/traces/weka-claude-code.tar.xz when not given)")
    r.add_argument("--shared-prefix", action="store_true", help="WEKA: shared system-prompt ids across sessions")
    r.add_argument("--out", metavar="FILE", help="the document to write, required (docs/results.md in a checkout; "
                   "the regime map's PNG goes to img/ beside it)")
    _common(r)
    m = _sub(sub, "map", "The regime map: SMetric and the variant vs the best baseline over context length x "
                         "global-tier provisioning.")
    m.add_argument("--quick", action="store_true", help="reduced sizes")
    m.add_argument("--preset", choices=("weka", "trace1"), help="synthetic workload preset (trace1 when not given)")
    m.add_argument("--xs", help="comma list of mean context / KV capacity columns")
    m.add_argument("--tiers", help="comma list of global tiers (none, 0.4, 1.6, full, ...)")
    m.add_argument("--instances", type=int, help="instances per cell")
    m.add_argument("--fetch-axis", help="map per-request retrieve throughput (comma list of GB/s, 'line' for line "
                   "rate) x the --tiers instead of context length x tier, e.g. 0.5,1.1,3.2,6.64,line")
    m.add_argument("--out", help="folder for map.md and regime_map.png")
    _common(m)
    for a in extra:
        a.arguments(_sub(sub, a.name, a.text))
    pp = _sub(sub, "paper", "The SMetric paper's section 4.1 and 5 setup, baselines tuned on a held-out seed; "
                            "writes the document --out names (docs/paper.md in a checkout), one row per published "
                            "quantity, and one JSON line.")
    pp.add_argument("--quick", action="store_true", help="8 instances and smaller grids instead of 32")
    pp.add_argument("--out", metavar="FILE", help="the document to write, required (docs/paper.md in a checkout)")
    pp.add_argument("--fetch-path", help="the global tier's retrieve path (lmcache-mooncake-rdma when not given)")
    _slowdown(pp)
    _common(pp, seed=False)  # its seeds are fixed: tuned on seed 1, judged on seed 0


def add_subcommands(subparsers: argparse._SubParsersAction, extra: Sequence[ExtraAction] = ()) -> None:
    """Add ``sim`` under ``subparsers``; ``extra`` subcommands come from packages above the simulator."""
    p = subparsers.add_parser("sim", help="trace-driven cluster simulator (policy comparison, sweeps, reports)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(p, extra)
    p.set_defaults(func=main_args, extra_actions={a.name: a.run for a in extra})


def load_workload(args: argparse.Namespace) -> Workload:
    if args.trace:
        from smetric_lmc.lab.workload import load_any

        return load_any(args.trace, shared_prefix=args.shared_prefix)
    from smetric_lmc.lab.workload.presets import preset_workload

    return preset_workload(args.preset or "weka", args.sessions or DEFAULT_SYNTH_SESSIONS, seed=args.seed or 0,
                           scale=args.scale or 1.0)  # fmt: skip


def base_config(args: argparse.Namespace) -> SimConfig:
    synth = not args.trace
    return load_sim_config(
        args.config,
        profile=args.profile,
        instances=args.instances or (DEFAULT_SYNTH_INSTANCES if synth else None),
        rate=args.rate or (DEFAULT_SYNTH_RATE if synth else None),
        global_tier=args.global_tier,
        fetch_path=args.fetch_path,
        fetch_gbs=args.fetch_gbs,
        load_signal=args.load_signal,
        scrape_s=args.scrape_s,
        slowdown_cv=args.slowdown_cv,
        slowdown_period_s=args.slowdown_period_s,
        pd=args.pd,
        arrival=args.arrival,
        seed=args.seed,
        max_sessions=args.sessions if args.trace else None,
    )


def summaries_json(results: dict[str, SimResult]) -> str:
    return json.dumps({p: r.summary for p, r in results.items()}, default=float)


def main_args(args: argparse.Namespace) -> int:
    if args.action in (None, "run"):
        args.action = "run"
    if args.action == "report":
        from smetric_lmc.lab.sim.results_doc import main_report

        return main_report(args)
    if args.action == "paper":
        from smetric_lmc.lab.sim.paper import main_paper

        return main_paper(args)
    if args.action == "map":
        from smetric_lmc.lab.sim.map_cli import main_map

        return main_map(args)
    handler = getattr(args, "extra_actions", {}).get(args.action)
    if handler is not None:
        return handler(args)
    try:
        cfg = base_config(args)
        prof = load_profile(args.profile or cfg.profile)
    except (ValueError, OSError) as e:
        raise SystemExit(f"smetric sim: {e}") from None
    wl = load_workload(args)
    pols = _policies(args.policies)
    print(f"workload {wl.name}: {wl.n_requests} requests in {len(wl.sessions)} sessions; "
          f"{cfg.instances} instances ({prof.name}), {cfg.rate:g} sessions/s, global tier {cfg.global_tier}, "
          f"{'PD disaggregation' if cfg.pd else 'PD colocation'}")  # fmt: skip
    t0 = time.perf_counter()
    sweeps: list[SweepResult] = []
    rates = _floats(args.rates) or (rates_around(cfg.rate) if args.sweep else [cfg.rate])
    for knob in args.sweep or []:
        values = _floats(args.values) if knob != "global" else (args.values.split(",") if args.values else None)
        sweeps.append(sweep(wl, knob, cfg, pols, rates, values, prof, args.jobs))
    if sweeps and sweeps[0].knob == "load":
        from smetric_lmc.lab.sim.report import best_per_policy

        results = best_per_policy(sweeps[0])
    else:
        points = [Point("policy", p, cfg, PolicyConfig(name=p)) for p in pols]  # type: ignore[arg-type]
        res = run_points(wl, points, prof, args.jobs, desc="policies")
        results = dict(zip(pols, res))
    print()
    print(slo_line(cfg))
    print(comparison_table(results))
    print(reasons_table(results))
    if sweeps:
        print(sweep_section(sweeps))
    print(headline(results))
    print(f"({time.perf_counter() - t0:.0f} s)")
    _write_out(Path(args.out) if args.out else default_out_dir(), wl, cfg, results, sweeps)
    if args.json:
        print(summaries_json(results))
    return 0


def _write_out(out: Path, wl: Workload, cfg: SimConfig, results: dict[str, SimResult], sweeps: list[SweepResult]) -> None:
    from smetric_lmc.lab.sim.plots import all_plots

    out.mkdir(parents=True, exist_ok=True)
    pngs = all_plots(results, sweeps, out, cfg.window_s, cfg.pd)
    md: list[str] = [
        f"# Simulation report: {wl.name}\n",
        f"{wl.n_requests} requests, {len(wl.sessions)} sessions; {cfg.instances} instances, profile {cfg.profile}, "
        f"{cfg.rate:g} sessions/s, global tier {cfg.global_tier}, {'PD disaggregation' if cfg.pd else 'PD colocation'}, "
        f"{slo_line(cfg)}.\n",
        "## Policies\n",
        comparison_table(results),
        headline(results).replace("\n", "  \n") + "\n",
        "## Route reasons\n",
        reasons_table(results),
    ]
    if sweeps:
        md += ["## Sweeps\n", sweep_section(sweeps)]
    md += ["## Plots\n"] + [f"![{p.stem}]({p.name})\n" for p in pngs]
    (out / "report.md").write_text("\n".join(md))
    (out / "summaries.json").write_text(summaries_json(results))
    print(f"results: {out / 'report.md'}, {out / 'summaries.json'} and {len(pngs)} plots in {out}/")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="smetric sim", description=__doc__)
    add_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return main_args(args)


if __name__ == "__main__":
    sys.exit(main())
