"""Controller benchmark: route over ZMQ loopback, in-process route, and KV event ingest.

    python bench/controller.py                 # 64 instances, 1 M indexed blocks, 32k-token prompts
    python bench/controller.py --quick         # a smaller index, for a smoke run

Setup: the route service (RouteCore + RouteService + Prometheus counters, as the controller runs
it) serves from a separate process over tcp://127.0.0.1; one client process sends 32k-token
prompts as fast-chain hashes (2048 hashes at block size 16). Every session shares a 2k-token
system prompt held by all instances; the rest of each session is held by one instance.

Prints a human-readable report, then ONE JSON object on the last line:
``{"route_p50_us", "route_p99_us", "routes_per_s", "ingest_events_per_s", "vs_lmcache_lookup", ...}``
(null where not measured). Targets (DESIGN §5): ZMQ p99 <= 500 µs, >= 5,000 routes/s from one
process, >= 1 M events/s ingest; in-process p50 <= 30 µs, p99 <= 100 µs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from smetric_lmc.hashing import fast_chain, fast_root
from smetric_lmc.wire import HashChain

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "bench-model"
SYSTEM_TOKENS = 2048


def session_chain(s: int, prompt_tokens: int, block_size: int) -> list[int]:
    """Fast-chain hashes of session ``s``'s prompt: shared system prompt + its own history."""
    rng = np.random.default_rng(1_000_003 + s)
    system = np.random.default_rng(7).integers(0, 150_000, SYSTEM_TOKENS, dtype=np.uint32)
    own = rng.integers(0, 150_000, prompt_tokens - SYSTEM_TOKENS, dtype=np.uint32)
    return fast_chain(np.concatenate([system, own]), block_size, root=fast_root(NAMESPACE))


