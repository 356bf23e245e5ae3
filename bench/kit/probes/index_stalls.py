"""How long each index call the controller makes on its event loop takes at 10 M indexed blocks.

    python bench/controller.py --probe index_stalls                    # 10 M blocks over 64 instances
    python bench/controller.py --probe index_stalls --blocks 1000000   # a quicker run

The controller runs on one event loop, so any single call lasting longer than the stall target
(50 ms) freezes routing and event ingest for everyone. This builds a ``TierIndex`` holding
``--blocks`` GPU blocks (a shared system prompt, then per-session chains spread over
``--instances``; one instance holds ``--big-share`` of all blocks), and times, a few times each,
the calls whose work grows with the index: ``AllBlocksCleared`` on the largest instance
(``gpu_cleared``), marking it stale (``mark_stale``, a silent instance), a sweep slice
(``maintain``, and every slice until a cleared instance's rows are all freed), the periodic
snapshot's fork (``snapshot.fork_write``: the child's export and write are timed apart), ``sizes()`` and the per-instance counts behind the ``instances`` reply, a lookup of
the longest prompt the limits allow (4 M tokens = 262,144 blocks), and the route core's
``stats`` and ``instances`` answers.

Prints each call's worst time, then ONE JSON line ``{"blocks": ..., "max_ms": {call: ms}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm import tqdm

from smetric_lmc.config import InstanceConfig, PolicyConfig
from smetric_lmc.controller.service import RouteCore
from smetric_lmc.hashing import HashSettings
from smetric_lmc.index import TierIndex, snapshot
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router

BS = 16


def build(blocks: int, instances: int, big_share: float, session_blocks: int, seed: int) -> TierIndex:
    rng = np.random.default_rng(seed)
    ix = TierIndex(BS, 256)
    ids = [f"i{k:03d}" for k in range(instances)]
    shared = rng.integers(1, 2**63, 64, dtype=np.int64).tolist()
    for iid in ids:
        ix.register_instance(iid)
        ix.gpu_stored_hashes(iid, shared)
    left = blocks - 64
    big = int(left * big_share)
    with tqdm(total=left, desc="indexing blocks", file=sys.stderr, mininterval=2.0) as bar:
        k = 0
        while left > 0:
            n = min(session_blocks, left)
            owner = ids[0] if big > 0 else ids[1 + k % (instances - 1)]
            chain = rng.integers(1, 2**63, n, dtype=np.int64).tolist()
            ix.gpu_stored_hashes(owner, chain, shared[-1])
            if owner == ids[0]:
                big -= n
            left -= n
            k += 1
            bar.update(n)
    return ix


def timed(name: str, fn: Callable[[], Any], out: dict[str, float], repeat: int = 3) -> None:
    worst = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        worst = max(worst, time.perf_counter() - t0)
    out[name] = round(worst * 1000, 2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=10_000_000)
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--big-share", type=float, default=0.1, help="share of all blocks on the largest instance")
    p.add_argument("--session-blocks", type=int, default=2_000)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    ix = build(args.blocks, args.instances, args.big_share, args.session_blocks, args.seed)
    build_s = time.perf_counter() - t0
    ids = list(ix.instances)
    load = LoadTracker()
    insts = [InstanceConfig(id=i, http="http://127.0.0.1:9") for i in ids]
    hs = HashSettings(block_size=BS, fast_root=ix.fast_root)
    core = RouteCore(ix, load, Router(ix, load, PolicyConfig()), insts, hs)
    long_chain = np.random.default_rng(2).integers(1, 2**63, (1 << 22) // BS, dtype=np.int64).tolist()
    out: dict[str, float] = {}
    timed("lookup_262144_blocks", lambda: ix.lookup(long_chain), out)
    timed("sizes", ix.sizes, out)
    timed("route_core_stats", core.stats, out)
    timed("route_core_instances", core.instance_infos, out)
    timed("maintain_slice", ix.maintain, out)
    # The periodic snapshot (controller/app.py write_snapshot): the loop pays for the fork; the
    # child exports, encodes and writes while the loop runs on.
    with tempfile.TemporaryDirectory() as tmp:
        jobs: list[snapshot.ForkedWrite] = []
        timed("snapshot_fork", lambda: jobs.append(snapshot.fork_write(f"{tmp}/snap", ix, {i: (0, None) for i in ids})),
              out, repeat=1)
        t0 = time.perf_counter()
        snap_bytes = jobs[0].wait()
        child_s = time.perf_counter() - t0
    big = ids[0]
    blocks_big = ix.gpu_blocks_of(big)
    timed("mark_stale_largest", lambda: ix.mark_stale(big), out, repeat=1)
    timed("gpu_cleared_largest", lambda: ix.gpu_cleared(big), out, repeat=1)
    timed("maintain_slice_after_clear", ix.maintain, out)
    slices, worst, worst_cpu, t_all = 0, 0.0, 0.0, time.perf_counter()
    while ix.needs_maintenance:  # every slice until the cleared rows are all freed
        t0, c0 = time.perf_counter(), time.thread_time()
        ix.maintain()
        worst = max(worst, time.perf_counter() - t0)
        worst_cpu = max(worst_cpu, time.thread_time() - c0)
        slices += 1
    out["maintain_every_slice"] = round(worst * 1000, 2)
    # Wall above; CPU here (on a shared machine the worst of ~2,000 slices is often preemption).
    sweep = {"slices": slices, "total_s": round(time.perf_counter() - t_all, 2),
             "worst_slice_cpu_ms": round(worst_cpu * 1000, 2)}
    timed("gpu_cleared_small", lambda: ix.gpu_cleared(ids[5]), out, repeat=1)
    for k, v in out.items():
        print(f"{k}: {v} ms", file=sys.stderr)
    print(json.dumps({"blocks": args.blocks, "instances": args.instances, "largest_instance_blocks": blocks_big,
                      "build_s": round(build_s, 1), "snapshot_child_s": round(child_s, 2), "snapshot_bytes": snap_bytes,
                      "sweep_after_clear": sweep, "max_ms": out}))


if __name__ == "__main__":
    main()
