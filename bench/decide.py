"""In-process route decision cost (DESIGN.md §5).

64 instances, 1 M indexed GPU blocks (16-token blocks), a 32k-token prompt given as hashes.
Every instance holds a shared 2k-token system prompt plus its own sessions; queries are follow-ups
of stored sessions (a long hit on one instance) and new sessions (only the shared prefix hits).
The timed unit is ``Router.route``: lookup + policy + load accounting + recording the prompt as
pending, exactly what the controller runs per request. Each query's hashes are msgpack-decoded
just before its timed call, as the controller receives them off the wire. Also: token ids ->
fast-chain hashes for 32k tokens, and bytes per indexed block.

Blocks are stored as the live path stores them, with an engine hash each (so the engine-hash
alias map is part of the memory figure). Memory is the RSS delta of filling the index, after
``gc.collect()``; the benchmark's own copy of the sessions is built before the first reading.

    python bench/decide.py                                   # 64 instances, 1 M blocks
    python bench/decide.py --instances 1024 --blocks 10000000

Prints human-readable figures, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import time
from array import array

import msgspec
from tqdm import tqdm

from smetric_lmc.config import PolicyConfig
from smetric_lmc.hashing import fast_chain
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router

BS = 16
CS = 256
PROMPT = 32 * 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


Session = tuple[str, array]


def make_sessions(n_instances: int, n_blocks: int, rng: random.Random) -> tuple[list[int], list[Session]]:
    """The shared system prompt's hashes and every (instance, own blocks) session."""
    shared = [rng.getrandbits(64) for _ in range(2048 // BS)]
    sessions: list[Session] = []
    per_instance = n_blocks // n_instances
    for k in tqdm(range(n_instances), desc="sessions", unit="inst", leave=False, disable=None):
        inst = f"inst{k:02d}"
        held = len(shared)
        while held < per_instance:
            length = min(rng.randint(64, PROMPT // BS - len(shared)), per_instance - held)
            sessions.append((inst, array("Q", [rng.getrandbits(64) for _ in range(length)])))
            held += length
    return shared, sessions


def fill(ix: TierIndex, shared: list[int], sessions: list[Session], n_instances: int, lmcache: bool) -> None:
    """Store what the engines would report (GPU tier, with engine hashes), or the LMCache tier."""
    engine = random.Random(1)
    if not lmcache:
        shared_eng = [engine.getrandbits(64) for _ in shared]
        for k in range(n_instances):
            ix.gpu_stored_hashes(f"inst{k:02d}", shared, engine_hashes=shared_eng)
    for inst, own in tqdm(sessions, desc="lmcache" if lmcache else "gpu", unit="session", leave=False, disable=None):
        if lmcache:  # the LMCache CPU tier holds the same sessions at 256-token chunks
            ix.lmcache_admit(inst, own[:: CS // BS])
        else:
            ix.gpu_stored_hashes(inst, own, shared[-1], engine_hashes=[engine.getrandbits(64) for _ in own])


def time_us(fn, queries, cpu: list[float] | None = None) -> list[float]:
    """Wall time per call; with ``cpu``, the thread's CPU time per call is appended there too (on
    a shared machine the wall-time tail is mostly preemption, which the CPU time leaves out)."""
    dec = msgspec.msgpack.Decoder(list[int])
    out = []
    for rid, blocks, chunks, turn, est in queries:
        q = (rid, dec.decode(blocks), dec.decode(chunks), turn, est)
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        fn(q)
        out.append((time.perf_counter_ns() - t0) / 1000)
        if cpu is not None:
            cpu.append((time.thread_time_ns() - c0) / 1000)
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    ix = TierIndex(BS, CS)
    for k in range(args.instances):
        ix.register_instance(f"inst{k:02d}")
    shared, sessions = make_sessions(args.instances, args.blocks, rng)
    gc.collect()
    before = rss_mb()
    t0 = time.perf_counter()
    fill(ix, shared, sessions, args.instances, lmcache=False)
    fill_s = time.perf_counter() - t0
    gc.collect()
    gpu_mb = rss_mb() - before
    fill(ix, shared, sessions, args.instances, lmcache=True)
    gc.collect()
    lmc_mb = rss_mb() - before - gpu_mb
    sizes = ix.sizes()
    per_block = gpu_mb * 2**20 / max(1, sizes["gpu_nodes"])
    print(f"index: {sizes}; GPU tier filled in {fill_s:.1f} s ({sizes['gpu_nodes'] / fill_s:,.0f} blocks/s), "
          f"{per_block:.0f} bytes per GPU block (RSS delta, engine-hash aliases included); LMCache tier "
          f"{lmc_mb * 2**20 / max(1, sizes['lmcache_chunks']):.0f} bytes per chunk")

    router = Router(ix, LoadTracker(), PolicyConfig(name="smetric"))
    n_blocks = PROMPT // BS
    queries = []
    for q in range(args.queries):
        if q % 4 == 3:  # a new session: only the shared system prompt hits
            chain = shared + [rng.getrandbits(64) for _ in range(n_blocks - len(shared))]
            turn = 0
        else:  # a follow-up of a stored session, grown to 32k tokens
            _, own = rng.choice(sessions)
            chain = shared + own.tolist()
            chain += [rng.getrandbits(64) for _ in range(n_blocks - len(chain))]
            turn = 3
        queries.append((f"q{q}", msgspec.msgpack.encode(chain), msgspec.msgpack.encode(chain[:: CS // BS]), turn,
                        (len(chain) - 8) * BS))

    def gpu_only(q):
        rid, chain, _chunks, turn, est = q
        router.route(rid, chain, None, PROMPT, turn=turn, est_hit=est)
        router.load.on_done(rid)

    def all_tiers(q):
        rid, chain, chunks, turn, est = q
        router.route(rid, chain, chunks, PROMPT, turn=turn, est_hit=est)
        router.load.on_done(rid)

    gc.disable()
    time_us(gpu_only, queries[:200])  # warm up
    t_gpu = time_us(gpu_only, queries)
    cpu_all: list[float] = []
    t_all = time_us(all_tiers, queries, cpu_all)
    t_lookup = time_us(lambda q: ix.lookup(q[1], q[2]).local_hit_tokens(), queries)  # the index's share
    tokens = [rng.randrange(150_000) for _ in range(PROMPT)]
    t_hash = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        fast_chain(tokens, BS)
        t_hash.append((time.perf_counter_ns() - t0) / 1e6)
    gc.enable()

    print(f"route decision, GPU tier (2048 blocks/prompt): p50 {pct(t_gpu, 50):.1f} us, p99 {pct(t_gpu, 99):.1f} us")
    print(f"route decision, GPU + LMCache + global tiers:  p50 {pct(t_all, 50):.1f} us, p99 {pct(t_all, 99):.1f} us")
    print(f"  of which index lookup (all tiers):           p50 {pct(t_lookup, 50):.1f} us, p99 {pct(t_lookup, 99):.1f} us")
    print(f"  all tiers, thread CPU time (no preemption):  p50 {pct(cpu_all, 50):.1f} us, p99 {pct(cpu_all, 99):.1f} us"
          f" (load average {os.getloadavg()[0]:.1f})")
    print(f"token ids -> fast hashes, 32k tokens: median {statistics.median(t_hash):.3f} ms")
    print("targets: decide p50 <= 30 us, p99 <= 100 us; hashing <= 1 ms; <= 120 bytes per block")
    print(json.dumps({
        "decide_p50_us": round(pct(t_all, 50), 2),
        "decide_p99_us": round(pct(t_all, 99), 2),
        "decide_gpu_only_p50_us": round(pct(t_gpu, 50), 2),
        "decide_gpu_only_p99_us": round(pct(t_gpu, 99), 2),
        "lookup_p50_us": round(pct(t_lookup, 50), 2),
        "lookup_p99_us": round(pct(t_lookup, 99), 2),
        "decide_cpu_p50_us": round(pct(cpu_all, 50), 2),
        "decide_cpu_p99_us": round(pct(cpu_all, 99), 2),
        "load_average": round(os.getloadavg()[0], 2),
        "hash_32k_ms": round(statistics.median(t_hash), 4),
        "bytes_per_block": round(per_block),
        "fill_blocks_per_s": round(sizes["gpu_nodes"] / fill_s),
        "instances": args.instances,
        "gpu_blocks": sizes["gpu_nodes"],
    }))


#: One-question probes of the decision's inputs (bench/kit/probes), run as `--probe NAME [ARGS]`.
PROBES = ("est_hit_error",)

if __name__ == "__main__":
    import sys

    from kit import probes

    rc = probes.run(sys.argv[1:], PROBES, "bench/decide.py")
    if rc is not None:
        sys.exit(rc)
    main()
