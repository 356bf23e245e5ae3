"""Live vs simulated: one workload through mock engines + controller + gateway, and through the
simulator with the same profile, policy, session placement and think times.

The mock engines run the simulator's engine model ``speed`` times faster than wall time, so the
replay starts sessions ``speed`` times faster and scales think times by ``1/speed``; live times
are multiplied back by ``speed`` before they are compared. What remains different is what the live
system adds: KV events and done reports travel asynchronously, the controller reconciles load from
engine ``/metrics``, the event loop adds jitter, and engines hit whole blocks of their own size.
"""

from __future__ import annotations

import argparse
import json
import logging
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from smetric_lmc.lab.replay.runner import Record, ReplayConfig, replay
from smetric_lmc.lab.replay.summary import summarize_records
from smetric_lmc.lab.sim.cluster import simulate
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.metrics import SimResult
from smetric_lmc.lab.sim.profile import GIB, Profile
from smetric_lmc.lab.workload.model import Workload

log = logging.getLogger(__name__)


def with_kv_tokens(profile: Profile, tokens: int) -> Profile:
    """The profile with GPU memory sized so its KV cache holds about ``tokens`` tokens."""
    weights = profile.total_params * profile.bytes_per_param
    usable = weights + tokens * profile.kv_bytes_per_token
    hbm = (usable / (profile.tp * GIB) + profile.reserve_gib) / profile.gpu_memory_utilization
    return profile.with_overrides(name=f"{profile.name}-kv{tokens}", hbm_gib=hbm, local_cpu_gib=0.0)


def write_profile(profile: Profile, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(asdict(profile), sort_keys=False))
    return path


def reason_shares(summary: dict[str, Any]) -> dict[str, float]:
    reasons = summary.get("reasons", {})
    total = max(1, sum(reasons.values()))
    return {k: v / total for k, v in reasons.items()}


@dataclass
class Comparison:
    policy: str
    live: SimResult
    sim: SimResult
    speed: float

    @property
    def hit_abs_err(self) -> float:
        return abs(self.live.summary["hit_local"] - self.sim.summary["hit_local"])

    @property
    def reason_abs_err(self) -> float:
        a, b = reason_shares(self.live.summary), reason_shares(self.sim.summary)
        return max((abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b)), default=0.0)

    def row(self) -> dict[str, Any]:
        ls, ss = self.live.summary, self.sim.summary
        return {
            "policy": self.policy,
            "hit_live": ls["hit_local"], "hit_sim": ss["hit_local"],
            "sticky_live": ls["stickiness"], "sticky_sim": ss["stickiness"],
            "ttft_p50_live": ls["ttft_p50"] * self.speed, "ttft_p50_sim": ss["ttft_p50"],
            "reasons_live": reason_shares(ls), "reasons_sim": reason_shares(ss),
            "hit_abs_err": self.hit_abs_err, "reason_abs_err": self.reason_abs_err,
        }  # fmt: skip


def simulate_like(wl: Workload, profile: Profile, policy: str, instances: int, rate: float, seed: int,
                  max_think_s: float) -> SimResult:
    cfg = load_sim_config(None, instances=instances, rate=rate, seed=seed, max_think_s=max_think_s,
                          arrival="closed", global_tier="none", pd=False)
    return simulate(wl, cfg, policy, profile)


def simulate_per_instance(wl: Workload, profiles: list[Profile], policy: str, rate: float, seed: int,
                          max_think_s: float) -> SimResult:
    """``simulate_like`` with one profile per instance (instance k: ``profiles[k]``). Only for profiles
    that differ in speed, not capacity (``under_load.slowed``): the cluster is built from the first."""
    from smetric_lmc.config import PolicyConfig
    from smetric_lmc.lab.sim.cluster import Simulator

    if any(p.gpu_capacity_blocks(wl.block_size) != profiles[0].gpu_capacity_blocks(wl.block_size) for p in profiles):
        raise ValueError("per-instance profiles must hold the same KV capacity")
    cfg = load_sim_config(None, instances=len(profiles), rate=rate, seed=seed, max_think_s=max_think_s,
                          arrival="closed", global_tier="none", pd=False)
    sim = Simulator(wl, cfg, PolicyConfig(name=policy), profiles[0])  # type: ignore[arg-type]
    for inst, prof in zip(sim.instances, profiles, strict=True):
        inst.profile = prof
    return sim.run()


