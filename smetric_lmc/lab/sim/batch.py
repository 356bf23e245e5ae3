"""Run many simulations over several workloads in worker processes, behind one progress bar.

The regime map and the results document run hundreds of (workload, config, policy) points. Workers
are forked once with every workload already loaded (copy-on-write); a task names its workload by
key. Each result's summary also carries the two numbers a peak row must show: the GPU busy share
and the requests per minute per instance, both over the measured (session-arrival) window.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.cluster import Simulator
from smetric_lmc.lab.sim.config import SimConfig
from smetric_lmc.lab.sim.metrics import SimResult
from smetric_lmc.lab.sim.profile import Profile, load_profile
from smetric_lmc.lab.workload.model import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    workload: str  # key into the workloads mapping
    cfg: SimConfig
    policy: PolicyConfig
    profile: Profile | None = None  # None: the config's profile


_WORKLOADS: Mapping[str, Workload] = {}


def _init(workloads: Mapping[str, Workload]) -> None:
    global _WORKLOADS
    _WORKLOADS = workloads
    # A run whose index state runs away (a cycle in the prefix tree, seen with smetric_ect) would take
    # the machine's memory and the OOM killer the whole pool: cap each worker so it fails alone.
    gb = float(os.environ.get("SMETRIC_SIM_WORKER_GB", "6"))
    if gb > 0 and os.name == "posix":
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (int(gb * 1024**3), int(gb * 1024**3)))


def run_task(task: Task, workloads: Mapping[str, Workload] | None = None) -> SimResult:
    """One simulation; the summary gains gpu_busy_share and req_per_min_per_instance when the engine lacks them."""
    wl = (workloads or _WORKLOADS)[task.workload]
    sim = Simulator(wl, task.cfg, task.policy, task.profile or load_profile(task.cfg.profile))
    try:
        res = sim.run()
    except MemoryError:
        del sim
        log.error("run failed: out of memory (policy %s, workload %s, rate %g): scored 0 and marked failed",
                  task.policy.name, task.workload, task.cfg.rate)  # fmt: skip
        empty = np.empty(0)
        summary = {"pd": task.cfg.pd, "tps_slo": 0.0, "prefill_tps_slo": 0.0, "failed": "MemoryError",
                   "gpu_busy_share": 0.0, "hit_local": 0.0, "hit_global": 0.0, "hit_miss": 0.0, "by_reason": {}}  # fmt: skip
        return SimResult(task.policy.name, summary, empty, empty, np.empty((0, 0)))
    s = res.summary
    n = task.cfg.instances
    w0, w1 = sim.measure_from, sim.last_root_start
    cols = res.cols
    if w1 <= w0 and len(cols.get("finish", ())):
        w0, w1 = float(np.min(cols["arrival"])), float(np.nanmax(cols["finish"]))
    span = max(w1 - w0, 1e-9)
    if "req_per_min_per_instance" not in s:
        fin = cols.get("finish", np.empty(0))
        done = int(np.count_nonzero((fin >= w0) & (fin <= w1))) if len(fin) else 0
        s["req_per_min_per_instance"] = done / (span / 60.0) / n
    if "by_reason" not in s and len(cols.get("input", ())):
        s["by_reason"] = decision_breakdown(cols, sim.rec.reasons)
    if "gpu_busy_share" not in s:
        # whole-run busy time over the whole run: a lower bound of the busy share under sustained load
        dur = max(float(s.get("duration_s", span)), 1e-9)
        s["gpu_busy_share"] = min(1.0, sum(i.busy_time for i in sim.instances) / (n * dur))
    res.cols = {}
    return res


def decision_breakdown(cols: Mapping[str, np.ndarray], reasons: Sequence[str]) -> dict[str, dict[str, float]]:
    """The decision trace summed per route reason: share of requests, and per request the prompt
    tokens served locally, fetched from the global tier and recomputed, and the mean TTFT."""
    rs = np.asarray(reasons)
    served = ~cols["rejected"].astype(bool)
    inp = cols["input"].astype(np.float64)
    loc = cols["local_tokens"].astype(np.float64)
    glo = cols["global_tokens"].astype(np.float64)
    ttft = cols["first_token"] - cols["arrival"]
    out: dict[str, dict[str, float]] = {}
    n = max(1, int(served.sum()))
    for reason in sorted(set(rs[served].tolist())):
        m = served & (rs == reason)
        k = int(m.sum())
        out[reason] = {
            "share": k / n,
            "input": float(inp[m].mean()),
            "local": float(loc[m].mean()),
            "global": float(glo[m].mean()),
            "recomputed": float((inp[m] - loc[m] - glo[m]).mean()),
            "ttft": float(np.nanmean(ttft[m])),
        }
    return out


def run_tasks(
    workloads: Mapping[str, Workload], tasks: Sequence[Task], jobs: int = 1, desc: str = "sim"
) -> list[SimResult]:
    """Every task, in order, in ``jobs`` worker processes."""
    out: list[SimResult] = []
    bar = tqdm(total=len(tasks), desc=desc, unit="run", disable=not tasks)
    if jobs <= 1 or len(tasks) <= 1:
        for t in tasks:
            out.append(run_task(t, workloads))
            bar.set_postfix_str(f"{t.policy.name} {t.workload}")
            bar.update(1)
    else:
        import multiprocessing as mp

        ctx = mp.get_context("fork") if os.name == "posix" else None
        with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init, initargs=(workloads,)) as ex:
            for res in ex.map(run_task, tasks, chunksize=1):
                out.append(res)
                bar.update(1)
    bar.close()
    return out
