"""``smetric sim``: run the trace-driven cluster simulator.

``smetric sim`` alone replays the built-in synthetic agentic workload on a small cluster and prints
the policy comparison. ``smetric sim report`` writes the WEKA results document (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from smetric_lmc.config import POLICY_NAMES, PolicyConfig
from smetric_lmc.sim.config import GLOBAL_CHOICES, SimConfig, load_sim_config
from smetric_lmc.sim.metrics import SimResult
from smetric_lmc.sim.profile import load_profile
from smetric_lmc.sim.report import (
    comparison_table,
    default_out_dir,
    headline,
    reasons_table,
    slo_line,
    sweep_section,
)
from smetric_lmc.sim.sweep import KNOBS, Point, SweepResult, rates_around, run_points, sweep
from smetric_lmc.workload.model import Workload

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=("run", "report", "map", "calibrate", "validate"), default="run",
                   help="run (default); report: regenerate docs/results.md; map: the regime map; calibrate: "
                        "profile a running engine; validate: simulator vs real vLLM CPU engines")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="report/map: the same pipeline on reduced sizes")
    p.add_argument("--rebuild", action="store_true", help="report: rewrite the document from the last run's saved results")
    p.add_argument("--preset", choices=("weka", "trace1"), help="synthetic workload preset (default weka)")
    p.add_argument("--scale", type=float, help="synthetic: context-length scale of the preset")
    p.add_argument("--xs", help="map: comma list of mean context / KV capacity columns")
    p.add_argument("--tiers", help="map: comma list of global tiers (none, 0.4, 1.6, full, ...)")
    p.add_argument("--trace", help="trace file/folder/archive (WEKA, Bailian, Mooncake, native); default: synthetic")
    p.add_argument("--shared-prefix", action="store_true",
                   help="WEKA: map each session's system prompt + tools to ids shared across sessions")  # fmt: skip
    p.add_argument("--sessions", type=int, help="replay only N root sessions (synthetic: generate N)")
    p.add_argument("--instances", type=int)
    p.add_argument("--policies", help=f"comma list (default: all of {','.join(POLICY_NAMES)})")
    p.add_argument("--global", dest="global_tier", choices=GLOBAL_CHOICES, help="global tier provisioning")
    p.add_argument("--pd", action="store_true", default=None, help="PD disaggregation (prefill-only instances)")
    p.add_argument("--rate", type=float, help="session arrivals per second (offered load)")
    p.add_argument("--rates", help="comma list of offered loads for sweeps (default: 5 around --rate)")
    p.add_argument("--arrival", choices=("closed", "open"))
    p.add_argument("--sweep", action="append", choices=KNOBS, help="sweep a knob (repeatable)")
    p.add_argument("--values", help="comma list of knob values for a single --sweep")
    p.add_argument("--profile", help="profile name (configs/profiles) or YAML path")
    p.add_argument("--config", help="sim defaults YAML (default: configs/sim.yaml)")
    p.add_argument("--out", help="folder for plots + report.md (run); results file (report)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes for sweeps")
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="also print the summaries as one JSON line")
    from smetric_lmc.replay.cli import add_calibration_arguments

    add_calibration_arguments(p)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim", help="trace-driven cluster simulator (policy comparison, sweeps, reports)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(p)
    p.set_defaults(func=main_args)


def load_workload(args: argparse.Namespace) -> Workload:
    if args.trace:
        from smetric_lmc.workload import load_any

        return load_any(args.trace, shared_prefix=args.shared_prefix)
    from smetric_lmc.workload.presets import preset_workload

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
        pd=args.pd,
        arrival=args.arrival,
        seed=args.seed,
        max_sessions=args.sessions if args.trace else None,
    )


def summaries_json(results: dict[str, SimResult]) -> str:
    return json.dumps({p: r.summary for p, r in results.items()}, default=float)


def main_args(args: argparse.Namespace) -> int:
    if args.action == "report":
        from smetric_lmc.sim.results_doc import main_report

        return main_report(args)
    if args.action == "map":
        from smetric_lmc.sim.map_cli import main_map

        return main_map(args)
    if args.action in ("calibrate", "validate"):
        from smetric_lmc.replay.cli import run_calibration_action

        return run_calibration_action(args)
    wl = load_workload(args)
    cfg = base_config(args)
    prof = load_profile(args.profile or cfg.profile)
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
        from smetric_lmc.sim.report import best_per_policy

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
    from smetric_lmc.sim.plots import all_plots

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