def warm_up(gateway_url: str, route_url: str) -> None:
    """One tiny request so the controller's index is ready (it routes load-only before that)."""
    from smetric_lmc.client import RouteClient

    body = json.dumps({"model": "tiny", "prompt": [3] * 1024, "max_tokens": 1}).encode()
    req = urllib.request.Request(f"{gateway_url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
    import time

    with RouteClient(route_url) as c:
        deadline = time.monotonic() + 30
        while not c.health().index_ready:
            if time.monotonic() > deadline:
                raise RuntimeError("controller index not ready after a warm-up request")
            time.sleep(0.1)


def run_live(wl: Workload, profile_path: Path, policy: str, instances: int, rate: float, seed: int,
             max_think_s: float, speed: float, workdir: Path, processes: int = 1,
             progress: Any = None, after: Callable[[Any], None] | None = None) -> list[Record]:
    """The workload through ``instances`` mock engines, the controller and the gateway."""
    from smetric_lmc.lab.mock_engine.stack import bring_up_mock

    args = argparse.Namespace(
        mock=instances, mock_processes=processes, host="127.0.0.1", port=0, policy=policy,
        mock_args=f"--speed {speed:g} --profile {profile_path} --block-size {wl.block_size}")
    workdir.mkdir(parents=True, exist_ok=True)
    # A comparison of routing decisions wants every request routed by the controller: on a loaded
    # small machine a 1 s route timeout would turn some into the gateway's round-robin fallback.
    stack = bring_up_mock(args, workdir, route_timeout_s=5.0)
    try:
        route_url = yaml.safe_load(stack.config_path.read_text())["server"]["route_url"]
        warm_up(stack.gateway_url, route_url)
        cfg = ReplayConfig(url=stack.gateway_url, rate=rate * speed, time_scale=1.0 / speed, max_think_s=max_think_s,
                           seed=seed, records=workdir / "records.jsonl")
        records = replay(wl, cfg, progress)
        if after is not None:
            after(stack)
        return records
    finally:
        stack.stop()


def compare(wl: Workload, profile: Profile, policies: list[str], *, instances: int, rate: float, seed: int = 0,
            max_think_s: float = 600.0, speed: float = 20.0, workdir: Path, processes: int = 1,
            after: Callable[[Any], None] | None = None) -> list[Comparison]:
    """Each policy live (a fresh stack each) and simulated; ``after(stack)`` runs on the first live
    stack once its replay is done (e.g. a throughput probe)."""
    path = write_profile(profile, workdir / "profile.yaml")
    out = []
    for pol in policies:
        records = run_live(wl, path, pol, instances, rate, seed, max_think_s, speed, workdir / pol, processes,
                           after=after if pol == policies[0] else None)
        live = summarize_records(records, policy=pol)
        failed = live.summary["failed"]
        if failed:
            log.warning("live %s: %d requests failed (see %s)", pol, failed, workdir / pol / "records.jsonl")
        sim = simulate_like(wl, profile, pol, instances, rate, seed, max_think_s)
        out.append(Comparison(pol, live, sim, speed))
    return out


def comparison_table(rows: list[Comparison]) -> str:
    head = ["policy", "local hit live", "sim", "sticky live", "sim", "TTFT p50 live (model s)", "sim", "reason mix max err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in rows:
        r = c.row()
        lines.append(f"| {c.policy} | {r['hit_live']:.3f} | {r['hit_sim']:.3f} | {r['sticky_live']:.3f} | "
                     f"{r['sticky_sim']:.3f} | {r['ttft_p50_live']:.2f} | {r['ttft_p50_sim']:.2f} | "
                     f"{r['reason_abs_err']:.3f} |")
    return "\n".join(lines) + "\n"


def reasons_side_by_side(rows: list[Comparison]) -> str:
    keys = sorted({k for c in rows for k in (*reason_shares(c.live.summary), *reason_shares(c.sim.summary))})
    lines = ["| policy | run | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
    for c in rows:
        for name, res in (("live", c.live), ("sim", c.sim)):
            sh = reason_shares(res.summary)
            lines.append(f"| {c.policy} | {name} | " + " | ".join(f"{sh.get(k, 0.0):.1%}" for k in keys) + " |")
    return "\n".join(lines) + "\n"