def n_sessions(blocks: int, prompt_tokens: int, block_size: int) -> int:
    per_session = (prompt_tokens - SYSTEM_TOKENS) // block_size
    return max(1, (blocks - SYSTEM_TOKENS // block_size) // per_session)


def percentiles_us(samples_s: list[float]) -> tuple[float, float]:
    arr = np.asarray(samples_s) * 1e6
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


# ---- server process ------------------------------------------------------------------------------


def serve(args: argparse.Namespace, conn: Connection) -> None:
    from smetric_lmc.config import InstanceConfig, PolicyConfig
    from smetric_lmc.controller.metrics import ControllerMetrics
    from smetric_lmc.controller.service import RouteCore, RouteService
    from smetric_lmc.hashing import HashSettings
    from smetric_lmc.index import TierIndex
    from smetric_lmc.load import LoadTracker
    from smetric_lmc.router import Router

    bs = args.block_size
    index = TierIndex(bs, 256, fast_root=fast_root(NAMESPACE))
    load = LoadTracker()
    insts = [InstanceConfig(id=f"vllm-{k}", http=f"http://10.0.0.{k}:8000") for k in range(args.instances)]
    for inst in insts:
        index.register_instance(inst.id)
        load.add_instance(inst.id)
    t0 = time.perf_counter()
    sessions = n_sessions(args.blocks, args.prompt_tokens, bs)
    sys_blocks = SYSTEM_TOKENS // bs
    chains = []
    for s in range(sessions):
        chain = session_chain(s, args.prompt_tokens, bs)
        chains.append(chain)
        if s < args.instances:  # every instance holds the system prompt
            index.gpu_stored_hashes(insts[s].id, chain[:sys_blocks])
        index.gpu_stored_hashes(insts[s % args.instances].id, chain)
    build_s = time.perf_counter() - t0
    router = Router(index, load, PolicyConfig(), disaggregated=False)

    # In-process: what Router.route costs alone (DESIGN §5 in-process target), on a scratch load
    # tracker so the served one starts empty.
    scratch = Router(index, LoadTracker(), PolicyConfig())
    lat = []
    for k in range(args.inproc):
        chain = chains[k % sessions]
        t = time.perf_counter()
        scratch.route(f"p{k}", chain, None, args.prompt_tokens, turn=1, est_hit=args.prompt_tokens - 512)
        lat.append(time.perf_counter() - t)
    inproc_p50, inproc_p99 = percentiles_us(lat)

    metrics = ControllerMetrics()
    core = RouteCore(index, load, router, insts, HashSettings(block_size=bs, fast_root=index.fast_root), metrics=metrics)

    async def main() -> None:
        service = RouteService(core, "tcp://127.0.0.1:*")
        endpoint = service.bind()
        conn.send({
            "endpoint": endpoint, "sessions": sessions, "gpu_nodes": index.sizes()["gpu_nodes"],
            "build_s": build_s, "inproc_p50_us": inproc_p50, "inproc_p99_us": inproc_p99,
        })
        task = asyncio.create_task(service.run())
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "stop"
        await service.close()
        task.cancel()

    asyncio.run(main())


# ---- client side ---------------------------------------------------------------------------------


def run_sequential(endpoint: str, chains: list[HashChain], args: argparse.Namespace) -> tuple[list[float], float]:
    from smetric_lmc.client import RouteClient

    est = args.prompt_tokens - 512
    lat: list[float] = []
    with RouteClient(endpoint, timeout_s=10.0) as c:
        for k in range(args.warmup):
            c.route(f"w{k}", hashes=[chains[k % len(chains)]], turn=1, est_hit_tokens=est)
            c.done(f"w{k}")
        t_all = time.perf_counter()
        for k in range(args.n):
            t = time.perf_counter()
            d = c.route(f"r{k}", hashes=[chains[k % len(chains)]], turn=1, est_hit_tokens=est)
            lat.append(time.perf_counter() - t)
            if d.instance_id is None:
                raise RuntimeError("no instance chosen")
            c.done(f"r{k}")  # keep load realistic; not timed
        wall = time.perf_counter() - t_all
    return lat, wall


async def run_pipelined(endpoint: str, chains: list[HashChain], args: argparse.Namespace) -> float:
    """Routes/s from one process with ``concurrency`` requests in flight on one client."""
    from smetric_lmc.client import AsyncRouteClient

    est = args.prompt_tokens - 512
    n = args.n
    async with AsyncRouteClient(endpoint, timeout_s=30.0) as c:
        next_k = 0

        async def worker() -> None:
            nonlocal next_k
            while next_k < n:
                k = next_k
                next_k += 1
                await c.route(f"q{k}", hashes=[chains[k % len(chains)]], turn=1, est_hit_tokens=est)

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return n / (time.perf_counter() - t)


def ingest_rate(n_events: int) -> float | None:
    try:
        from kit.vllm_payloads import ingest_benchmark
    except ImportError:
        return None
    from smetric_lmc.index import TierIndex

    def fresh() -> TierIndex:
        index = TierIndex(16)
        index.register_instance("bench")  # the instance id ingest_benchmark reports events for
        return index

    return ingest_benchmark(fresh, n_events, repeats=3)  # best of 3 passes, each on a fresh index


# ---- HOOK: LMCache controller lookup comparison ------------------------------------------------------
# kit/lmcache_reference.py runs LMCache 0.5.6's own KVController.lookup (inside the LMCache venv,
# see kit/lmcache_venv.py) on an index given as admits + chunk-hash lookups. The same index is
# built here in our TierIndex's LMCache tier and routed with Router.route; the ratio reported is
# LMCache's p50 / ours (higher = we are faster; target >= 10). Skipped (null) without the venv.
def lmcache_comparison(args: argparse.Namespace) -> tuple[float, float, float] | None:
    """(LMCache p50 µs, our p50 µs, ratio) on the same chunk-space index, or None."""
    import subprocess
    import tempfile

    from kit.lmcache_venv import lmcache_python

    script = Path(__file__).resolve().parent / "kit" / "lmcache_reference.py"
    py = lmcache_python()
    if py is None:
        print("  LMCache venv missing; comparison skipped")
        return None
    from smetric_lmc.config import PolicyConfig
    from smetric_lmc.index import TierIndex
    from smetric_lmc.load import LoadTracker
    from smetric_lmc.router import Router

    cs = 256
    per_session = (args.prompt_tokens - SYSTEM_TOKENS) // cs
    sessions = max(1, (args.blocks * args.block_size // cs) // per_session)
    rng = np.random.default_rng(11)
    system = [int(x) for x in rng.integers(-(2**62), 2**62, SYSTEM_TOKENS // cs)]
    chains = [system + [int(x) for x in rng.integers(-(2**62), 2**62, per_session)] for _ in range(sessions)]
    ids = [f"vllm-{k}" for k in range(args.instances)]
    admits = [{"instance": ids[k], "hashes": system} for k in range(min(args.instances, sessions))]
    admits += [{"instance": ids[s % args.instances], "hashes": c[len(system):]} for s, c in enumerate(chains)]
    lookups = [chains[(s * 7919) % sessions] for s in range(20)]
    index = TierIndex(args.block_size, cs)
    for iid in ids:
        index.register_instance(iid)
    for a in admits:
        index.lmcache_admit(a["instance"], a["hashes"])
    router = Router(index, LoadTracker(), PolicyConfig())
    ours = []
    for r in range(50):
        for k, chain in enumerate(lookups):
            t = time.perf_counter()
            router.route(f"l{r}-{k}", [], chain, args.prompt_tokens, turn=1, est_hit=args.prompt_tokens - 512)
            ours.append(time.perf_counter() - t)
    our_p50 = float(np.percentile(np.asarray(ours) * 1e6, 50))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"chunk_size": cs, "repeat": 50, "admits": admits, "lookups": lookups}, f)
    try:
        out = subprocess.run([str(py), str(script), f.name], capture_output=True, text=True, timeout=900)
    finally:
        Path(f.name).unlink(missing_ok=True)
    if out.returncode != 0:
        print(f"  LMCache reference failed: {out.stderr.strip()[-300:]}")
        return None
    theirs = json.loads(out.stdout)["overall"]["p50_us"]
    return theirs, our_p50, theirs / our_p50


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--prompt-tokens", type=int, default=32_768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--n", type=int, default=5000, help="timed routes")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--inproc", type=int, default=2000, help="in-process routes timed in the server")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--ingest-events", type=int, default=1_000_000)
    p.add_argument("--no-lmcache", action="store_true", help="skip the LMCache lookup comparison")
    p.add_argument("--quick", action="store_true", help="100k blocks, fewer routes and events")
    args = p.parse_args(argv)
    if args.quick:
        args.blocks, args.n, args.warmup, args.inproc, args.ingest_events = 100_000, 1000, 100, 500, 200_000

    print(f"controller bench: {args.instances} instances, {args.blocks:,} blocks, "
          f"{args.prompt_tokens}-token prompts as fast-chain hashes (block {args.block_size})")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(args, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(600):
            raise RuntimeError("server did not start")
        info = parent.recv()
        print(f"  index: {info['gpu_nodes']:,} GPU blocks in {info['sessions']} sessions, built in {info['build_s']:.1f}s")
        print(f"  in-process route: p50 {info['inproc_p50_us']:.1f} µs, p99 {info['inproc_p99_us']:.1f} µs")
        sessions = info["sessions"]
        chains = [
            HashChain("fast", args.block_size, session_chain(s, args.prompt_tokens, args.block_size))
            for s in range(min(sessions, 256))
        ]
        lat, wall = run_sequential(info["endpoint"], chains, args)
        p50, p99 = percentiles_us(lat)
        seq_rate = len(lat) / sum(lat)
        print(f"  ZMQ route (1 client, sequential): p50 {p50:.0f} µs, p99 {p99:.0f} µs, "
              f"mean {statistics.fmean(lat) * 1e6:.0f} µs -> {seq_rate:,.0f} routes/s")
        rate = asyncio.run(run_pipelined(info["endpoint"], chains, args))
        print(f"  ZMQ route (1 client process, {args.concurrency} in flight): {rate:,.0f} routes/s")
        parent.send("stop")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    ingest = ingest_rate(args.ingest_events)
    print(f"  KV event ingest (decode + apply, one core): "
          f"{'n/a (vllm_events missing)' if ingest is None else f'{ingest:,.0f} events/s'}")
    cmp = None if args.no_lmcache else lmcache_comparison(args)
    vs = None if cmp is None else cmp[2]
    if cmp is None:
        print("  vs LMCache controller lookup: not measured")
    else:
        print(f"  vs LMCache controller lookup (same chunk index, 128-chunk prompts): LMCache p50 "
              f"{cmp[0]:.0f} µs, ours {cmp[1]:.1f} µs -> {cmp[2]:.1f}x faster")
    ok = p99 <= 500 and max(rate, seq_rate) >= 5000 and (ingest is None or ingest >= 1e6)
    print(f"  targets (p99 <= 500 µs, >= 5,000 routes/s, >= 1 M events/s): {'met' if ok else 'NOT met'}")
    result: dict[str, Any] = {
        "route_p50_us": round(p50, 1),
        "route_p99_us": round(p99, 1),
        "routes_per_s": round(rate),
        "ingest_events_per_s": None if ingest is None else round(ingest),
        "vs_lmcache_lookup": None if vs is None else round(vs, 2),
        "routes_per_s_sequential": round(seq_rate),
        "inproc_route_p50_us": round(info["inproc_p50_us"], 1),
        "inproc_route_p99_us": round(info["inproc_p99_us"], 1),
    }
    print(json.dumps(result))
    return 0


#: One-question probes of the controller's parts (bench/kit/probes), run as `--probe NAME [ARGS]`.
PROBES = ("index_stalls", "load_scans", "gc_pauses", "inflight_bytes")

if __name__ == "__main__":
    from kit import probes

    rc = probes.run(sys.argv[1:], PROBES, "bench/controller.py")
    sys.exit(main() if rc is None else rc)
