"""What each part of the real-engine model contributes, recomputed from a validation's outputs.

    python bench/validate_ablation.py WORKDIR/real     # the folder `smetric sim validate --out` wrote

For every policy, the live replay (its records) against four simulations of the same workload:
  idle          the idle-engine profile, no request path (the validation before this model)
  + idle path   the idle profile, the request path measured with tiny requests one at a time
  + slowdown    the profile slowed as the calibration replay measured, the idle path
  fitted        slowdown and the request path under load, both from the calibration replay (what
                `smetric sim validate` reports)
  fitted, KV unbounded   the same with a KV cache no request evicts from: what the engines' small
                KV capacity (``--num-gpu-blocks-override``) adds to the policies' differences
  common profile         the first policy's fitted profile and path for every policy: the policies'
                differences without the load drifting between their calibration replays
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

from smetric_lmc.replay.compare import with_kv_tokens
from smetric_lmc.replay.runner import Record
from smetric_lmc.replay.summary import summarize_records
from smetric_lmc.replay.validate import run_tps, simulate_like, small_workload, validate_real, with_turnaround
from smetric_lmc.sim.profile import load_profile


def main(work: Path) -> None:
    rows = json.loads((work / "validation.json").read_text())
    idle = load_profile(work / "calibrated.yaml")
    d = {k: v.default for k, v in inspect.signature(validate_real).parameters.items()}
    wl = small_workload(d["sessions"], d["turns"], d["context_scale"], d["output_scale"], d["seed"])
    first = rows[0]
    common = load_profile(work / f"calibrated-under-load-{first['policy']}.yaml")
    print("| policy | model | tok/s sim | live | err | TTFT p50 sim (s) | live | err | local hit sim | live |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pol = r["policy"]
        live = summarize_records([Record(**json.loads(x)) for x in (work / f"{pol}.jsonl").open()], policy=pol)
        loaded = load_profile(work / f"calibrated-under-load-{pol}.yaml")
        post = r["path_post_s"]
        for name, prof, pre in (("idle", idle, None), ("+ idle path", idle, r["idle_path_pre_s"]),
                                ("+ slowdown", loaded, r["idle_path_pre_s"]), ("fitted", loaded, r["path_pre_s"]),
                                ("fitted, KV unbounded", with_kv_tokens(loaded, 1 << 24), r["path_pre_s"]),
                                ("common profile", common, first["path_pre_s"])):
            turn = 0.0 if pre is None else pre + post
            sim = simulate_like(with_turnaround(wl, turn, 0.0), prof, pol, 2, d["rate"], d["seed"], 1e9)
            tps = run_tps(sim, 0.0 if pre is None else post)
            ttft = sim.summary["ttft_p50"] + (pre or 0.0)
            lt, lf = run_tps(live), live.summary["ttft_p50"]
            print(f"| {pol} | {name} | {tps:.0f} | {lt:.0f} | {tps / lt - 1:+.0%} | {ttft:.3f} | {lf:.3f} | "
                  f"{ttft / lf - 1:+.0%} | {sim.summary['hit_local']:.3f} | {live.summary['hit_local']:.3f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
