"""``smetric sim map``: run the regime map alone and write its table, paragraphs and heatmap PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.sim.regime_map import MapSpec, heatmap_png, map_markdown, run_map
from smetric_lmc.lab.sim.results_doc import VARIANT

QUICK = dict(xs=(0.02, 0.05, 0.15, 0.3, 0.6), instances=4, pool_roots=200, window_s=600.0, rate_factors=(1.0, 1.5),
             pilots=2)  # fmt: skip


def main_fetch_map(args: argparse.Namespace) -> int:
    """The fetch axis: per-request retrieve throughput x global tier (``--fetch-axis``)."""
    from smetric_lmc.lab.sim.fetch_map import (
        FetchMapSpec,
        fetch_map_markdown,
        parse_axis,
        run_fetch_map,
        variant_min,
    )

    try:
        kw: dict[str, object] = {"gbs": parse_axis(args.fetch_axis)}
        if args.tiers:
            kw["tiers"] = tuple(t.strip() for t in args.tiers.split(","))
        if args.instances:
            kw["instances"] = args.instances
        if args.quick:
            kw.update(instances=args.instances or 4, roots=150, window_s=400.0, seeds=(0,))
        spec = FetchMapSpec(**kw)  # type: ignore[arg-type]
        prof = load_profile(args.profile or "qwen3-30b-a3b-h20")
        base = load_sim_config(args.config, profile=args.profile, seed=args.seed)
    except (ValueError, OSError) as e:
        raise SystemExit(f"smetric sim map: {e}") from None
    m = run_fetch_map(spec, base, prof, args.jobs)
    out = Path(args.out or "out/map")
    out.mkdir(parents=True, exist_ok=True)
    md = "# Regime map: the fetch axis\n\n" + fetch_map_markdown(m)
    (out / "fetch_map.md").write_text(md)
    print(md)
    print(f"wrote {out / 'fetch_map.md'}")
    print(json.dumps({"variant_vs_best_min_over_fetch_axis": round(variant_min(m), 4)}))
    return 0


def main_map(args: argparse.Namespace) -> int:
    if getattr(args, "fetch_axis", None):
        return main_fetch_map(args)
    kw = dict(QUICK) if args.quick else {}
    if args.instances:
        kw["instances"] = args.instances
    if args.xs:
        kw["xs"] = tuple(float(x) for x in args.xs.split(","))
    if args.tiers:
        kw["tiers"] = tuple(t.strip() for t in args.tiers.split(","))
    spec = MapSpec(preset=args.preset or "trace1", variant=VARIANT, seed=args.seed or 0, **kw)  # type: ignore[arg-type]
    prof = load_profile(args.profile or "qwen3-30b-a3b-h20")
    m = run_map(spec, load_sim_config(args.config, profile=args.profile), prof, args.jobs)
    out = Path(args.out or "out/map")
    out.mkdir(parents=True, exist_ok=True)
    png = heatmap_png(m, out / "regime_map.png")
    md = "# Regime map\n\n" + map_markdown(m, png.name)
    (out / "map.md").write_text(md)
    print(md)
    print(f"wrote {out / 'map.md'} and {png}")
    bl = list(spec.baselines)
    print(json.dumps({
        "smetric_vs_best_min": round(min(m.ratios("smetric", bl)), 4),
        "smetric_vs_best_max": round(max(m.ratios("smetric", bl)), 4),
        "variant_vs_best_min": round(min(m.ratios(VARIANT, bl)), 4),
    }))  # fmt: skip
    return 0
